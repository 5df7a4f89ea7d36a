"""The check after ``backward``: one all-reduce that tells every rank what its optimizer step
needs, read once.

A training step has to know on the host whether any rank reduced a NaN/Inf gradient (to skip
the optimizer step on every rank); it usually wants the global gradient norm (to clip and log
it) and the mean loss (to log it); with weight-difference gathers the ranks also agree once per
step on which shards changed. Each of these read on its own is a host sync that drains the
device. :func:`check_gradients` packs them into one float64 vector, sums it over the world in
one all-reduce and reads it once: the step's one host sync. The world, not the shard group:
tensor-parallel peers and HSDP replicas hold other parts or copies of the same model, and a step
skipped on some of them but not on the others would leave the model torn.
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


def _sharded(placement: Any) -> bool:
    # FSDP2 over a tensor-parallel Shard places a _StridedShard, which is_shard() does not name.
    return not placement.is_replicate() and not placement.is_partial()


def _local_shards(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> dict[int, list[torch.Tensor]]:
    """This rank's shards of the gradients, keyed by how many ranks of the world hold each of
    their elements: 1 for FSDP2 over the world or over ``dp`` with a tensor-parallel ``Shard``,
    the replicas under HSDP, the ``tp`` size for a parameter that tensor parallelism replicates.
    Dividing each square by its copies makes the world's sum the square of the global norm."""
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    want = dist.get_process_group_ranks(group)
    shards: dict[int, list[torch.Tensor]] = {}
    checked: set[int] = set()  # meshes whose shard dimension was compared with the handle's group
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        # FSDP2's shard dimension: the mesh's first sharded one (native HSDP replicates on dim 0).
        dim = next((i for i, pl in enumerate(g.placements) if _sharded(pl)), None) if isinstance(g, DTensor) else None
        if dim is None:
            raise ValueError(
                "check_gradients: the gradient norm needs FSDP2's sharded gradients; "
                f"got a {type(g).__name__} gradient; pass the parameters of the module quantize_comms was called on, or none")
        if any(pl.is_partial() for pl in g.placements):
            raise ValueError(f"check_gradients: a gradient with placements {g.placements} is not reduced yet")
        mesh = g.device_mesh
        if id(mesh) not in checked:
            ranks = dist.get_process_group_ranks(mesh.get_group(dim))
            if ranks != want:
                raise ValueError(
                    f"check_gradients: gradients sharded over ranks {ranks} but the handle's shard group is {want}; "
                    "pass the parameters of the module quantize_comms was called on")
            checked.add(id(mesh))
        distinct = math.prod(mesh.size(i) for i, pl in enumerate(g.placements) if _sharded(pl))
        shards.setdefault(world // distinct, []).append(g.to_local())
    return shards


def _squared_norm(shards: dict[int, list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for copies, tensors in shards.items():
        norm = torch.nn.utils.get_total_norm(tensors, norm_type=2.0)
        total += norm.to(device=device, dtype=torch.float64, non_blocking=True) ** 2 / copies
    return total


def _device(comms: Any, flags: list[torch.Tensor], shards: dict[int, list[torch.Tensor]]) -> torch.device:
    # The gradients' device, which is not the parameters' under CPU offload.
    if flags:
        return flags[0].device
    for tensors in shards.values():
        return tensors[0].device
    return next((p.device for m in comms.modules for p in m.parameters()), torch.device("cpu"))


def check_gradients(
    comms: Any,
    parameters: Iterable[nn.Parameter] | None = None,
    *,
    sums: Sequence[float | torch.Tensor] = (),
    agree_ahead: bool = False,
) -> GradientCheck:
    """Collective over the world (every rank of the job calls it, tensor-parallel peers and HSDP
    replicas included), after ``backward``: one all-reduce and one host read for all of it.

    Args:
        comms: the handle :func:`qsdp.quantize_comms` returned. Its reduce-scatters' non-finite
            flags are taken (reset), as :meth:`qsdp.QuantizedComms.nonfinite_gradients` does.
        parameters: the FSDP2 parameters whose gradient norm to compute (sharded over the
            handle's shard group, on a 1-D mesh or with tensor parallelism on more dimensions;
            an element that several ranks hold, an HSDP replica's or a tensor-parallel
            ``Replicate``'s, counts once). ``None``: no norm.
        sums: values to sum over the world's ranks as well: host numbers or 0-d tensors on the
            gradients' device (a loss, byte counts).
        agree_ahead: also agree on the weight-difference gathers' flags, so that the next
            optimizer step needs no agreement of its own. A promise: until the next forward the
            parameters change only through one optimizer step on every rank (taken when
            ``nonfinite`` is false) or through none; a change made outside the optimizer after
            the check is sent exactly at the gathers after the next check.
    """
    # Checked before the flags are taken: a refused call leaves them for the next check.
    shards = _local_shards(parameters, comms.topology.group) if parameters is not None else {}
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
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    values = vector.tolist()  # the one host sync of the step

    if tracker is not None:
        tracker.agreed_ahead(values[2 + len(sums):])
    norm = vector[1].sqrt().float() if parameters is not None else None
    return GradientCheck(
        nonfinite=values[0] > 0,
        grad_norm=math.sqrt(values[1]) if parameters is not None else None,
        norm=norm,
        sums=tuple(values[2:2 + len(sums)]),
    )
