"""``quantize_comms(module, config)``: plug qsdp's collectives into every FSDP2 module."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.distributed.fsdp import FSDPModule

from . import hsdp as _hsdp
from ._fsdp2 import all_gather_comms, all_gather_row, fsdp_state, gradient_divide_factor, has_custom_divide_factor, has_run, \
    shard_groups, shard_row_spans, unevenly_split_params
from .comm.all_gather import DifferenceAllGather, PlainAllGather, QuantizedAllGather
from .comm.base import GradReduceScatter, WeightAllGather
from .comm.meter import METER, ByteMeter, Stats
from .comm.reduce_scatter import PlainReduceScatter, QuantizedReduceScatter
from .comm.topology import Topology, build_topologies, release
from .comm.versions import ChangeTracker, managed_parameters
from .config import ConfigError, QuantConfig, config_diff, resolve_config
from .group_args import as_process_group
from .guard import AccuracyGuard, GuardConfig, as_guard_config

_ALL_GATHERS = {"plain": PlainAllGather, "direct": QuantizedAllGather, "difference": DifferenceAllGather}
POST_FORWARD_GROUP = "post-forward group (reshard_after_forward=<int>)"


@dataclass
class QuantizedComms:
    """What :func:`quantize_comms` attached: the config, the topology and, per FSDP parameter
    group (one ``fully_shard`` call, in ``module.modules()`` order), its all-gather and
    reduce-scatter objects; ``meter`` counts the bytes of this handle's comms only
    (:meth:`comm_stats`), and passes them on to the process-wide meter (:func:`qsdp.comm_stats`).
    ``group_parameters``: per FSDP parameter group, its parameters (sharded). ``replicas``: HSDP's
    replicate group size (1 without HSDP); ``replicate_group``: the one ``replicate_group=`` named.
    ``guard``: the accuracy guard (``guard=``), whose ``levels``, ``rungs(i)`` and ``escalations``
    say which groups took more bits, or ``None``. Printed, it is one line."""

    config: QuantConfig
    topology: Topology
    modules: list[nn.Module] = field(default_factory=list)
    all_gathers: list[WeightAllGather] = field(default_factory=list)
    reduce_scatters: list[GradReduceScatter] = field(default_factory=list)
    group_parameters: list[list[nn.Parameter]] = field(default_factory=list)
    tracker: ChangeTracker = field(default_factory=ChangeTracker)
    meter: ByteMeter = field(default_factory=lambda: ByteMeter(parent=METER))
    replicas: int = 1
    replicate_group: dist.ProcessGroup | None = None
    guard: AccuracyGuard | None = None

    _hooks: list[Any] = field(default_factory=list)
    _topologies: list[Topology] = field(default_factory=list)

    def __repr__(self) -> str:
        # The dataclass repr would print every module tree and process group it holds.
        t = self.topology
        hsdp = f", HSDP over {self.replicas} replicas" if self.replicas > 1 else ""
        return (f"QuantizedComms({self.config.name!r}, {len(self.modules)} FSDP groups, "
                f"{t.world_size} ranks = {t.nodes} node{'s' if t.nodes != 1 else ''} x {t.ranks_per_node}{hsdp})")

    def nonfinite_gradients(self) -> bool:
        """Collective over the world: ``True`` on every rank if any rank reduced a NaN/Inf
        gradient since the last call (a group of a one-rank shard group, which FSDP2 reduces
        without qsdp's reduce-scatter, is looked at in its local gradients). Call it after
        ``backward`` and skip the optimizer step when it is ``True`` (weights, optimizer state and
        weight-difference replicas then stay unchanged and identical on all ranks). One host read,
        which also carries the weight-difference gathers' agreement for the coming optimizer
        step, so the next forward reads nothing: :func:`qsdp.check_gradients` with
        ``agree_ahead=True`` (and its promise), which can also take the gradient norm and a loss
        in the same all-reduce. A rank holding several model parts (pipeline stages) checks
        them together, once a step: ``qsdp.check_gradients(handles, agree_ahead=True).nonfinite``."""
        from .gradient_check import check_gradients

        return check_gradients(self, agree_ahead=True).nonfinite

    def comm_stats(self, reset: bool = True) -> Stats:
        """This handle's bytes, elements and bits per element on the wire since its last reset
        (this rank only), in :func:`qsdp.comm_stats`' format; resetting leaves the process-wide
        view untouched."""
        return self.meter.snapshot(reset=reset)

    def _bind_meter(self) -> None:
        """Count every comm of this handle in :attr:`meter`."""
        for comm in [*self.all_gathers, *self.reduce_scatters]:
            comm.bind_meter(self.meter)

    def close(self) -> None:
        """Remove the hooks this handle registered, release the node subgroups it holds (pooled
        for the next handle on the same ranks, destroyed with the world by
        ``destroy_process_group()``) and let :func:`quantize_comms` be called on the model again.
        Until that call replaces them, the comms stay attached, but the weight all-gathers send
        the exact shards, as FSDP2's own all-gather does (without the hooks nothing would tell a
        replica that the weights changed), while the gradient reductions keep their config.
        Local, no collective."""
        _TRACKERS.discard(self.tracker)
        if self.guard is not None:
            _TRACKERS.discard(self.guard)
            self.guard.close()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for t in self._topologies:
            release(t)
        self._topologies.clear()
        for comm in [*self.all_gathers, *self.reduce_scatters]:
            comm.closed = True

    def reset_replicas(self) -> None:
        """Collective by convention (every rank calls it): make the next gather of every
        weight-difference comm send exact values. Not needed after a change of the parameters,
        which the next forward sees (docs/checkpoints.md, "What a gather sees"); it forgets the
        replicas, e.g. before handing the comms weights they must not be compared with."""
        for ag in self.all_gathers:
            ag.reset()
        for w in self.tracker.watches:
            w.rebase()

    def state_dict(self, replicas: bool = True) -> dict[str, Any]:
        """What a resume needs to continue bit for bit: the comms' counters (small, per rank) and,
        with ``replicas``, the weight-difference replica rows this rank holds, as tensors keyed
        ``all_gather.{i}.replica.rows.g{group}_row{r}`` (``group``: a digest of the shard group's
        ranks): every rank holding a row holds the same values, so DCP saves each row once and
        loads it on every rank that holds it. Before the first gather the rows are zeros of
        their shape with ``held`` false, so that a fresh handle's state dict can be loaded into
        in place (DCP's ``load``). ``qsdp.train.checkpoint`` saves the rows itself
        (``replicas=False``)."""
        all_gathers = {}
        group = _group_digest(self.topology.group)
        for i, ag in enumerate(self.all_gathers):
            entry = ag.state_dict()
            rows, held = ag.replica_state() if replicas and ag.holds_replicas() else ({}, False)
            if rows:
                entry["replica"] = {"held": held, "rows": {f"g{group}_row{r}": t for r, t in rows.items()}}
            all_gathers[str(i)] = entry
        state = {
            "all_gather": all_gathers,
            "reduce_scatter": {str(i): rs.state_dict() for i, rs in enumerate(self.reduce_scatters)},
        }
        if self.guard is not None:
            state["guard"] = self.guard.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Call after the parameters were loaded: their counters become the reference.
        ``state`` is what :meth:`state_dict` returned; other keys are a ``ValueError``. Replica
        rows in it (held when saved, every row this rank holds) are restored; missing or not
        held, the replicas are re-established with exact values at the next gather. A guard's
        state (its groups' levels) is restored first; saved by a guarded handle and loaded into
        one without a guard, it is ignored with a warning (the groups go back to the config)."""
        expected = {"all_gather", "reduce_scatter"}
        keys = set(state) - {"guard"} if isinstance(state, Mapping) else None
        if keys != expected:
            got = "not a dict" if keys is None else "; ".join(
                f"{what} keys {', '.join(map(repr, sorted(map(str, ks))))}"
                for what, ks in (("unexpected", keys - expected), ("missing", expected - keys)) if ks)
            raise ValueError(f"QuantizedComms.load_state_dict: expected QuantizedComms.state_dict()'s "
                             f"'all_gather' and 'reduce_scatter', got {got}")
        if "guard" in state and self.guard is not None:
            self.guard.load_state_dict(state["guard"])
        elif "guard" in state and state["guard"]["escalations"] and dist.get_rank() == 0:
            warnings.warn("qsdp: the loaded comm state holds the accuracy guard's escalations, but this handle has no "
                          "guard: every group travels as the config says again (pass guard= to keep them)",
                          stacklevel=2)
        group = _group_digest(self.topology.group)
        for i, ag in enumerate(self.all_gathers):
            entry = state["all_gather"].get(str(i), {})
            ag.load_state_dict(entry)
            if "replica" in entry:
                saved = entry["replica"]
                rows = {r: saved["rows"].get(f"g{group}_row{r}") for r in ag.rows}
                whole = bool(saved.get("held")) and all(v is not None for v in rows.values())
                ag.load_replica_rows(rows if whole else None)
        for i, rs in enumerate(self.reduce_scatters):
            rs.load_state_dict(state["reduce_scatter"].get(str(i), {}))


def _group_digest(group: dist.ProcessGroup) -> str:
    """A short digest of the world size and the global ranks of ``group``: the replica rows of
    two shard groups (the dp groups of a dp x tp mesh, two pipeline stages) never share a key."""
    ranks = dist.get_process_group_ranks(group)
    return hashlib.sha256(f"{dist.get_world_size()}:{ranks}".encode()).hexdigest()[:12]


def check_same_config(config: QuantConfig, group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = None,
                      *, problem: str | None = None, guard: GuardConfig | None = None) -> None:
    """Collective over ``group`` (default: the world), or over the dimensions of a mesh given as
    its groups in order (every rank of the mesh joins each): raises ``ConfigError`` on every rank
    of it, naming the fields that differ, if any rank passed a different config. Along a mesh, each
    dimension passes on the distinct configs seen so far, so after the last one every rank has
    seen every rank's config: ranks of other meshes (other pipeline stages) make no call.
    ``problem``: what this rank alone found wrong with its arguments; the lowest rank's is raised
    on every rank, as ``rank R: ...``, instead of that rank raising while the others wait.
    ``guard``: the accuracy guard's config, compared as a field ``guard`` of the config (ranks
    guarding different steps would wait for each other's measurements)."""
    groups = list(group) if isinstance(group, (list, tuple)) else [group]
    agreed = {**config.to_dict(), "guard": None if guard is None else dataclasses.asdict(guard)}
    mine = json.dumps(agreed, sort_keys=True)
    seen = {mine: dist.get_rank()}  # each distinct config, with the first global rank that holds it
    problems = {} if problem is None else {dist.get_rank(): problem}
    for g in groups:
        everyone: list[Any] = [None] * dist.get_world_size(g)
        dist.all_gather_object(everyone, (seen, problems), group=g)
        for theirs, found in everyone:
            for text, rank in theirs.items():
                seen[text] = min(rank, seen.get(text, rank))
            problems.update(found)
    if problems:
        rank = min(problems)
        raise ConfigError(f"rank {rank}: {problems[rank]}")
    if len(seen) == 1:
        return
    base = agreed
    other, rank = min(((t, r) for t, r in seen.items() if t != mine), key=lambda item: item[1])
    diffs = config_diff(base, json.loads(other))
    raise ConfigError(
        f"qsdp config differs across ranks: rank {dist.get_rank()} vs rank {rank}: "
        + "; ".join(f"{k}: {a!r} != {b!r}" for k, a, b in diffs)
    )


def _mesh_groups(module: nn.Module, group: dist.ProcessGroup) -> list[dist.ProcessGroup]:
    """The groups of every dimension of the largest mesh ``module``'s parameters live on (its
    model part's: the FSDP group, with the tensor-parallel one on a dp x tp mesh; a parameter that
    tensor parallelism left alone lives on the dp dimension only), or ``[group]`` where no
    parameter is a DTensor; local, no collective."""
    from torch.distributed.tensor import DTensor

    meshes = [p.device_mesh for p in module.parameters() if isinstance(p, DTensor)]
    mesh = max(meshes, key=lambda m: m.size(), default=None)
    if mesh is None:
        return [group]
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    if not any(_ranks(g) == _ranks(group) for g in groups):
        groups.append(group)
    return groups


def _shard_groups(fsdp_modules: list[nn.Module]) -> list[list[nn.Module]]:
    """``fsdp_modules`` grouped by ``fully_shard`` call, in order of first appearance: the
    modules of ``fully_shard([norm, output])`` share one parameter group, one all-gather and one
    reduce-scatter, so they get one comm that watches all of their parameters."""
    groups: dict[int, list[nn.Module]] = {}
    for m in fsdp_modules:
        groups.setdefault(id(fsdp_state(m)), []).append(m)
    return list(groups.values())


def _no_fsdp2_module(module: nn.Module) -> ValueError:
    """The error for a ``module`` with no FSDP2 module under it, naming the likely cause."""
    from torch.nn.parallel import DistributedDataParallel

    what = f"no FSDP2 module under {type(module).__name__}"
    if isinstance(module, DistributedDataParallel):
        what += f" (it replicates {type(module.module).__name__} with DDP instead of sharding it)"
    # Accelerate (and the HF Trainer through it) keep their setup in PartialState's shared dict;
    # read only if the program imported it.
    accelerate_state = getattr(sys.modules.get("accelerate.state"), "PartialState", None)
    distributed_type = getattr(accelerate_state, "_shared_state", {}).get("distributed_type")
    distributed_type = getattr(distributed_type, "value", distributed_type)
    if distributed_type == "MULTI_CPU":
        return ValueError(
            f"{what}: Accelerate did not enable FSDP: no accelerator? (distributed_type={distributed_type}; "
            "Accelerate drops the FSDP plugin on a machine without one: see the CPU workaround in docs/recipes.md)"
        )
    if distributed_type is not None and distributed_type != "FSDP":
        return ValueError(f"{what}: Accelerate did not enable FSDP (distributed_type={distributed_type}): give "
                          "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))")
    if distributed_type is not None:
        return ValueError(f"{what}: Accelerate enabled FSDP, but this model was not prepared: call quantize_comms "
                          "on the model accelerator.prepare returned")
    return ValueError(f"{what}: call torch.distributed.fsdp.fully_shard on its blocks and on the root first")


def _refuse_misuse(module: nn.Module, fsdp_modules: list[nn.Module]) -> None:
    """Raise naming the fix for a model that quantize_comms would set up wrongly without a word:
    one whose comms are already qsdp's (the second handle would take them over, and the first
    one's meter would read 0), one that FSDP2 already ran forward with its own comms (steps in
    flight would mix comms; ``close()`` on a handle and quantizing again stays the way to change
    a trained model's comms), or a root that ``fully_shard`` left out while its children are
    sharded (its own parameters would be neither sharded nor reduced across ranks)."""
    comms = [c for m in fsdp_modules for c in all_gather_comms(m) if isinstance(c, WeightAllGather)]
    current = next((c for c in comms if not c.closed), None)
    if current is not None:
        raise RuntimeError(
            f"quantize_comms was already called on this model (its {current.config.name!r} comms are attached): "
            "call close() on the handle it returned before quantizing again")
    if not comms and any(has_run(m) for m in fsdp_modules):  # run, and never through a handle's close()
        raise RuntimeError(
            "quantize_comms after the model's first forward (FSDP2 already ran it with its own comms): call "
            "quantize_comms after fully_shard and before the first forward")
    if isinstance(module, FSDPModule):
        return
    names = {id(m): n for n, m in module.named_modules()}
    fsdp_names = [names[id(m)] for m in fsdp_modules]
    roots = [n for n in fsdp_names if not any(n.startswith(o + ".") for o in fsdp_names if o != n)]
    sharded = {id(p) for m in fsdp_modules for p in m.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in sharded]
    if len(roots) > 1 or outside:
        left = f"; its parameters outside them ({outside[0]}, ...) would be neither sharded nor reduced" if outside else ""
        raise ValueError(
            f"the root {type(module).__name__} was not passed to fully_shard while {len(roots)} of its submodules "
            f"were ({', '.join(roots[:2])}{', ...' if len(roots) > 2 else ''}){left}: call fully_shard(model) "
            "after fully_shard on its blocks")


def quantize_comms(
    module: nn.Module,
    config: str | QuantConfig = "sdp4bit",
    *,
    overrides: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    guard: GuardConfig | int | None = None,
) -> QuantizedComms:
    """Quantize the weight all-gathers and gradient reduce-scatters of every FSDP2 module under
    ``module`` (call after ``fully_shard``, before the first forward).

    Args:
        module: the root of a model whose submodules were wrapped with ``fully_shard``.
        config: a preset name (``fsdp``, ``qsdp``, ``sdp4bit``, ``zeropp`` or a variant, see
            :func:`qsdp.preset_names`) or a :class:`QuantConfig`.
        overrides: field overrides, e.g. ``{"weights.bits": 8}``; ``{"local_world_size": M}``
            emulates nodes of ``M`` consecutive ranks (otherwise each rank's node comes from
            its host, see :mod:`qsdp.comm.topology`).
        group: the FSDP shard process group. Default: the group FSDP2 really shards over, read
            from its state (a 1-D mesh, or the shard dimension of a dp x tp or 3-D mesh); a group
            whose ranks differ from it is refused.
        replicate_group: qsdp's own HSDP recipe, for a model sharded with 1-D FSDP2 inside the
            node: the ranks (one per node) holding the same shard as this rank;
            the gradient all-reduce across them travels as ``config.hsdp`` says, and their
            initial weights are made identical (see :mod:`qsdp.hsdp`). Required by configs that
            quantize nothing else (``hsdp4``, ``hsdp8``). Leave it out for a model sharded on
            FSDP2's native HSDP mesh (``fully_shard(mesh=<2-D (replicate, shard) mesh>)``, or
            those two dimensions of a 3-D mesh with TP): the replicas are then the mesh's
            replicate dimension, FSDP2's all-reduce across them is replaced by qsdp's (the
            config's ``hsdp``), and everything else (placements, state dict, accumulation with
            ``set_requires_all_reduce(False)``) stays FSDP2's. Its shard dimension belongs
            inside a node: one spanning nodes is refused for ``hsdp4``/``hsdp8`` and warned
            about for configs that quantize the shard group's traffic too.
        guard: the accuracy guard (:class:`qsdp.GuardConfig`, or ``K``: every ``K`` steps): a group
            whose measured noise outgrows SGD's (HSDP's across the replicas included) takes more
            bits, on every rank alike (docs/check.md, "The guard while training").

    The config is validated first and then compared across ranks with one collective; both
    raise :class:`qsdp.ConfigError` naming the problem before any data moves. A model whose comms
    are already qsdp's (``close()`` the first handle to replace them), one FSDP2 already ran, or one
    whose root ``fully_shard`` left out while its blocks were sharded is refused, naming the fix, as
    is an uneven TP split under a quantizing config (docs/reliability.md, "The FSDP2 glue"). On one
    node (``nodes == 1``), rank 0 warns once if the config's inter-node settings go unused.
    """
    cfg = resolve_config(config, overrides)
    layout = _read_layout(module, group, replicate_group)
    guard_cfg = as_guard_config(guard)
    _agree_on_config(module, cfg, layout, guard_cfg)
    _refuse_uneven_splits(module, cfg, layout)
    topology, post_topology = _node_topologies(cfg, layout)
    _warn_about_layout(cfg, topology, layout)
    if layout.native is not None:
        _hsdp.broadcast_replicas(module, layout.native)
    replicas = layout.replicas
    handle = QuantizedComms(cfg, topology, replicas=1 if replicas is None else replicas.size(),
                            replicate_group=replicas)
    handle._topologies = [topology, *post_topology.values()]
    _attach_all(handle, module, layout, post_topology, guard_cfg)
    return handle


def _attach_all(handle: QuantizedComms, module: nn.Module, layout: "_Layout", post_topology: dict[int, Topology],
                guard: GuardConfig | None) -> None:
    """Every FSDP group's comms, the handle's meter and change tracking, and the guard."""
    names = {id(m): n or "<root>" for n, m in module.named_modules()}
    labels = [", ".join(names[id(x)] for x in members) for members in layout.members_of]
    for i, members in enumerate(layout.members_of):
        _attach(handle, layout, i, members, labels[i], post_topology)
    handle._bind_meter()
    if handle.config.weights.mode != "plain":
        _watch_parameter_changes(handle, module)
    if guard is not None:
        mesh = _mesh_groups(module, layout.group)
        if layout.replicate_group is not None:  # qsdp's HSDP recipe: the replicas are no mesh dimension
            mesh.append(layout.replicate_group)
        _start_guard(handle, module, guard, mesh, labels)


def _start_guard(handle: QuantizedComms, root: nn.Module, cfg: GuardConfig, mesh: list[dist.ProcessGroup],
                 labels: list[str]) -> None:
    """Attach the accuracy guard: told of every forward of ``root`` (before the tracker's and
    FSDP2's own pre-forward hooks, so a move applies to that forward's first gather) and of
    every optimizer step."""
    guard = handle.guard = AccuracyGuard(handle, cfg, mesh, labels, functools.partial(_new_all_gather, handle))
    _optimizer_hooks()
    _TRACKERS.add(guard)
    handle._hooks.append(root.register_forward_pre_hook(lambda *_: guard.at_forward(), prepend=True))


@dataclass
class _Layout:
    """How FSDP2 sharded the model, read from its state (local, no collective): the FSDP modules,
    grouped by ``fully_shard`` call, each group's (shard, post-forward) groups, the one shard
    group, and the replicas of native HSDP or of qsdp's recipe (``replicate_group=``)."""

    fsdp_modules: list[nn.Module]
    members_of: list[list[nn.Module]]
    meshes: list[tuple[Any, Any] | None]
    group: dist.ProcessGroup
    native: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    problem: str | None = None  # what this rank alone found wrong, raised on every rank at the agreement

    @property
    def replicas(self) -> dist.ProcessGroup | None:
        return self.native if self.native is not None else self.replicate_group

    def post_forward_groups(self) -> list[dist.ProcessGroup]:
        return list({id(m[1]): m[1] for m in self.meshes if m is not None and m[1] is not None}.values())


def _read_layout(module: nn.Module, group: dist.ProcessGroup | None,
                 replicate_group: dist.ProcessGroup | None) -> _Layout:
    """The model's :class:`_Layout`; refuses, in one line, a world not initialised, a model
    without FSDP2 modules, a misuse (:func:`_refuse_misuse`) and groups that contradict FSDP2's."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("quantize_comms needs an initialized process group (torch.distributed.init_process_group)")
    group, replicate_group = as_process_group(group, "group"), as_process_group(replicate_group, "replicate_group")
    fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise _no_fsdp2_module(module)
    _refuse_misuse(module, fsdp_modules)
    native = _native_replicas(fsdp_modules, replicate_group)
    members_of = _shard_groups(fsdp_modules)
    meshes = [shard_groups(members[0]) for members in members_of]
    if group is None and replicate_group is not None and all(m is None for m in meshes):
        raise ConfigError("replicate_group needs group= the shard group (the ranks FSDP2 shards over): no parameter "
                          f"of {type(module).__name__} was sharded by fully_shard; " + _hsdp.RECIPE)
    shard_group, problem = _fsdp_group(meshes, group)
    return _Layout(fsdp_modules, members_of, meshes, shard_group, native, replicate_group, problem)


def _agree_on_config(module: nn.Module, cfg: QuantConfig, layout: _Layout, guard: GuardConfig | None = None) -> None:
    """Collective over the model part's mesh (or, for qsdp's HSDP recipe, its two groups): every
    rank uses the same config and layout, or every rank raises naming the difference."""
    if layout.replicate_group is not None:
        if layout.problem is not None:
            raise ConfigError(layout.problem)
        _hsdp.prepare(module, cfg, layout.group, layout.replicate_group)
        return
    if layout.native is None:
        _hsdp.require_replicate_group(cfg)
    check_same_config(cfg, _mesh_groups(module, layout.group), problem=layout.problem, guard=guard)


def _node_topologies(cfg: QuantConfig, layout: _Layout) -> tuple[Topology, dict[int, Topology]]:
    """The shard group's topology (with its node subgroups) and each post-forward group's, by the
    group's id. Collective over each group."""
    (topology,) = build_topologies([layout.group], cfg.local_world_size)
    # A post-forward gather is one all-gather over its group: no subgroups, and any number of
    # ranks per node (its bytes are metered per rank's own node).
    post_groups = layout.post_forward_groups()
    post_topologies = build_topologies(post_groups, cfg.local_world_size, what=POST_FORWARD_GROUP,
                                       subgroups=False, even=False)
    return topology, {id(g): t for g, t in zip(post_groups, post_topologies)}


