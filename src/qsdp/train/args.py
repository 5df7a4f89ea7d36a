"""The arguments of a training run, their validation and the learning-rate schedule.

Everything here is pure: no process group, no files. The choices the command line offers
(``ON_NONFINITE``, ``PARAM_DTYPES``, ``DEVICES``, ``BACKENDS``) are defined here once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from qsdp.config import ConfigError, QuantConfig, is_int, resolve_config
from qsdp.extras import MissingExtraError
from qsdp.train.checkpoint import CheckpointError
from qsdp.train.data import TOKENIZER_KINDS, DataError
from qsdp.train.model import MODEL_SIZES

__all__ = [
    "TrainArgs", "TrainError", "PeerError", "NonFiniteGradientError", "CollectiveTimeoutError",
    "USER_ERRORS", "ON_NONFINITE", "PARAM_DTYPES", "DEVICES", "BACKENDS", "MAX_TIMEOUT_S",
    "validate_args", "lr_at", "build_config",
]

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ON_NONFINITE = ("skip", "raise")
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")
MAX_TIMEOUT_S = 1e9  # about 31 years; much more overflows the process group's timedelta
# Counts (steps, sequences, tokens a sequence, checkpoints) are tensor sizes and indices: int32.
MAX_COUNT = 2**31 - 1
# AdamW moves each weight by about the learning rate a step: above 1, a step overwrites the
# weights (and 3e38 overflows float32 at the first step).
MAX_LR = 1.0
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a 64-bit seed


class TrainError(ValueError):
    """A training argument or run directory that cannot be used; the message says which."""


class PeerError(RuntimeError):
    """Raised on the other ranks when one rank failed a step they all wait for."""


class NonFiniteGradientError(RuntimeError):
    """``on_nonfinite="raise"``: some rank reduced a NaN/Inf gradient; the message names the step."""


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than ``timeout_s``: a peer stopped answering."""


# Errors that are the user's input (or install), not a bug: reported as one line, exit code 2.
USER_ERRORS = (TrainError, DataError, ConfigError, CheckpointError, MissingExtraError)


