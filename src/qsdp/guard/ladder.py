"""The rungs a group climbs when its quantization noise is too large, one at a time.

Weights: direct quantization first becomes SDP4Bit's weight differences at the same bits (what
``qsdp check`` advises first: a direct quantizer's error does not shrink with the updates, so a
finer one alone leaves it; 8-bit direct weights with round-to-nearest, zeropp's quantizer, still
ended 0.76% above fsdp's loss after 300 steps of the tiny GPT, seed 0:
benchmarks/results/guard_ladder_runs.json); differences then take 8 bits, then the weights travel
exact (the parameter dtype). Gradients: one-level ``bits`` then 8, two-level ``bits_inter`` (and
``bits_intra``) then 8, then exact fp32 along the same route (``grads.quantize=False``). A config
already at a rung starts there (8-bit weights go straight to exact). The rung is a function of the start config and a
level, equal on every rank, so every rank builds the same config from the same agreed level.

Under HSDP the gradients' path is two reductions, inside the shard group and across the
replicas: they climb together, the all-reduce across the replicas ``bits`` -> 8 -> exact (the
reduce dtype, as FSDP2's native HSDP sends it) beside the shard group's own ladder.
"""

from __future__ import annotations

import dataclasses

from ..config import PRESETS, GradComm, HsdpComm, QuantConfig, WeightComm

EXACT = "exact"


def _weight_steps(w: WeightComm) -> list[WeightComm]:
    """Every quantized rung of ``w``'s ladder, ``w`` first."""
    if w.mode == "plain":
        return []
    steps = [w]
    if w.mode == "direct":  # SDP4Bit's differences (stochastic rounding), at the direct bits first
        w = dataclasses.replace(PRESETS["sdp4bit"].weights, bits=w.bits)
        steps.append(w)
    if w.bits < 8:
        steps.append(dataclasses.replace(w, bits=8))
    return steps


def weight_rungs(w: WeightComm) -> list[str]:
    """The weights' rungs from ``w`` up, as labels (``"4-bit direct"``, ``"4-bit difference"``,
    ..., ``"exact"``); one rung (nothing to climb) for plain weights."""
    return [f"{s.bits}-bit {s.mode}" for s in _weight_steps(w)] + [EXACT]


def _reduction_rungs(g: GradComm) -> list[str]:
    """The shard group's reduction's rungs from ``g`` up; one (nothing to climb) when exact."""
    if g.mode == "plain" or not g.quantize:
        return [EXACT]
    if g.mode == "one_level":
        return [f"{b}-bit" for b in sorted({g.bits, 8}) if b >= g.bits] + [EXACT]
    start = (g.bits_intra, g.bits_inter)
    top = (max(g.bits_intra, 8), 8)
    return [f"{a}/{b}-bit" for a, b in sorted({start, top})] + [EXACT]


def _replica_rungs(h: HsdpComm) -> list[str]:
    """The all-reduce across the replicas' rungs from ``h`` up (``[]``: exact, not climbed)."""
    if h.mode == "plain":
        return []
    return [f"{b}-bit" for b in sorted({h.bits, 8}) if b >= h.bits] + [EXACT]


def grad_rungs(g: GradComm, hsdp: HsdpComm | None = None) -> list[str]:
    """The gradients' rungs from ``g`` up, and from ``hsdp`` up where the gradients are also
    summed across replicas (HSDP); one (nothing to climb) for exact gradients."""
    inner = _reduction_rungs(g)
    across = _replica_rungs(hsdp) if hsdp is not None else []
    if not across:
        return inner
    rungs = []
    for level in range(max(len(inner), len(across))):
        i, a = inner[min(level, len(inner) - 1)], across[min(level, len(across) - 1)]
        rungs.append(EXACT if a == i == EXACT else f"{a} across replicas" if i == EXACT
                     else f"{i}, {a} across replicas")
    return rungs


def weights_at(w: WeightComm, level: int) -> tuple[WeightComm, bool]:
    """The weight config at ``level`` of :func:`weight_rungs` and whether that rung is exact."""
    steps = _weight_steps(w)
    if level >= len(steps):
        return (steps[-1] if steps else w), bool(steps)
    return steps[level], False


def grads_at(g: GradComm, level: int) -> GradComm:
    """The shard group's gradient config at ``level`` of its rungs."""
    rungs = _reduction_rungs(g)
    if level == 0 or len(rungs) == 1:
        return g
    if rungs[min(level, len(rungs) - 1)] == EXACT:
        return dataclasses.replace(g, quantize=False)
    if g.mode == "one_level":
        return dataclasses.replace(g, bits=8)
    return dataclasses.replace(g, bits_intra=max(g.bits_intra, 8), bits_inter=8)


def hsdp_at(h: HsdpComm, level: int) -> HsdpComm:
    """The all-reduce across the replicas' config at ``level`` of its rungs."""
    rungs = _replica_rungs(h)
    if level == 0 or not rungs:
        return h
    if rungs[min(level, len(rungs) - 1)] == EXACT:
        return dataclasses.replace(h, mode="plain")
    return dataclasses.replace(h, bits=8)


def config_at(cfg: QuantConfig, weight_level: int, grad_level: int,
              replicas: bool = False) -> tuple[QuantConfig, bool]:
    """``cfg`` with its weights and gradients (with ``replicas``, HSDP's, also the all-reduce
    across the replicas) moved up to the given levels, and whether the weights travel exactly."""
    weights, exact = weights_at(cfg.weights, weight_level)
    hsdp = hsdp_at(cfg.hsdp, grad_level) if replicas else cfg.hsdp
    return dataclasses.replace(cfg, weights=weights, grads=grads_at(cfg.grads, grad_level), hsdp=hsdp), exact