def _warn_about_layout(cfg: QuantConfig, topology: Topology, layout: _Layout) -> None:
    """One warning, on rank 0 of the group, where the layout leaves the config without effect:
    a one-rank shard group, inter-node settings on one node, a native shard dimension across nodes."""
    if topology.world_size == 1 and layout.replicas is None:
        warnings.warn("qsdp: the FSDP group has one rank; FSDP2 calls no custom collective on it, "
                      "so nothing is quantized or metered", stacklevel=3)
    elif layout.replicas is None and topology.rank == 0 and (unused := _unused_on_one_node(cfg, topology)):
        warnings.warn(unused, stacklevel=3)
    elif (layout.native is not None and (spans := _hsdp.check_shard_inside_nodes(cfg, topology))
          and dist.get_rank() == 0):
        warnings.warn(spans, stacklevel=3)


def _refuse_uneven_splits(module: nn.Module, cfg: QuantConfig, layout: _Layout) -> None:
    """Raise :class:`ConfigError` when TP splits a parameter unevenly under a config that
    quantizes: the TP ranks' shard rows then differ in length, so the parameters TP replicates
    (laid out first, :mod:`qsdp.comm.row_layout`) would be rounded differently on each and drift
    apart. Local: every rank of the model part reads the same global shapes and mesh sizes and,
    after the config agreement, the same config, so every one of them raises, before any
    collective that builds groups or moves data (a pipeline stage raises on its own ranks)."""
    if all(getattr(cfg, s).mode == "plain" for s in ("weights", "grads", "hsdp")):
        return
    names = {id(p): n for n, p in module.named_parameters()}
    uneven = [names.get(id(p), "?") for members in layout.members_of for p in unevenly_split_params(members[0])]
    if uneven:
        raise ConfigError(f"config {cfg.name!r}: tensor parallelism splits {', '.join(uneven)} unevenly across its "
                          "ranks, so their shard rows differ in length and the parameters TP replicates would be "
                          "rounded differently on each and drift apart; pad those dimensions to a multiple of the "
                          "TP degree, or use the fsdp preset")


