"""The check after ``backward``: one all-reduce that tells every rank what its optimizer step
needs, read once.

A training step has to know on the host whether any rank reduced a NaN/Inf gradient (to skip
the optimizer step on every rank); it usually wants the global gradient norm (to clip and log
it) and the mean loss (to log it); with weight-difference gathers the ranks also agree once per
step on which shards changed. Each of these read on its own is a host sync that drains the
device. :func:`check_gradients` packs them into one float64 vector, sums it over the shard
group (under HSDP, the world) in one all-reduce and reads it once: the step's one host sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm.host_values import to_device


@dataclass(frozen=True)
class GradientCheck:
    """What :func:`check_gradients` found, the same on every rank.

    ``nonfinite``: some rank reduced a NaN/Inf gradient since the last check (skip the optimizer
    step). ``grad_norm``: the global L2 norm of the gradients (``None`` when no parameters were
    given); ``norm``: the same as a 0-d float32 tensor on the gradients' device, for
    ``torch.nn.utils.clip_grads_with_norm_`` without another sync. ``sums``: the caller's values
    summed over the ranks, in order.
    """

    nonfinite: bool
    grad_norm: float | None
    norm: torch.Tensor | None
    sums: tuple[float, ...]


def _local_shards(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """This rank's shards of the gradients: each element lives on exactly one rank of ``group``,
    so the squares of the shards sum to the square of the global norm."""
    from torch.distributed.tensor import DTensor

    shards, meshes = [], {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        if not isinstance(g, DTensor) or g.device_mesh.ndim != 1 or not g.placements[0].is_shard():
            raise ValueError(
                "check_gradients: the gradient norm needs FSDP2's gradients sharded over a 1-D mesh; "
                f"got a {type(g).__name__} gradient" + (f" on a {g.device_mesh.ndim}-D mesh" if isinstance(g, DTensor) else "")
                + "; pass the parameters of the module quantize_comms was called on, or none")
        meshes.setdefault(id(g.device_mesh), g.device_mesh)
        shards.append(g.to_local())
    want = dist.get_process_group_ranks(group)
    for mesh in meshes.values():
        if dist.get_process_group_ranks(mesh.get_group()) != want:
            raise ValueError(
                f"check_gradients: gradients sharded over ranks {dist.get_process_group_ranks(mesh.get_group())} "
                f"but the handle's shard group is {want}; pass the parameters of the module quantize_comms was called on")
    return shards


def _squared_norm(shards: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not shards:
        return torch.zeros(1, dtype=torch.float64, device=device)
    norm = torch.nn.utils.get_total_norm(shards, norm_type=2.0)
    return (norm.to(device=device, dtype=torch.float64, non_blocking=True) ** 2).reshape(1)


def _sum_group(comms: Any) -> dist.ProcessGroup:
    """The shard group; under HSDP the world, which its shard groups and replicas tile, so that
    the sums hold every rank's value."""
    if comms.replicas == 1:
        return comms.topology.group
    world = dist.get_world_size()
    if world != comms.topology.world_size * comms.replicas:
        raise ValueError(
            f"check_gradients: HSDP over {comms.replicas} replicas of {comms.topology.world_size} ranks must "
            f"span the world of {world} ranks, as qsdp.hsdp_groups builds it")
    return dist.group.WORLD


def _device(comms: Any, flags: list[torch.Tensor], shards: list[torch.Tensor]) -> torch.device:
    # The gradients' device, which is not the parameters' under CPU offload.
    if flags:
        return flags[0].device
    if shards:
        return shards[0].device
    return next((p.device for m in comms.modules for p in m.parameters()), torch.device("cpu"))


def check_gradients(
    comms: Any,
    parameters: Iterable[nn.Parameter] | None = None,
    *,
    sums: Sequence[float | torch.Tensor] = (),
    agree_ahead: bool = False,
) -> GradientCheck:
    """Collective over the handle's shard group (under HSDP: the world), after ``backward``: one
    all-reduce and one host read for all of it.

    Args:
        comms: the handle :func:`qsdp.quantize_comms` returned. Its reduce-scatters' non-finite
            flags are taken (reset), as :meth:`qsdp.QuantizedComms.nonfinite_gradients` does.
        parameters: the FSDP2 parameters whose gradient norm to compute (sharded over the
            handle's shard group; under HSDP the replicas' equal shards count once). ``None``:
            no norm.
        sums: values to sum over the ranks as well: host numbers or 0-d tensors on the
            gradients' device (a loss, byte counts).
        agree_ahead: also agree on the weight-difference gathers' flags, so that the next
            optimizer step needs no agreement of its own. A promise: until the next forward the
            parameters change only through one optimizer step on every rank (taken when
            ``nonfinite`` is false) or through none; a change made outside the optimizer after
            the check is sent exactly at the gathers after the next check.
    """
    # Checked before the flags are taken: a refused call leaves them for the next check.
    shards = _local_shards(parameters, comms.topology.group) if parameters is not None else []
    group = _sum_group(comms)
    flags = [f for f in (rs.take_nonfinite_flag() for rs in comms.reduce_scatters) if f is not None]
    device = _device(comms, flags, shards)
    tracker = comms.tracker if agree_ahead and comms.config.weights.mode == "difference" else None
    ahead = tracker.ahead_flags() if tracker is not None else []

    host = [float(v) for v in sums if not isinstance(v, torch.Tensor)] + [float(f) for f in ahead]
    host_values = to_device(host, torch.float64, device) if host else None
    bad = torch.zeros(1, dtype=torch.float64, device=device)
    for flag in flags:
        bad += flag.to(device=device, dtype=torch.float64)
    pieces = [bad, _squared_norm(shards, device)]
    h = 0
    for v in sums:
        if isinstance(v, torch.Tensor):
            pieces.append(v.detach().to(device=device, dtype=torch.float64).reshape(1))
        else:
            pieces.append(host_values[h:h + 1])
            h += 1
    if ahead:
        pieces.append(host_values[h:])
    vector = torch.cat(pieces)
    dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
    values = vector.tolist()  # the one host sync of the step

    if tracker is not None:
        tracker.agreed_ahead(values[2 + len(sums):])
    # Under HSDP every replica added the same shards.
    norm = (vector[1] / comms.replicas).sqrt().float() if parameters is not None else None
    return GradientCheck(
        nonfinite=values[0] > 0,
        grad_norm=math.sqrt(values[1] / comms.replicas) if parameters is not None else None,
        norm=norm,
        sums=tuple(values[2:2 + len(sums)]),
    )
