"""The accuracy guard: ``qsdp check``'s measurements taken inside a running job, every K steps,
and a group whose quantization noise outgrows SGD's moved to more bits on every rank at once
(docs/check.md, "The guard while training")."""

from .config import DEFAULT_EVERY, GuardConfig, as_guard_config
from .guard import AccuracyGuard, Escalation, GroupReading
from .ladder import grad_rungs, weight_rungs

__all__ = ["GuardConfig", "AccuracyGuard", "Escalation", "GroupReading", "as_guard_config", "DEFAULT_EVERY",
           "weight_rungs", "grad_rungs"]