def _attach(handle: QuantizedComms, layout: _Layout, i: int, members: list[nn.Module], label: str,
            post_topology: dict[int, Topology]) -> None:
    """Give FSDP group ``i`` (the modules of one ``fully_shard`` call) its all-gather and
    reduce-scatter, and record them on ``handle``."""
    cfg, topology, m = handle.config, handle.topology, members[0]
    params = [p for x in members for p in managed_parameters(x, layout.fsdp_modules)]
    ag = _weight_gather(handle, cfg, i, m, params, f"group {i} ({label})")
    mesh = layout.meshes[i]
    if mesh is not None and mesh[1] is not None:
        ag.post_forward = _post_forward_gather(cfg, post_topology[id(mesh[1])], i, f"{ag.name} after forward")
    rs_cls = PlainReduceScatter if cfg.grads.mode == "plain" else QuantizedReduceScatter
    if layout.native is not None:
        rs = _hsdp.native_hsdp_reduce_scatter(m, rs_cls, cfg, topology, i, layout.native)
    elif layout.replicate_group is None:
        rs = rs_cls(cfg, topology, i)
    else:
        rs = _hsdp.hsdp_reduce_scatter(m, rs_cls, cfg, topology, i, layout.replicate_group)
    # Beside TP, the group's TP-replicated parameters are quantized apart from its TP shards;
    # the reduce-scatter's row holds only the parameters that get a gradient.
    # FSDP2 reads requires_grad again at every unshard (a part unfrozen later is a working flow):
    # the reduce-scatter reads its spans again at each reduction.
    every = shard_row_spans(m)
    ag.use_row_spans(every)
    rs.use_row_spans(functools.partial(shard_row_spans, m, with_gradients=True),
                     mixed=len({rep for n, rep in every if n}) > 1)
    # Read now and set up for below: a factor set later is refused at the next reduction.
    rs.expect_divide_factor(functools.partial(gradient_divide_factor, m), f"group {i} ({label})")
    if has_custom_divide_factor(m):
        # FSDP2 would pass PREMUL_SUM(1/factor), whose factor a custom comm cannot read;
        # with SUM it applies the factor itself, before and after the reduce-scatter.
        m.set_force_sum_reduction_for_comms(True)
    rs.tracker = handle.tracker
    m.set_custom_all_gather(ag)
    m.set_custom_reduce_scatter(rs)
    handle.modules.append(m)
    handle.all_gathers.append(ag)
    handle.reduce_scatters.append(rs)
    handle.group_parameters.append(params)


