"""The measurement: real gradients and real optimizer steps, every collective emulated.

Each step, every emulated rank ``r`` of the ``D x M`` world computes the gradient of its own
micro-batch (``TokenDataset.batch(step, r, ...)``: random windows drawn from (seed, step, rank)).
Per FSDP group:

* SGD's own noise: the variance of the step's gradient, the mean of the ``W = D * M``
  micro-batch gradients, estimated from their spread: ``sum_r ||g_r - g||^2 / (W (W - 1))``.
* The gradient path's: ``||Q(g) - g||^2``, ``Q`` the preset's reduce-scatter of the ``g_r``
  (:func:`qsdp.check.emulate.reduce_scatter`, every hop, Hadamard and shard included).

The optimizer (AdamW, GPT-2 practice: no decay on 1-D parameters, gradient clipping) then steps
with the exact mean gradient, so every preset is measured along the same, unquantized
trajectory. After the step, the weight path gathers the new shards as the preset would:

* ``||W_seen - w||^2`` against ``||w_new - w_old||^2`` (one step's update), ``W_seen`` the
  weights the next forward sees: ``Q(w)`` for direct quantization, the replica after its update
  for weight differences, ``w`` in the parameter dtype for a plain gather;
* for weight differences also ``||Q(d) - d||^2 / ||d||^2``, ``d = w - replica``: the
  compressor's relative error (SDP4Bit's delta-approximation holds while it stays below 1).

Sums over the measured steps are kept per group; ratios are taken of the sums.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import QuantConfig
from ..train.args import PARAM_DTYPES
from ..train.data import ByteTokenizer, TokenDataset, load_corpus
from ..train.trainer import adamw
from . import emulate
from .models import Group, build_model, fsdp_groups, lm_loss

Progress = Callable[[int, int], None]  # (steps done, steps in all)


@dataclass(frozen=True)
class CheckSpec:
    """What a check builds and measures (one preset, one layout).

    model: a GPT size, a Hugging Face config .json or ``module:function`` (see
        :mod:`qsdp.check.models`). nodes x ranks_per_node: the emulated world (D x M).
    batch_size: sequences per rank per step (one micro-batch); seq_len: tokens per sequence.
    warmup_steps: exact optimizer steps before measuring; steps: measured steps.
    lr, weight_decay, grad_clip: the optimizer's (a constant learning rate).
    param_dtype: the dtype the weights travel in (the gathers' and replicas' dtype).
    data: a UTF-8 text file (``None``: the embedded corpus), read with the byte tokenizer.
    """

    model: str = "tiny"
    nodes: int = 2
    ranks_per_node: int = 2
    batch_size: int = 8
    seq_len: int = 64
    warmup_steps: int = 20
    steps: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    param_dtype: str = "float32"
    data: str | None = None
    seed: int = 0
    device: str = "cpu"

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        for name in ("nodes", "ranks_per_node", "batch_size", "seq_len", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.world < 2:
            raise ValueError("the world must have at least 2 ranks (nodes x ranks_per_node): "
                             "with one rank nothing is sharded or communicated")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be at least 0")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype={self.param_dtype!r}; allowed: {', '.join(PARAM_DTYPES)}")


@dataclass
class GroupSums:
    """The sums over the measured steps of one group's squared norms (float64 Python numbers)."""

    grad_sq: float = 0.0      # ||g||^2, g the step's mean gradient
    sgd_var: float = 0.0      # the step gradient's variance, from the micro-batch spread
    grad_err: float = 0.0     # ||Q(g) - g||^2
    update_sq: float = 0.0    # ||w_new - w_old||^2
    weight_err: float = 0.0   # ||W_seen - w_new||^2
    diff_sq: float = 0.0      # ||w_new - replica||^2 (weight differences only)

    def add(self, other: dict[str, float]) -> None:
        for k, v in other.items():
            setattr(self, k, getattr(self, k) + v)


@dataclass
class Measurement:
    """Per group, its name, element count and sums; the wall time; what was measured."""

    spec: CheckSpec
    config: QuantConfig
    groups: list[tuple[str, int, GroupSums]] = field(default_factory=list)
    n_params: int = 0
    seconds: float = 0.0


def _sq(x: torch.Tensor) -> float:
    return float(x.double().square().sum())


def _optimizer(model: torch.nn.Module, spec: CheckSpec) -> torch.optim.Optimizer:
    return adamw((p for p in model.parameters() if p.requires_grad), spec.lr, spec.weight_decay)