@dataclass
class TrainArgs:
    """Everything a training run needs. ``steps`` is the total: a resumed run continues up to it.

    warmup: linear warmup steps; ``None`` = 10 % of the schedule, at most 1000. decay_steps: length of the
        cosine schedule (``None`` = ``steps``); set it to stop a run early on the schedule of a
        longer one (a run of ``k`` steps with ``decay_steps=2k``, resumed with ``steps=2k``, is
        the run of ``2k`` steps). min_lr: ``None`` = ``lr / 10``.
    batch_size: sequences per rank per step, and the most a rank's micro-batch ever holds; a
        resume on another number of ranks keeps the checkpoint's global batch and per-rank
        batch instead (shares that may differ by one, drawn in micro-batches no larger),
        unless ``new_global_batch`` (see :mod:`qsdp.train.elastic`).
    eval_batches: validation batches in all, split over the ranks (rounded up to a multiple of
        the world size). eval_every, ckpt_every: 0 = only at the end. grad_clip: 0 = off.
    local_world_size: ranks per node for the two-level reduce-scatter (``None``: the config's
        value or ``LOCAL_WORLD_SIZE``); lets one machine emulate several nodes.
    hsdp: shard inside the node, replicate across the ``world / local_world_size`` nodes (at
        least 2), the inter-node gradient all-reduce travelling as the config's ``hsdp`` says
        (see :mod:`qsdp.hsdp`).
    resume_from: the checkpoint to continue from instead of ``latest`` (``step_XXXXXXXX`` under
        ``OUT/checkpoints``, or its path); implies ``resume``, and the run makes it ``latest``.
    on_nonfinite: ``skip`` (drop the step on every rank, count it) or ``raise`` (stop the run)
        when some rank reduced a NaN/Inf gradient; see :mod:`qsdp.train.trainer`.
    param_dtype: ``float32`` or ``bfloat16`` (FSDP2 mixed precision, gradients reduced in fp32);
        ``None`` = bfloat16 on CUDA, float32 on CPU.
    device: where the tensors live, ``cpu`` or ``cuda``; ``None`` = ``cuda`` if there is one.
    backend: the process group's backend, ``gloo`` or ``nccl``; ``None`` = ``nccl`` on CUDA,
        ``gloo`` on CPU. ``gloo`` with ``cuda`` lets several ranks share one GPU (rank r uses
        GPU ``LOCAL_RANK % device_count``); ``nccl`` needs one GPU a rank. Both are only used
        when ``train_worker`` creates the process group.
    cache_dir: token and tokenizer caches; ``None`` = ``$QSDP_CACHE_DIR`` or ``~/.cache/qsdp``.
    guard_every: the accuracy guard (``quantize_comms(guard=K)``): every this many optimizer steps
        each FSDP group's quantization noise is measured on the run's data, and a group over
        ``qsdp check``'s limits takes more bits from then on (docs/check.md); 0 (default): off.
    sync_timing: wait for the GPU at the end of every step, so that ``step_time_s`` is the
        step's own device time (one more host sync per step); otherwise a step's time also holds
        what the device still had to do of the step before (see :mod:`qsdp.train.trainer`).
    """

    preset: str = "sdp4bit"
    overrides: dict[str, Any] = field(default_factory=dict)
    model: str = "tiny"
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 2e-3
    warmup: int | None = None
    decay_steps: int | None = None
    min_lr: float | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    data: str | None = None
    tokenizer: str = "byte"
    out: str = "runs/train"
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 500
    keep_checkpoints: int = 2
    resume: bool = False
    resume_from: str | None = None
    new_global_batch: bool = False
    log_every: int = 1
    local_world_size: int | None = None
    hsdp: bool = False
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    device: str | None = None
    backend: str | None = None
    timeout_s: float = 600.0
    on_nonfinite: str = "skip"
    cache_dir: str | None = None
    progress: bool = True
    sync_timing: bool = False
    guard_every: int = 0

    def __post_init__(self) -> None:
        if self.resume_from is not None:
            self.resume = True

    def schedule(self) -> tuple[int, int, float]:
        """(warmup, decay_steps, min_lr) with the defaults filled in."""
        decay = self.decay_steps if self.decay_steps is not None else self.steps
        warmup = self.warmup if self.warmup is not None else max(1, min(1000, decay // 10))
        min_lr = self.min_lr if self.min_lr is not None else self.lr / 10
        return warmup, decay, min_lr

    def quant_overrides(self) -> dict[str, Any]:
        """The config overrides, with ``local_world_size`` and the run's seed folded in (an
        explicit ``seed`` override wins)."""
        over = dict(self.overrides)
        if self.local_world_size is not None:
            over["local_world_size"] = self.local_world_size
        over.setdefault("seed", self.seed)
        return over

    def use_cuda(self) -> bool:
        """Whether the run's tensors live on CUDA."""
        return self.device == "cuda" or (self.device is None and torch.cuda.is_available())

    def process_backend(self) -> str:
        """The backend of a process group this job creates."""
        if self.backend is not None:
            return self.backend
        return "nccl" if self.use_cuda() else "gloo"


def build_config(args: TrainArgs) -> QuantConfig:
    """The run's quantization config (ConfigError naming a bad preset or override)."""
    return resolve_config(args.preset, args.quant_overrides())


def lr_at(step: int, args: TrainArgs) -> float:
    """Learning rate of the optimizer step with 0-based index ``step``: linear warmup, then
    cosine decay to ``min_lr`` at ``decay_steps``, then ``min_lr``."""
    warmup, decay, min_lr = args.schedule()
    if step < warmup:
        return args.lr * (step + 1) / warmup
    if step >= decay:
        return min_lr
    ratio = (step - warmup) / max(1, decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - min_lr)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise TrainError(msg)


def _check_counts(args: TrainArgs) -> None:
    for name in ("steps", "batch_size", "seq_len", "eval_batches", "log_every"):
        value = getattr(args, name)
        _need(is_int(value) and 0 < value <= MAX_COUNT,
              f"{name} must be a positive integer (at most {MAX_COUNT}), got {value!r}")
    for name in ("eval_every", "ckpt_every", "keep_checkpoints"):
        value = getattr(args, name)
        _need(is_int(value) and 0 <= value <= MAX_COUNT,
              f"{name} must be a non-negative integer (at most {MAX_COUNT}), got {value!r}")
    _need(is_int(args.seed) and 0 <= args.seed <= MAX_SEED,
          f"seed must be a non-negative integer (at most 2**63 - 1), got {args.seed!r}")
    for name in ("warmup", "decay_steps"):
        value = getattr(args, name)
        _need(value is None or (is_int(value) and 0 <= value <= MAX_COUNT),
              f"{name} must be a non-negative integer (at most {MAX_COUNT}), got {value!r}")
    _need(args.local_world_size is None or (is_int(args.local_world_size) and 0 < args.local_world_size <= MAX_COUNT),
          f"local_world_size must be a positive integer, got {args.local_world_size!r}")


def _check_numbers(args: TrainArgs) -> None:
    _need(math.isfinite(args.lr) and args.lr > 0, f"lr must be a positive number, got {args.lr!r}")
    _need(args.lr <= MAX_LR, f"lr must be at most {MAX_LR:g} (AdamW moves each weight by about lr a step), "
          f"got {args.lr!r}")
    _need(args.min_lr is None or (math.isfinite(args.min_lr) and 0 <= args.min_lr <= args.lr),
          f"min_lr must be in [0, lr={args.lr}], got {args.min_lr!r}")
    _need(math.isfinite(args.weight_decay) and args.weight_decay >= 0,
          f"weight_decay must be >= 0, got {args.weight_decay!r}")
    _need(args.lr * args.weight_decay < 1,
          f"lr * weight_decay must be below 1 (AdamW scales the weights by 1 - lr * weight_decay a step), got "
          f"{args.lr!r} * {args.weight_decay!r}")
    _need(math.isfinite(args.grad_clip) and args.grad_clip >= 0,
          f"grad_clip must be >= 0 (0 = off), got {args.grad_clip!r}")
    _need(isinstance(args.timeout_s, (int, float)) and 0 < args.timeout_s <= MAX_TIMEOUT_S,
          f"timeout must be a positive number of seconds (at most {MAX_TIMEOUT_S:.0e}), got {args.timeout_s!r}")


def _check_choices(args: TrainArgs) -> None:
    _need(args.model in MODEL_SIZES, f"unknown model {args.model!r}; allowed: {', '.join(MODEL_SIZES)}")
    _need(args.tokenizer in TOKENIZER_KINDS,
          f"unknown tokenizer {args.tokenizer!r}; allowed: {', '.join(TOKENIZER_KINDS)}")
    _need(args.on_nonfinite in ON_NONFINITE,
          f"unknown on_nonfinite {args.on_nonfinite!r}; allowed: {', '.join(ON_NONFINITE)}")
    _need(args.param_dtype is None or args.param_dtype in PARAM_DTYPES,
          f"unknown param_dtype {args.param_dtype!r}; allowed: {', '.join(PARAM_DTYPES)}")
    _need(args.device is None or args.device in DEVICES,
          f"unknown device {args.device!r}; allowed: {', '.join(DEVICES)}")
    _need(args.backend is None or args.backend in BACKENDS,
          f"unknown backend {args.backend!r}; allowed: {', '.join(BACKENDS)}")
    _need(args.device != "cuda" or torch.cuda.is_available(), "device cuda requested but CUDA is not available")
    _need(not (args.backend == "nccl" and not args.use_cuda()),
          "backend nccl needs CUDA tensors; use --backend gloo on CPU")
    _need(bool(args.out), "out must be a directory path")
    _need(args.resume_from is None or (isinstance(args.resume_from, str) and bool(args.resume_from.strip())),
          f"resume_from must name a checkpoint (step_XXXXXXXX), got {args.resume_from!r}")
    _need(isinstance(args.hsdp, bool), f"hsdp must be a bool, got {args.hsdp!r}")
    _need(is_int(args.guard_every) and 0 <= args.guard_every <= MAX_COUNT,
          f"guard_every must be a non-negative number of steps (0 = off), got {args.guard_every!r}")


def validate_args(args: TrainArgs) -> QuantConfig:
    """Raise TrainError (or ConfigError for the quantization config) naming the first bad
    argument; returns the built quantization config. Checks values only; the data, the run
    directory and the checkpoint are checked by :func:`qsdp.train.preflight.preflight`."""
    _check_choices(args)
    _check_counts(args)
    _check_numbers(args)
    return build_config(args)