def _weight_gather(handle: QuantizedComms, cfg: QuantConfig, i: int, m: nn.Module, params: list[nn.Parameter],
                   name: str) -> WeightAllGather:
    """FSDP group ``i``'s weight all-gather of ``cfg``'s mode, watching ``params`` (a difference
    gather also knows FSDP2's row of ``m``, so that a checkpoint can be loaded before it runs)."""
    ag = _ALL_GATHERS[cfg.weights.mode](cfg, handle.topology, i, handle.tracker)
    ag.track(params, name)
    if isinstance(ag, DifferenceAllGather):
        ag.expect_row(*all_gather_row(m), params[0].device if params else torch.device("cpu"))
    return ag


def _new_all_gather(handle: QuantizedComms, i: int, cfg: QuantConfig) -> WeightAllGather:
    """Give FSDP group ``i`` a new weight all-gather of ``cfg``'s mode in place of its own (the
    guard moving direct weights to differences, on every rank at the same step): it watches the
    same parameters and lays out the same rows; a difference gather's first call sends exact
    values, as at the start of a run."""
    old, m = handle.all_gathers[i], handle.modules[i]
    new = _weight_gather(handle, cfg, i, m, handle.group_parameters[i], old.name)
    new.post_forward = old.post_forward
    new.use_row_spans(shard_row_spans(m))
    new.bind_meter(handle.meter)
    m.set_custom_all_gather(new)
    handle.all_gathers[i] = new
    return new


