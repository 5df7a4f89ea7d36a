"""The FSDP2 layouts users run, built the same way with and without qsdp.

``build(layout, ...)`` shards ``fsdp_models.TinyNet`` as a user of that layout would and returns
the model and how to feed it. Layouts (ranks numbered node-major, nodes of ``PER_NODE``):

* ``1d``: ``fully_shard`` over the world;
* ``hsdp``: qsdp's HSDP recipe, 1-D FSDP2 inside the node, replicas across nodes;
* ``dp_tp``: a ``(dp, tp)`` mesh, tensor parallelism on each block's MLP, FSDP2 on ``mesh["dp"]``
  (whose ranks sit on different nodes: one per node);
* ``3d``: a ``(dp_replicate, dp_shard, tp)`` mesh, TP on the MLP, FSDP2 on ``mesh["dp_shard"]``,
  replicas over ``dp_replicate`` (qsdp's HSDP recipe with TP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_models as fm

PER_NODE = {"1d": 2, "hsdp": 2, "dp_tp": 2, "3d": 4}
WORLD = {"1d": 4, "hsdp": 4, "dp_tp": 4, "3d": 8}


@dataclass
class Built:
    model: Any
    data_rank: int  # which batch this rank trains on (TP peers share one)
    replicate_group: Any = None


class Checkpointed(nn.Module):
    """``inner`` with activation checkpointing: its activations are recomputed in backward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _tensor_parallel(model, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def build(layout: str, *, reshard: bool | int = True, param_dtype=None, reduce_dtype=None,
          checkpoint: bool = False, compile_blocks: bool = False, native_hsdp: bool = False, seed: int = 0) -> Built:
    """``fsdp_models.TinyNet`` sharded as ``layout`` says. ``native_hsdp``: the HSDP layouts on
    FSDP2's own 2-D HSDP mesh instead of qsdp's recipe (the reference qsdp is compared with)."""
    torch.manual_seed(seed)
    model = fm.TinyNet(32, 2)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    rank = dist.get_rank()
    replicate_group = None
    if layout == "1d":
        mesh, data_rank = None, rank
    elif layout == "hsdp":
        full = _mesh((2, 2), ("replicate", "shard"))
        mesh, data_rank = (full if native_hsdp else full["shard"]), rank
        replicate_group = full["replicate"].get_group()
    elif layout == "dp_tp":
        full = _mesh((2, 2), ("dp", "tp"))
        _tensor_parallel(model, full["tp"])
        mesh, data_rank = full["dp"], full["dp"].get_local_rank()
    elif layout == "3d":
        full = _mesh((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
        _tensor_parallel(model, full["tp"])
        mesh = full["dp_replicate", "dp_shard"] if native_hsdp else full["dp_shard"]
        data_rank = full["dp_replicate"].get_local_rank() * 2 + full["dp_shard"].get_local_rank()
        replicate_group = full["dp_replicate"].get_group()
    else:
        raise ValueError(layout)
    for block in model.blocks:
        if checkpoint:
            block.fc1 = Checkpointed(block.fc1)
        if compile_blocks:
            block.compile()
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return Built(model, data_rank, replicate_group)


def train(built: Built, steps: int, accumulate: int = 1) -> list[float]:
    """``fsdp_models.train`` on the batches of this rank's data-parallel place."""
    return fm.train(built.model, steps, built.data_rank, accumulate=accumulate)


def full_params(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().float().clone() for p in model.parameters()]
