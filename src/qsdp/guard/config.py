"""What the accuracy guard measures how often, and the limits that make a group escalate."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, is_int
from ..noise_limits import GRAD_RATIO_LIMIT, WEIGHT_RATIO_LIMIT

# Every 50 optimizer steps: a round adds one exact (fp32) reduce-scatter of every quantized group,
# for sdp4bit on 2 x 2 ranks of the tiny GPT 2.6 MB against about 4.4 MB a step of the run's own
# traffic: about 1.3% more bytes averaged over 50 steps (`qsdp bench guard`).
DEFAULT_EVERY = 50
# The first round right after the first update: a weight quantizer that drowns the updates does
# its lasting damage in the first steps (the tiny GPT's convergence setting, seed 0: zeropp's
# 4-bit direct weights for the first 12 steps, then 4-bit differences, ended +2.2% above fsdp's
# loss; for the first 3 steps, +0.3%; differences throughout, -0.3%: benchmarks/results/guard_ladder_runs.json).
DEFAULT_START = 1
# Gradients move from this step on: before it the micro-batches' gradients agree so well that
# q/SGD overstates the risk (qsdp check's calibration, docs/check.md "How many warm-up steps":
# sdp4bit measured q/SGD 1.8-4 after one step of the tiny GPT, 0.05-0.11 after 20).
DEFAULT_GRAD_START = 50


@dataclass(frozen=True)
class GuardConfig:
    """The accuracy guard of :func:`qsdp.quantize_comms` (``guard=``; docs/check.md, "The guard
    while training").

    every: a guarded step every this many optimizer steps (steps ``start``, ``start + every``, ...).
    start: the first guarded step (after this many optimizer steps; default 1, right after the
        first update: a weight quantizer that drowns the updates does its damage early).
    grad_start: a round before this many steps measures the gradients but moves none (early
        gradients agree across the micro-batches so well that q/SGD overstates the risk).
    weight_limit: a group whose gathered weights are off by more than this many times one
        optimizer step's update (``||W_seen - w|| / ||w_new - w_old||``) takes more weight bits.
        Default: ``qsdp check``'s calibrated limit (6.5, a predicted loss gap of 0.3%).
    grad_limit: a group whose gradient path adds more than this times the variance SGD already
        has (``||Q(g) - g||^2 / var(g)``) takes more gradient bits. Default: ``qsdp check``'s
        failure limit, 1 (as if the batch were halved).
    """

    every: int = DEFAULT_EVERY
    start: int = DEFAULT_START
    grad_start: int = DEFAULT_GRAD_START
    weight_limit: float = WEIGHT_RATIO_LIMIT
    grad_limit: float = GRAD_RATIO_LIMIT

    def validate(self) -> None:
        """Raise :class:`qsdp.ConfigError` naming the first bad field."""
        if not is_int(self.every) or self.every < 1:
            raise ConfigError(f"guard.every={self.every!r} must be a whole number of steps, at least 1")
        if not is_int(self.start) or self.start < 1:
            raise ConfigError(f"guard.start={self.start!r} must be at least 1 (step 0 has no update to compare with)")
        if not is_int(self.grad_start) or self.grad_start < 0:
            raise ConfigError(f"guard.grad_start={self.grad_start!r} must be a whole number of steps, at least 0")
        for name in ("weight_limit", "grad_limit"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"guard.{name}={value!r} must be a positive number")


def as_guard_config(guard: "GuardConfig | int | None") -> GuardConfig | None:
    """``guard=`` as :func:`qsdp.quantize_comms` takes it: a :class:`GuardConfig`, a whole number
    of steps (``GuardConfig(every=K)``), or ``None``/``0`` (no guard); validated."""
    if guard is None or guard is False or guard == 0:
        return None
    if isinstance(guard, bool) or not isinstance(guard, (int, GuardConfig)):
        raise ConfigError(f"guard={guard!r}: give a GuardConfig, a number of steps (every K steps) or None")
    cfg = GuardConfig(every=guard) if isinstance(guard, int) else guard
    cfg.validate()
    return cfg