def _native_replicas(fsdp_modules: list[nn.Module], replicate_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The replicate group of FSDP2's native HSDP mesh the model was sharded on, or ``None``;
    refuses ``replicate_group=`` beside it (qsdp reads the replicas from the mesh). Local."""
    native = _hsdp.native_replicate_group(fsdp_modules)
    if native is not None and replicate_group is not None:
        raise ConfigError("replicate_group= is for 1-D FSDP2 inside the node, but this model was sharded on FSDP2's "
                          "native HSDP mesh, whose replicate dimension qsdp reads: leave replicate_group= out")
    return native


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def _fsdp_group(meshes: list[tuple[Any, Any] | None], given: dist.ProcessGroup | None
                ) -> tuple[dist.ProcessGroup, str | None]:
    """The one process group FSDP2 shards every group of the model over (read from its state:
    a 1-D mesh, or the shard dimension of a 2-D/3-D one), and what is wrong with ``group=`` when
    it names other ranks (a mistake one rank may make alone: the config agreement raises it on
    every rank); local, no collective. Raises :class:`ConfigError` naming the groups where the
    model itself shards over several."""
    found = {tuple(_ranks(m[0])): m[0] for m in meshes if m is not None}
    if len(found) > 1:
        raise ConfigError(f"the FSDP modules shard over different process groups {sorted(found)}; qsdp quantizes "
                          "one shard group per model: pass one mesh (or one mesh dimension) to every fully_shard call")
    if not found:
        return given or dist.group.WORLD, None
    ranks, mesh_group = next(iter(found.items()))
    if given is not None and tuple(_ranks(given)) != ranks:
        return mesh_group, (f"group= holds ranks {_ranks(given)} but FSDP2 shards this rank's parameters over ranks "
                            f"{list(ranks)}; leave group= out (qsdp reads the mesh FSDP2 shards over) or pass that group")
    return mesh_group, None


def _post_forward_gather(cfg: QuantConfig, topology: Topology, comm_id: int, name: str) -> WeightAllGather:
    """The comm of the backward all-gather over FSDP2's post-forward group
    (``reshard_after_forward=<int>``): it re-gathers weights the forward gather delivered. Inside
    a node it travels exactly (ZeRO++'s hpZ); across nodes it is quantized directly as the
    config's weights are, except weight differences, whose replicas belong to the forward group:
    those travel exactly, with one warning."""
    mode = cfg.weights.mode if topology.nodes > 1 else "plain"
    if mode == "difference":
        if topology.rank == 0:
            warnings.warn(f"qsdp: {cfg.name}: {name}: reshard_after_forward's group of {topology.world_size} ranks "
                          "spans nodes, so the backward gather crosses nodes unquantized; set reshard_after_forward to "
                          "the FSDP group's ranks per node to keep it inside the node", stacklevel=3)
        mode = "plain"
    comm = _ALL_GATHERS[mode](cfg, topology, comm_id, ChangeTracker(assume_changed=True))
    comm.name = name
    comm.post_forward_of = name
    return comm


def _unused_on_one_node(cfg: QuantConfig, topology: Topology) -> str | None:
    """What ``cfg`` sets for traffic between nodes that a one-node ``topology`` leaves unused,
    as a warning naming the override that emulates nodes, or ``None``."""
    if topology.nodes > 1 or topology.world_size == 1:
        return None
    unused = []
    if cfg.grads.mode == "two_level":
        unused.append(f"gradients take one {cfg.grads.bits_intra}-bit hop (grads.bits_inter={cfg.grads.bits_inter} unused)")
    if cfg.weights.mode == "difference" and cfg.weights.replica != "full":
        unused.append("weights are gathered exactly, no replica is held")
    if not unused:
        return None
    return (f"qsdp: {cfg.name}: the {topology.world_size} ranks of the FSDP group are on one node (the hosts, or "
            f"QSDP_NODE, or the config's local_world_size say so), so nothing crosses nodes: {'; '.join(unused)}. "
            "To emulate D nodes of M ranks on one machine, pass overrides={'local_world_size': M}")


def _watch_parameter_changes(handle: QuantizedComms, root: nn.Module) -> None:
    """Tell the handle's tracker about forwards, optimizer steps and loads.

    Every forward of ``root`` agrees at its first gather on which shards changed since the last
    agreement (their version counters), whoever changed them; the optimizer-step hooks tell an
    optimizer's step (a quantized difference, also where a fused or foreach step bumps no
    counter) from any other change (exact values). The optimizer hooks are process-wide, so they
    hold the tracker weakly and go away with it (with the model, whose comms hold it): a model
    dropped without ``close()`` is not kept alive by them.
    """
    _optimizer_hooks()
    _TRACKERS.add(handle.tracker)
    hooks: list[Any] = []
    tracker = handle.tracker
    # Before FSDP2's own pre-forward hook, which gathers the root's group.
    hooks.append(root.register_forward_pre_hook(lambda *_: tracker.at_forward(), prepend=True))
    # A load (every rank calls load_state_dict; DCP's set_model_state_dict does) is agreed on
    # at the next gather, so that even a gather outside a forward (an explicit unshard) sees it.
    hooks += [m.register_load_state_dict_post_hook(lambda *_: tracker.request()) for m in handle.modules]
    handle._hooks = hooks


# The trackers the process-wide optimizer hooks tell about steps, held weakly: a tracker dropped
# with its model leaves the set by itself. One pair of hooks for the process, never removed: a
# hook removed when a dropped tracker is collected could be removed while torch iterates over the
# hooks of a step (the collection can run inside one), which raises "OrderedDict mutated during
# iteration".
_TRACKERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_HOOKS: list[Any] = []


def _optimizer_hooks() -> None:
    if _HOOKS:
        return

    def before(*_: Any) -> None:
        for tracker in list(_TRACKERS):
            tracker.before_optimizer_step()

    def after(optimizer: Any, *_: Any) -> None:
        for tracker in list(_TRACKERS):
            tracker.after_optimizer_step(optimizer)

    _HOOKS[:] = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
