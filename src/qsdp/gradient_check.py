"""The check after ``backward``: one all-reduce that tells every rank what its optimizer step
needs, read once.

A training step has to know on the host whether any rank reduced a NaN/Inf gradient (to skip
the optimizer step on every rank); it usually wants the global gradient norm (to clip and log
it) and the mean loss (to log it); with weight-difference gathers the ranks also agree once per
step on which shards changed. Each of these read on its own is a host sync that drains the
device. :func:`check_gradients` packs them into float64 vectors and reads them once: the step's
one host sync.

Two kinds of ranks must agree, so there are two kinds of vectors, each of one length on every
rank that reduces it:

* the world's: the non-finite flag, the squared norm and the caller's sums, ``2 + len(sums)``
  numbers on every rank whatever model part it holds. Tensor-parallel peers, HSDP replicas and
  pipeline stages hold other parts or copies of one model, and a step skipped on some of them but
  not on the others would leave the model torn;
* each FSDP group's: the weight-difference gathers' flags, two per ``fully_shard`` group of the
  model parts sharded over it. Only the group's ranks gather those weights, and they hold the
  same model parts; a pipeline stage with more blocks than another has more flags, so these
  cannot ride in the world's vector. A group that is the whole world does ride in it (one
  collective, as for 1-D FSDP); any other group adds one small all-reduce of its own, read in the
  same host read.
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

    ``nonfinite``: some rank reduced a NaN/Inf gradient since the last check, or the gradient
    norm is not finite (skip the optimizer step). ``grad_norm``: the global L2 norm of the
    gradients (``None`` when no parameters were given); ``norm``: the same as a 0-d float32
    tensor on the gradients' device, for ``torch.nn.utils.clip_grads_with_norm_`` without
    another sync. ``sums``: the caller's values summed over the ranks, in order.
    """

    nonfinite: bool
    grad_norm: float | None
    norm: torch.Tensor | None
    sums: tuple[float, ...]


def _is_handle(comms: Any) -> bool:
    """Whether ``comms`` is what :func:`qsdp.quantize_comms` returns (read by what the check uses,
    so that this module, which the handle's own ``nonfinite_gradients`` imports, need not import
    the handle's module back)."""
    return all(hasattr(comms, name) for name in ("topology", "reduce_scatters", "all_gathers", "group_parameters"))


def _handles(comms: Any) -> list[Any]:
    """``comms`` as a list of handles: one handle, or one per model part of this rank."""
    handles = [comms] if _is_handle(comms) else list(comms) if isinstance(comms, (list, tuple)) else None
    if not handles or not all(_is_handle(h) for h in handles):
        raise TypeError(
            "check_gradients: comms must be the handle qsdp.quantize_comms returned, or a list of them "
            f"(one per model part of this rank); got {type(comms).__name__}")
    if len({id(h) for h in handles}) != len(handles):
        raise ValueError("check_gradients: the same handle was given twice; give each model part's handle once")
    return handles


def _ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _sharded(placement: Any) -> bool:
    # FSDP2 over a tensor-parallel Shard places a _StridedShard, which is_shard() does not name.
    return not placement.is_replicate() and not placement.is_partial()


def _handle_of(mesh: Any, handles: list[Any]) -> Any:
    """The handle whose shard group is a dimension of ``mesh``. Raises when there is none."""
    dims = _mesh_dims(mesh)
    handle = next((h for h in handles if _ranks(h.topology.group) in dims), None)
    if handle is None:
        raise ValueError(
            f"check_gradients: gradients sharded over a mesh whose dimensions hold ranks {[list(d) for d in dims]} "
            f"that no handle shards over (their shard groups: {[list(_ranks(h.topology.group)) for h in handles]}); "
            "pass the parameters of the modules quantize_comms was called on, and every handle of this rank")
    return handle


def _part_ranks(handle: Any) -> int:
    """How many ranks of the world hold ``handle``'s model part: its parameters' largest mesh
    (the FSDP group, with the tensor-parallel ranks where the part has a tensor-parallel
    parameter, and the replicas of FSDP2's own HSDP), times the replicas of qsdp's HSDP recipe,
    whose replicate group is no dimension of FSDP2's mesh. Ranks of other pipeline stages hold
    other parts."""
    from torch.distributed.tensor import DTensor

    meshes = [p.device_mesh for params in handle.group_parameters for p in params if isinstance(p, DTensor)]
    largest = max(meshes, key=lambda m: m.size(), default=None)
    ranks = largest.size() if largest is not None else handle.topology.world_size
    replicate = handle.replicate_group
    if replicate is not None and (largest is None or _ranks(replicate) not in _mesh_dims(largest)):
        ranks *= replicate.size()
    return ranks


