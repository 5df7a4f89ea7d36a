"""The accuracy guard: every K optimizer steps, measure each FSDP group's quantization noise on
the run's own data and ranks, and move a group whose noise outgrows SGD's up its ladder.

A round (docs/check.md, "The guard while training"):

1. the training forward that starts guarded step ``t`` hands every quantized group's reduction
   a probe (:mod:`qsdp.guard.probes`): each reduction of step ``t`` also runs an exact
   reduce-scatter and adds the gradient statistics;
2. the optimizer step's hooks take the size of its update of each weight-quantized group's
   shard (a copy of the shard lives only while the optimizer steps);
3. the first forward after it (training or evaluation) measures what each such group's first
   gather delivers of this rank's shard against the shard itself;
4. the forward after that sums the statistics over the model's ranks (one all-reduce per mesh
   dimension of ``groups x 5`` float64, the round's one host read), computes ``qsdp check``'s
   ratios per group and, where one is over its limit, moves that group one rung up
   (:mod:`qsdp.guard.ladder`) before its first gather. Every rank decides from the same summed
   numbers, so every rank switches at the same step and the replicas stay identical.

Outside a round the guard adds one Python call per forward of the root and nothing per
collective. A group never goes back down within a run, unless :meth:`AccuracyGuard.reset_levels`
says so. The levels are part of the handle's ``state_dict``, so a resumed run keeps them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from .config import GuardConfig
from .ladder import config_at, grad_rungs, weight_rungs
from .._fsdp2 import reduce_scatter_padding
from ..comm.hsdp import AcrossReplicas
from .probes import EXACT_SQ, FIELDS, GRAD_ERR, SCALED_LOCAL, UPDATE_SQ, WEIGHT_ERR, GatherProbe, ReductionProbe, \
    ReplicasProbe, real_mask, sum_sq_diff

if TYPE_CHECKING:
    from ..comm.base import WeightAllGather
    from ..config import QuantConfig
    from ..fsdp import QuantizedComms

LOG = logging.getLogger("qsdp.guard")
IDLE, GRADIENTS, DECIDE = "idle", "gradients", "decide"


@dataclass(frozen=True)
class GroupReading:
    """One group's ratios at one guarded step (``None`` where undefined: nothing measured, or a
    zero denominator): ``qsdp check``'s ``q/SGD`` and ``w err/step``."""

    grad_ratio: float | None
    weight_ratio: float | None