class _WeightPath:
    """The weight gathers of every group along the run (the difference replicas it keeps)."""

    def __init__(self, cfg: QuantConfig, spec: CheckSpec, groups: list[Group]) -> None:
        self.cfg, self.spec, self.groups = cfg, spec, groups
        self.dtype = PARAM_DTYPES[spec.param_dtype]
        self.version = 0
        self.replicas: list[torch.Tensor | None] = [None] * len(groups)

    def rows(self, i: int) -> torch.Tensor:
        return emulate.flat_rows([p.float() for p in self.groups[i].params], self.spec.world)

    def start(self) -> list[torch.Tensor]:
        """Every group's fp32 rows now; weight-difference replicas start from them exactly (the
        first gather sends exact values)."""
        rows = [self.rows(i) for i in range(len(self.groups))]
        for i, r in enumerate(rows):
            if emulate.difference_applies(self.cfg, self.spec.ranks_per_node, self.spec.world, r.shape[1]):
                self.replicas[i] = r.to(self.dtype)
        return rows

    def after_step(self, old: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
        """The gathers after one optimizer step: the new rows and each group's sums."""
        self.version += 1
        new, sums = [], []
        for i, before in enumerate(old):
            rows = self.rows(i)
            shard = rows.to(self.dtype)
            s = {"update_sq": _sq(rows - before)}
            replica = self.replicas[i]
            if replica is not None:
                s["diff_sq"] = _sq(shard.float() - replica.float())
                emulate.difference_gather(shard, replica, self.cfg, i, self.version)
                seen = replica
            else:
                seen = emulate.direct_gather(shard, self.cfg, i, self.version)
            s["weight_err"] = _sq(seen.float() - rows)
            new.append(rows)
            sums.append(s)
        return new, sums


def _micro_batch_grads(model, groups: list[Group], dataset: TokenDataset, spec: CheckSpec,
                       step: int, device: torch.device) -> list[torch.Tensor]:
    """Per group, ``[world (source), world (destination), s]`` fp32: every rank's gradient of
    its micro-batch in FSDP2's flat layout."""
    per_group: list[torch.Tensor | None] = [None] * len(groups)
    for rank in range(spec.world):
        x, y = dataset.batch(step, rank, spec.world, spec.batch_size, spec.seq_len)
        model.zero_grad(set_to_none=True)
        lm_loss(model, x.to(device), y.to(device)).backward()
        for i, g in enumerate(groups):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params]
            rows = emulate.flat_rows([t.float() for t in grads], spec.world)
            if per_group[i] is None:  # filled in place: no second copy of every rank's gradients
                per_group[i] = rows.new_empty(spec.world, *rows.shape)
            per_group[i][rank] = rows
    return per_group


def _set_mean_grads(groups: list[Group], grads: list[torch.Tensor], world: int) -> None:
    """Every parameter's ``.grad`` := the mean of the ranks' gradients (unflattened)."""
    for g, stacked in zip(groups, grads):
        mean = stacked.mean(dim=0)  # [world, s]
        col = 0
        for p in g.params:
            d0 = p.shape[0] if p.dim() else 1
            rows = -(-d0 // world)
            width = rows * (p.numel() // d0)
            p.grad = mean[:, col:col + width].reshape(rows * world, -1)[:d0].reshape(p.shape).to(p.dtype)
            col += width


def _gradient_sums(stacked: torch.Tensor, cfg: QuantConfig, spec: CheckSpec, comm_id: int,
                   call: int) -> dict[str, float]:
    world = spec.world
    mean = stacked.double().mean(dim=0)
    spread = _sq(stacked.double() - mean) / (world * (world - 1))
    quantized = emulate.reduce_scatter(stacked, cfg, spec.ranks_per_node, comm_id, call)
    return {"grad_sq": _sq(mean), "sgd_var": spread, "grad_err": _sq(quantized.double() - mean)}


def measure(spec: CheckSpec, cfg: QuantConfig, *, progress: Progress | None = None) -> Measurement:
    """Run the check's steps (see the module doc) for one config; ``progress(done, total)`` is
    called after every step when given."""
    return measure_many(spec, [cfg], progress=progress)[0]


def measure_many(spec: CheckSpec, cfgs: list[QuantConfig], *,
                 progress: Progress | None = None) -> list[Measurement]:
    """One run of the check's steps measuring every config of ``cfgs`` along it: the trajectory
    (exact gradients) does not depend on the config, so each gets what a run of its own would."""
    spec.validate()
    t0 = time.perf_counter()
    device = torch.device(spec.device)
    dataset = TokenDataset.from_text(load_corpus(spec.data), ByteTokenizer(), seed=spec.seed)
    model = build_model(spec.model, vocab_size=dataset.vocab_size, seq_len=spec.seq_len, seed=spec.seed)
    model.to(device).train()
    groups = fsdp_groups(model)
    optimizer = _optimizer(model, spec)
    paths = [_WeightPath(cfg, spec, groups) for cfg in cfgs]
    sums = [[GroupSums() for _ in groups] for _ in cfgs]
    total = spec.warmup_steps + spec.steps
    rows: list[list[torch.Tensor]] = []
    for step in range(total):
        measured = step >= spec.warmup_steps
        if step == spec.warmup_steps:
            rows = [w.start() for w in paths]
        grads = _micro_batch_grads(model, groups, dataset, spec, step, device)
        if measured:
            for cfg, cfg_sums in zip(cfgs, sums):
                for i, stacked in enumerate(grads):
                    cfg_sums[i].add(_gradient_sums(stacked, cfg, spec, i, step + 1))
        _set_mean_grads(groups, grads, spec.world)
        del grads
        if spec.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for g in groups for p in g.params], spec.grad_clip)
        optimizer.step()
        if measured:
            for k, (path, cfg_sums) in enumerate(zip(paths, sums)):
                rows[k], weight_sums = path.after_step(rows[k])
                for s, w in zip(cfg_sums, weight_sums):
                    s.add(w)
        if progress is not None:
            progress(step + 1, total)
    seconds = time.perf_counter() - t0
    n_params = sum(g.numel for g in groups)
    return [Measurement(spec=spec, config=cfg, n_params=n_params, seconds=seconds,
                        groups=[(g.name, g.numel, s) for g, s in zip(groups, cfg_sums)])
            for cfg, cfg_sums in zip(cfgs, sums)]


def as_dict(m: Measurement) -> dict:
    """The measurement's setup as JSON-ready data."""
    return {"spec": dataclasses.asdict(m.spec), "config": m.config.to_dict(), "n_params": m.n_params,
            "wall_time_s": m.seconds}
