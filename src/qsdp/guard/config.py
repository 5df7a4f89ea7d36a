"""What the accuracy guard measures how often, and the limits that make a group escalate."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError
from ..noise_limits import GRAD_RATIO_LIMIT, WEIGHT_RATIO_LIMIT

# Every 50 optimizer steps: a guarded step adds one exact (fp32) reduce-scatter of every group,
# which for sdp4bit on 2 x 2 ranks is about 2.6 MB a rank against 4.4 MB a step of the run's own
# traffic: 1.2% more bytes averaged over 50 steps (benchmarks/results/guard_cost.json measures it).
# And 50 steps is past the first steps, whose micro-batch gradients agree so well that q/SGD
# overstates the gradient risk (qsdp check's calibration, docs/check.md).
DEFAULT_EVERY = 50


@dataclass(frozen=True)
class GuardConfig:
    """The accuracy guard of :func:`qsdp.quantize_comms` (``guard=``; docs/check.md, "The guard
    while training").

    every: a guarded step every this many optimizer steps (steps ``start``, ``start + every``, ...).
    start: the first guarded step (``None``: ``every``, past the first steps' atypical noise).
    weight_limit: a group whose gathered weights are off by more than this many times one
        optimizer step's update (``||W_seen - w|| / ||w_new - w_old||``) takes more weight bits.
        Default: ``qsdp check``'s calibrated limit (6.5, a predicted loss gap of 0.3%).
    grad_limit: a group whose gradient path adds more than this times the variance SGD already
        has (``||Q(g) - g||^2 / var(g)``) takes more gradient bits. Default: ``qsdp check``'s
        failure limit, 1 (as if the batch were halved).
    """

    every: int = DEFAULT_EVERY
    start: int | None = None
    weight_limit: float = WEIGHT_RATIO_LIMIT
    grad_limit: float = GRAD_RATIO_LIMIT

    @property
    def first(self) -> int:
        return self.every if self.start is None else self.start

    def validate(self) -> None:
        """Raise :class:`qsdp.ConfigError` naming the first bad field."""
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ConfigError(f"guard.every={self.every!r} must be a whole number of steps, at least 1")
        if self.start is not None and (not isinstance(self.start, int) or self.start < 1):
            raise ConfigError(f"guard.start={self.start!r} must be at least 1 (step 0 has no update to compare with)")
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