@dataclass(frozen=True)
class Escalation:
    """One move of one group: after ``step`` optimizer steps (it applies from the next one on),
    ``part`` (``weights`` or ``gradients``) of group ``group`` (``name``) went from
    rung ``before`` to ``after`` because ``ratio`` exceeded ``limit``."""

    step: int
    group: int
    name: str
    part: str
    before: str
    after: str
    ratio: float
    limit: float

    def line(self) -> str:
        what = "w err/step" if self.part == "weights" else "q/SGD"
        return (f"qsdp guard: after {self.step} steps: {self.name}: {self.part} {self.before} -> {self.after} "
                f"({what} {self.ratio:.3g} > {self.limit:.3g})")


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local shard)."""
    return p.to_local() if hasattr(p, "to_local") else p


def _ratios(values: list[float], world: int) -> GroupReading:
    grad_var = (values[SCALED_LOCAL] - values[EXACT_SQ]) / (world - 1) if world > 1 else 0.0
    grad = values[GRAD_ERR] / grad_var if grad_var > 0 and values[EXACT_SQ] > 0 else None
    weight = math.sqrt(values[WEIGHT_ERR] / values[UPDATE_SQ]) if values[UPDATE_SQ] > 0 else None
    return GroupReading(grad, weight)


class AccuracyGuard:
    """The guard of one :class:`qsdp.QuantizedComms` (``handle.guard``); see the module doc.

    ``levels``: per FSDP group, ``[weight rung, gradient rung]`` (0: the config's own);
    ``rungs(i)``: group ``i``'s current rungs as labels; ``escalations``: every move so far;
    ``readings``: each guarded step's ratios per group; ``on_escalate``: callables run on every
    rank with each :class:`Escalation` (the trainer writes them into ``metrics.jsonl``)."""

    def __init__(self, handle: "QuantizedComms", config: GuardConfig, mesh: list[dist.ProcessGroup],
                 names: list[str], new_all_gather: Callable[[int, QuantConfig], WeightAllGather]) -> None:
        self.handle, self.config, self.mesh, self.names = handle, config, mesh, names
        self._new_all_gather = new_all_gather  # group i's gather of another weight mode, swapped in
        groups = len(handle.modules)
        self.levels = [[0, 0] for _ in range(groups)]
        self.escalations: list[Escalation] = []
        self.readings: list[tuple[int, list[GroupReading]]] = []
        self.on_escalate: list[Callable[[Escalation], None]] = []
        self.steps = 0  # optimizer steps taken (equal on every rank)
        self.phase = IDLE
        self._armed_at = -1
        self._stats: torch.Tensor | None = None
        self._before: dict[int, list[torch.Tensor]] = {}  # the shards before a guarded optimizer step
        self._masks: dict[tuple, torch.Tensor | None] = {}  # by (reduce-scatter row layout, device)
        # What a round measures: the config's quantized parts (the same for every group); under
        # HSDP the gradients' path also sums across the replicas.
        self._replicas = handle.replicas > 1
        self._weights = handle.config.weights.mode != "plain"
        self._grads = handle.config.grads.mode != "plain" or (self._replicas and handle.config.hsdp.mode != "plain")

    # What the process-wide optimizer hooks call (qsdp.fsdp._TRACKERS).
    def before_optimizer_step(self) -> None:
        """In a round, keep this rank's shards of the weight-quantized groups until the step ends."""
        if self._weights and self.phase == GRADIENTS and self.steps == self._armed_at:
            self._before = {i: [_local(p).detach().clone() for p in params]
                            for i, params in enumerate(self.handle.group_parameters) if params}

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Count a step of an optimizer holding this model's parameters (any other is ignored);
        in a round, add the size of its update to the statistics."""
        before, self._before = self._before, {}
        if optimizer is not None:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if not any(id(p) in held for params in self.handle.group_parameters for p in params):
                self._before = before  # another optimizer's step: the round waits for this model's
                return
        for i, copies in before.items():
            row = self._row(i)(copies[0].device)
            for p, old in zip(self.handle.group_parameters[i], copies):
                row[UPDATE_SQ] += sum_sq_diff(_local(p), old)
        self.step()

    def step(self) -> None:
        """Count one update of the parameters. The optimizer hooks call it for every
        ``torch.optim`` optimizer holding them; a loop updating them any other way (a functional
        optimizer) calls it once per update, on every rank (the weights' ratio then stays
        unmeasured: the update's size is taken around an optimizer's step)."""
        self.steps += 1

    def rungs(self, i: int) -> tuple[str, str]:
        """Group ``i``'s current (weights, gradients) rungs, e.g. ``("8-bit direct", "exact")``."""
        cfg = self.handle.config
        w, g = weight_rungs(cfg.weights), self._grad_rungs()
        return w[min(self.levels[i][0], len(w) - 1)], g[min(self.levels[i][1], len(g) - 1)]

    def _grad_rungs(self) -> list[str]:
        cfg = self.handle.config
        return grad_rungs(cfg.grads, cfg.hsdp if self._replicas else None)

    def at_forward(self) -> None:
        """A forward of the root begins (every rank runs it): move the round on (module doc)."""
        if self.phase == DECIDE:
            self._decide()
        if self.phase == GRADIENTS and self.steps > self._armed_at:
            # This forward's first gathers measure; the next forward decides.
            self._probe_reductions(False)
            self._probe_gathers()
            self.phase = DECIDE
            return
        if self.phase == IDLE and torch.is_grad_enabled() and self._due():
            self._armed_at = self.steps
            self._probe_reductions(True)
            self.phase = GRADIENTS

    def upcoming(self) -> str:
        """What the next training forward's step does for the guard: ``"gradients"`` (a guarded
        step: its reductions are measured), ``"weights"`` (its first gathers are), ``"decide"``
        (the round's sums and moves) or ``"plain"`` (nothing: the step runs as unguarded)."""
        if self.phase == DECIDE:
            return "decide"
        if self.phase == GRADIENTS:
            return "weights" if self.steps > self._armed_at else "gradients"
        return "gradients" if self._due() else "plain"

    def _due(self) -> bool:
        first, every = self.config.start, self.config.every
        return self.steps >= first and (self.steps - first) % every == 0 and self.steps != self._armed_at \
            and (self._weights or self._grads)

    def _row(self, i: int) -> Callable[[torch.device], torch.Tensor]:
        def row(device: torch.device) -> torch.Tensor:
            if self._stats is None:
                self._stats = self._zeros(device)
            return self._stats[i]
        return row

    def _zeros(self, device: torch.device) -> torch.Tensor:
        """The round's statistics before anything is added: float64 ``[groups, FIELDS]``."""
        return torch.zeros(len(self.levels), len(FIELDS), dtype=torch.float64, device=device)

    def _probe_reductions(self, on: bool) -> None:
        if not self._grads:
            return
        for i, (module, rs) in enumerate(zip(self.handle.modules, self.handle.reduce_scatters)):
            if not on:
                self._restore_reductions(module, rs)
            elif isinstance(rs, AcrossReplicas):  # HSDP: the all-reduce hook ends the reduction
                probe = ReplicasProbe(rs, self._row(i), self._mask(module))
                module.set_custom_reduce_scatter(probe)
                module.set_all_reduce_hook(probe.hook)
            else:
                module.set_custom_reduce_scatter(ReductionProbe(rs, self._row(i), self._mask(module)))

    @staticmethod
    def _restore_reductions(module: torch.nn.Module, rs: Any) -> None:
        module.set_custom_reduce_scatter(rs)
        if isinstance(rs, AcrossReplicas):
            module.set_all_reduce_hook(rs.hook)

    def _mask(self, module: torch.nn.Module) -> Callable[[torch.device], torch.Tensor | None]:
        """Where ``module``'s reduce-scatter row holds parameter elements, read when a guarded
        reduction runs (the parameters requiring a gradient then); each layout's mask is built
        once (a copy to the device)."""
        def mask(device: torch.device) -> torch.Tensor | None:
            rows = tuple(reduce_scatter_padding(module))
            key = (rows, str(device))
            if key not in self._masks:
                self._masks[key] = real_mask(rows, device)
            return self._masks[key]
        return mask

    def _probe_gathers(self) -> None:
        if not self._weights:
            return
        for i, (module, ag) in enumerate(zip(self.handle.modules, self.handle.all_gathers)):
            def restore(module=module, ag=ag) -> None:
                module.set_custom_all_gather(ag)
            module.set_custom_all_gather(GatherProbe(ag, restore, self._row(i)))

    def _device(self) -> torch.device:
        """The device of the model's parameters (where the sums are taken: NCCL's for CUDA)."""
        return next((p.device for params in self.handle.group_parameters for p in params), torch.device("cpu"))

    def close(self) -> None:
        """Hand every group back to its own comms, ending a round in progress (the handle's close)."""
        self._restore_all()
        self.phase, self._stats = IDLE, None

    def _restore_all(self) -> None:
        for module, ag, rs in zip(self.handle.modules, self.handle.all_gathers, self.handle.reduce_scatters):
            module.set_custom_all_gather(ag)
            self._restore_reductions(module, rs)
        self._before = {}

    def _decide(self) -> None:
        """Collective over the model's mesh: sum the round's statistics, read them (the round's
        one host sync), and move every group over a limit one rung up."""
        self._restore_all()
        self.phase = IDLE
        stats, self._stats = self._stats, None
        if stats is None:  # nothing measured on this rank (every rank joins the sums all the same)
            stats = self._zeros(self._device())
        for group in self.mesh:
            dist.all_reduce(stats, group=group)
            self.handle.meter.record_peers("guard", stats.numel() * stats.element_size(), 0,
                                           *self.handle.topology.peers())
        world = self.handle.topology.world_size * self.handle.replicas
        readings = [_ratios(row, world) for row in stats.tolist()]
        self.readings.append((self._armed_at, readings))
        moves: list[Escalation] = []
        for i, reading in enumerate(readings):
            w, g = self.rungs(i)
            if reading.weight_ratio is not None and reading.weight_ratio > self.config.weight_limit \
                    and self.levels[i][0] < len(weight_rungs(self.handle.config.weights)) - 1:
                self.levels[i][0] += 1
                moves.append(Escalation(self.steps, i, self.names[i], "weights", w, self.rungs(i)[0],
                                        reading.weight_ratio, self.config.weight_limit))
            if reading.grad_ratio is not None and reading.grad_ratio > self.config.grad_limit \
                    and self._armed_at >= self.config.grad_start \
                    and self.levels[i][1] < len(self._grad_rungs()) - 1:
                self.levels[i][1] += 1
                moves.append(Escalation(self.steps, i, self.names[i], "gradients", g, self.rungs(i)[1],
                                        reading.grad_ratio, self.config.grad_limit))
        for move in moves:
            self._apply(move.group)
            self.escalations.append(move)
            if dist.get_rank() == 0:
                LOG.warning(move.line())
            for callback in self.on_escalate:
                callback(move)

    def _apply(self, i: int) -> None:
        """Give group ``i``'s comms the config of its levels (every rank, at the same step)."""
        cfg, exact = config_at(self.handle.config, *self.levels[i], replicas=self._replicas)
        ag, rs = self.handle.all_gathers[i], self.handle.reduce_scatters[i]
        if ag.config.weights.mode != cfg.weights.mode:
            ag = self._new_all_gather(i, cfg)
        for comm in (ag, ag.post_forward, rs):
            if comm is not None:
                comm.reconfigure(cfg)
        ag.go_exact(exact)
        if ag.post_forward is not None:
            ag.post_forward.go_exact(exact)

    def reset_levels(self) -> None:
        """Collective by convention (every rank calls it): every group back to the config's own
        rungs (the user's call: the guard itself never moves a group down)."""
        for i in range(len(self.levels)):
            self.levels[i] = [0, 0]
            self._apply(i)

    def state_dict(self) -> dict[str, Any]:
        """The levels (per group, as ``{"w": int, "g": int}`` keyed by the group's index), the
        steps counted, the escalations so far and a round in progress (its phase, start and this
        rank's statistics; JSON-able): what a resume needs to decide as the run would have."""
        stats = None if self._stats is None else self._stats.tolist()
        return {"levels": {str(i): {"w": w, "g": g} for i, (w, g) in enumerate(self.levels)},
                "steps": self.steps, "escalations": [asdict(e) for e in self.escalations],
                "readings": [[step, [[r.grad_ratio, r.weight_ratio] for r in rs]] for step, rs in self.readings],
                "round": {"phase": self.phase, "armed_at": self._armed_at, "stats": stats,
                          "world": dist.get_world_size()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before the comms' own state: a level changes their config)."""
        levels = state.get("levels", {})
        if len(levels) != len(self.levels):
            raise ValueError(f"the guard's state holds {len(levels)} FSDP groups, this model has {len(self.levels)}")
        for i in range(len(self.levels)):
            self.levels[i] = [int(levels[str(i)]["w"]), int(levels[str(i)]["g"])]
            self._apply(i)
        self.steps = int(state.get("steps", 0))
        self.escalations = [Escalation(**e) for e in state.get("escalations", [])]
        self.readings = [(int(step), [GroupReading(g, w) for g, w in rs]) for step, rs in state.get("readings", [])]
        self.close()
        saved = state.get("round") or {}
        if saved.get("phase", IDLE) != IDLE and saved.get("world") == dist.get_world_size():
            # Saved between a round's steps (a checkpoint after its optimizer step): it goes on.
            self.phase, self._armed_at = saved["phase"], int(saved["armed_at"])
            if saved.get("stats") is not None:
                self._stats = torch.tensor(saved["stats"], dtype=torch.float64, device=self._device())
            if self.phase == GRADIENTS:
                self._probe_reductions(True)
