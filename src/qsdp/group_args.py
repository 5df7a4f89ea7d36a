"""The process-group arguments of :func:`qsdp.quantize_comms` (``group=``, ``replicate_group=``)
as process groups: a 1-D ``DeviceMesh`` stands for its one group; anything else is refused in one
line naming what was passed, before any collective."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .config import ConfigError

__all__ = ["as_process_group"]


def as_process_group(value: Any, name: str) -> dist.ProcessGroup | None:
    """``value`` as the process group it names (``None`` stays ``None``); raises
    :class:`qsdp.ConfigError` for a mesh of several dimensions or anything that is no group."""
    if value is None or isinstance(value, dist.ProcessGroup):
        return value
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(value, DeviceMesh):
        if value.ndim == 1:
            return value.get_group()
        dims = value.mesh_dim_names or tuple(range(value.ndim))
        raise ConfigError(f"{name}= is a {value.ndim}-D DeviceMesh {tuple(value.shape)}: pass the one dimension it "
                          f"means ({name}=mesh[{dims[-1]!r}], or mesh.get_group({dims[-1]!r})), or leave {name}= out "
                          "and qsdp reads the mesh FSDP2 shards over")
    raise ConfigError(f"{name}= must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, "
                      f"got a {type(value).__name__}")