def _mesh_dims(mesh: Any) -> list[tuple[int, ...]]:
    """The ranks of this rank's process group along each dimension of ``mesh`` (no tensor read)."""
    return [_ranks(mesh.get_group(i)) for i in range(mesh.ndim)]


def _local_shards(parameters: Iterable[nn.Parameter], handles: list[Any]
                  ) -> tuple[dict[int, list[torch.Tensor]], set[int]]:
    """This rank's shards of the gradients, keyed by how many ranks of the world hold each of
    their elements: 1 for FSDP2 over the world or over ``dp`` with a tensor-parallel ``Shard``,
    the replicas under HSDP, the ``tp`` size for a parameter that tensor parallelism replicates
    or leaves alone; ranks of other pipeline stages hold none of them. Dividing each square by its
    copies makes the world's sum the square of the global norm. Also returns the ids of the
    parameters taken."""
    from torch.distributed.tensor import DTensor

    shards: dict[int, list[torch.Tensor]] = {}
    taken: set[int] = set()
    part_ranks: dict[int, int] = {}  # per mesh: found once per call, not per parameter
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        if not isinstance(g, DTensor) or not any(_sharded(pl) for pl in g.placements):
            raise ValueError(
                "check_gradients: the gradient norm needs FSDP2's sharded gradients; "
                f"got a {type(g).__name__} gradient; pass the parameters of the module quantize_comms was called on, or none")
        if any(pl.is_partial() for pl in g.placements):
            raise ValueError(f"check_gradients: a gradient with placements {g.placements} is not reduced yet")
        mesh = g.device_mesh
        if id(mesh) not in part_ranks:
            part_ranks[id(mesh)] = _part_ranks(_handle_of(mesh, handles))
        distinct = math.prod(mesh.size(i) for i, pl in enumerate(g.placements) if _sharded(pl))
        shards.setdefault(part_ranks[id(mesh)] // distinct, []).append(g.to_local())
        taken.add(id(p))
    return shards, taken


def _squared_norm(shards: dict[int, list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for copies, tensors in shards.items():
        norm = torch.nn.utils.get_total_norm(tensors, norm_type=2.0)
        total += norm.to(device=device, dtype=torch.float64, non_blocking=True) ** 2 / copies
    return total


def _flags(handles: list[Any], taken: set[int]) -> list[torch.Tensor]:
    """The handles' non-finite flags since the last check (taken, i.e. reset). A group FSDP2
    reduced without calling qsdp's reduce-scatter (a shard group of one rank: one GPU, or dp = 1
    beside tensor or pipeline parallelism) set no flag: its local gradients are looked at instead,
    unless the norm already takes them (a non-finite norm counts as a flag)."""
    from torch.distributed.tensor import DTensor

    flags, unreduced = [], []
    for h in handles:
        for rs, params in zip(h.reduce_scatters, h.group_parameters):
            flag = rs.take_nonfinite_flag()
            if flag is not None:
                flags.append(flag)
                continue
            for p in params:
                if p.grad is not None and id(p) not in taken:
                    unreduced.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    if unreduced:
        flags.append(~torch.isfinite(torch.nn.utils.get_total_norm(unreduced, norm_type=2.0)))
    return flags


def _device(handles: list[Any], flags: list[torch.Tensor], shards: dict[int, list[torch.Tensor]]) -> torch.device:
    # The gradients' device, which is not the parameters' under CPU offload.
    if flags:
        return flags[0].device
    for tensors in shards.values():
        return tensors[0].device
    return next((p.device for h in handles for m in h.modules for p in m.parameters()), torch.device("cpu"))


def _ahead_by_group(handles: list[Any], agree_ahead: bool) -> dict[tuple[int, ...], list[Any]]:
    """The weight-difference handles whose flags to agree on ahead, by their FSDP group's ranks
    (``()``: the whole world, whose flags ride in the world's vector), in one order on every rank
    (sorted by ranks: two ranks that share several groups reduce them in the same order)."""
    world = set(range(dist.get_world_size()))
    by_group: dict[tuple[int, ...], list[Any]] = {}
    for h in handles if agree_ahead else ():
        if h.config.weights.mode == "difference":
            ranks = _ranks(h.topology.group)
            by_group.setdefault(() if set(ranks) == world else ranks, []).append(h)
    return dict(sorted(by_group.items()))


def _vectors(flags: list[torch.Tensor], shards: dict[int, list[torch.Tensor]], sums: Sequence[float | torch.Tensor],
             ahead: dict[tuple[int, ...], list[bool]], device: torch.device
             ) -> tuple[torch.Tensor, dict[tuple[int, ...], torch.Tensor]]:
    """The float64 vectors to all-reduce: the world's (non-finite count, squared norm, ``sums``,
    and the weight-difference flags of a group that is the whole world, keyed ``()``) and each
    other FSDP group's flags. Host numbers reach the device in one copy."""
    host = [float(v) for v in sums if not isinstance(v, torch.Tensor)] + [float(f) for fs in ahead.values() for f in fs]
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
    by_group: dict[tuple[int, ...], torch.Tensor] = {}
    for key, fs in ahead.items():
        by_group[key] = host_values[h:h + len(fs)]
        h += len(fs)
    return torch.cat(pieces + ([by_group.pop(())] if () in by_group else [])), by_group


def _agreed(ahead_groups: dict[tuple[int, ...], list[Any]], values: list[float]) -> None:
    """Give each handle's tracker its share of the agreed weight-difference flags, in the order
    :func:`_vectors` laid them out (the world's group first where it rides in the world's)."""
    at = 0
    for hs in ahead_groups.values():
        for handle in hs:
            n = len(handle.tracker.watches) * 2
            handle.tracker.agreed_ahead(values[at:at + n])
            at += n


def check_gradients(
    comms: Any,
    parameters: Iterable[nn.Parameter] | None = None,
    *,
    sums: Sequence[float | torch.Tensor] = (),
    agree_ahead: bool = False,
) -> GradientCheck:
    """Collective over the world (every rank of the job calls it once per step, tensor-parallel
    peers, HSDP replicas and every pipeline stage included), after ``backward``: one all-reduce
    over the world, one over each FSDP group whose weight-difference flags do not ride in it, and
    one host read for all of it.

    Args:
        comms: the handle :func:`qsdp.quantize_comms` returned, or a list of them: one per model
            part this rank holds (pipeline stages; in the same order on the ranks of one FSDP
            group). Their reduce-scatters' non-finite flags are taken (reset), as
            :meth:`qsdp.QuantizedComms.nonfinite_gradients` does. A group FSDP2 reduces without
            them (a shard group of one rank) is flagged from its local gradients.
        parameters: the FSDP2 parameters whose gradient norm to compute, those of every model part
            of this rank (sharded over a handle's shard group, on a 1-D mesh or with tensor
            parallelism or FSDP2's HSDP on more dimensions; an element that several ranks hold, an
            HSDP replica's or a tensor-parallel ``Replicate``'s, counts once; a rank of another
            pipeline stage holds other elements). ``None``: no norm. A non-finite norm sets
            ``nonfinite``.
        sums: values to sum over the world's ranks as well, as many on every rank: host numbers or
            0-d tensors on the gradients' device (a loss, 0 on pipeline stages without one).
        agree_ahead: also agree on the weight-difference gathers' flags, so that the next
            optimizer step needs no agreement of its own. A promise: until the next forward the
            parameters change only through one optimizer step on every rank (taken when
            ``nonfinite`` is false) or through none; a change made outside the optimizer after
            the check is sent exactly at the gathers after the next check.
    """
    handles = _handles(comms)
    # Checked before the flags are taken: a refused call leaves them for the next check.
    shards, taken = _local_shards(parameters, handles) if parameters is not None else ({}, set())
    flags = _flags(handles, taken)
    device = _device(handles, flags, shards)
    ahead_groups = _ahead_by_group(handles, agree_ahead)
    ahead = {key: [f for h in hs for f in h.tracker.ahead_flags()] for key, hs in ahead_groups.items()}

    world_vector, by_group = _vectors(flags, shards, sums, ahead, device)
    dist.all_reduce(world_vector, op=dist.ReduceOp.SUM)
    for key, vector in by_group.items():
        dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=ahead_groups[key][0].topology.group)
    values = torch.cat([world_vector, *by_group.values()]).tolist()  # the one host sync of the step
    _agreed(ahead_groups, values[2 + len(sums):])
    squared = values[1]
    return GradientCheck(
        nonfinite=values[0] > 0 or not math.isfinite(squared),
        grad_norm=math.sqrt(squared) if parameters is not None else None,
        norm=world_vector[1].sqrt().float() if parameters is not None else None,
        sums=tuple(values[2:2 + len(sums)]),
    )
