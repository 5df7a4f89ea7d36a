"""The training job of one worker process: data, GPT, FSDP2 + qsdp comms, AdamW, metrics,
checkpoints.

``train_worker(args)`` runs inside an initialized process group, or initializes one from the
environment ``torchrun`` sets (NCCL and one GPU a process when CUDA is there, else gloo on CPU).
Every rank runs the same code; rank 0 alone writes metrics, the summary and the progress bar.

Steps are counted from 1: the record of step ``s`` is written after ``s`` optimizer steps. The
batch of step ``s`` is ``TokenDataset.batch(s - 1, rank, ...)``, a pure function of the step, so
a checkpoint of step ``s`` resumes exactly (model, optimizer, comm state, RNG; the learning rate
is a function of the step). Per step, in this order: train, log, checkpoint, evaluate.

``metrics.jsonl`` (rank 0), one line per logged step::

    step, loss (mean over ranks), lr, grad_norm (before clipping), step_time_s, tokens_per_s,
    wire_bytes_total,
    wire_bytes_{kind}_{level}, bits_per_elt_{kind}_{level}   kind: weights, grads (and
        wire_bytes_control_{level}); level: intra, inter, total
    nonfinite_skipped (steps skipped so far, see below; grad_norm is null on a skipped step)

and ``{"step", "val_loss"}`` lines. Bytes are cumulative since the start of the run (resumes
included) and summed over all ranks: the whole job's traffic as the byte meter counts it
(see :mod:`qsdp.comm.meter`), evaluation forwards included. ``summary.json`` at the end holds
the config, the final losses, the bytes by kind and level, timings, the environment,
``nonfinite_skipped`` and ``final_weights_sha256`` / ``final_optimizer_sha256``: SHA-256 over every
rank's digest of its local shards (model parameters; optimizer state), in rank order. Two runs
with the same world size have equal hashes exactly when their final states are bit-identical.

Non-finite gradients (``on_nonfinite``). After ``backward`` every rank asks
:meth:`qsdp.QuantizedComms.nonfinite_gradients` (one collective) whether any rank reduced a NaN
or Inf gradient. ``skip`` (the default): every rank drops the step's gradients and does not step
the optimizer, so weights, optimizer state (AdamW's step count included) and the weight-difference
replicas stay unchanged and identical on all ranks; the step number still advances, i.e. the batch
of that step is consumed and the learning-rate schedule, a function of the step number, does not
shift (the skipped step's learning rate is simply never applied). ``raise``: the run stops with
:class:`NonFiniteGradientError` naming the step (weights not updated at that step).

Restarts. Under torch's elastic agent (``qsdp train --max-restarts N``, or torchrun's) a failed
worker group is restarted with ``TORCHELASTIC_RESTART_COUNT`` > 0; a restarted attempt resumes
from ``OUT/checkpoints/latest`` when there is one (the same identity check as ``--resume``), else
starts afresh. A resume (``--resume`` or a restart) first drops the records of ``metrics.jsonl``
after the checkpoint's step: they belong to the attempt that crashed and are written again.

A collective that waits longer than ``timeout_s`` (a peer that stopped answering) ends the run
with :class:`CollectiveTimeoutError` naming the step, instead of hanging.

Test-only fault injection (environment variables, read once per worker; never set them in real
runs). ``STEP`` is 1-based, ``RANK`` the global rank; each fires once, on the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` unset or 0):

- ``QSDP_TEST_NAN_AT=STEP:RANK``: that rank back-propagates ``loss * NaN`` at that step (its
  gradients become NaN; the logged loss stays the forward's).
- ``QSDP_TEST_KILL_AT=STEP:RANK``: that rank sends itself SIGKILL after that step's backward.
- ``QSDP_TEST_STALL_AT=STEP:RANK:SECONDS``: that rank sleeps before that step (a peer that stops
  answering).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import qsdp
from qsdp.comm.meter import KINDS, LEVELS
from qsdp.config import ConfigError, is_int, resolve_config
from qsdp.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from qsdp.train.data import TOKENIZER_KINDS, DataError, TokenDataset, get_tokenizer, load_corpus
from qsdp.train.files import atomic_write
from qsdp.train.metrics import METRICS_FILE, MetricsWriter, read_metrics, write_summary
from qsdp.train.model import MODEL_SIZES, count_params, make_gpt, transformer_blocks

__all__ = [
    "TrainArgs", "TrainError", "PeerError", "NonFiniteGradientError", "CollectiveTimeoutError",
    "USER_ERRORS", "ON_NONFINITE", "train_worker", "validate_args", "check_out_dir", "check_resume",
    "prepare_dataset", "lr_at", "default_cache_dir", "use_cuda", "restart_count",
]

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ON_NONFINITE = ("skip", "raise")
MAX_TIMEOUT_S = 1e9  # about 31 years; much more overflows the process group's timedelta


class TrainError(ValueError):
    """A training argument or run directory that cannot be used; the message says which."""


class PeerError(RuntimeError):
    """Raised on the other ranks when one rank failed a step they all wait for."""


class NonFiniteGradientError(RuntimeError):
    """``on_nonfinite="raise"``: some rank reduced a NaN/Inf gradient; the message names the step."""


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than ``timeout_s``: a peer stopped answering."""


# Errors that are the user's input, not a bug: reported as one line, exit code 2.
USER_ERRORS = (TrainError, DataError, ConfigError, CheckpointError)


@dataclass
class TrainArgs:
    """Everything a training run needs. ``steps`` is the total: a resumed run continues up to it.

    warmup: linear warmup steps; ``None`` = 10 % of the schedule, at most 1000. decay_steps: length of the
        cosine schedule (``None`` = ``steps``); set it to stop a run early on the schedule of a
        longer one (a run of ``k`` steps with ``decay_steps=2k``, resumed with ``steps=2k``, is
        the run of ``2k`` steps). min_lr: ``None`` = ``lr / 10``.
    batch_size: sequences per rank per step. eval_batches: validation batches in all, split
        over the ranks (rounded up to a multiple of the world size). eval_every, ckpt_every:
        0 = only at the end. grad_clip: 0 = off.
    local_world_size: ranks per node for the two-level reduce-scatter (``None``: the config's
        value or ``LOCAL_WORLD_SIZE``); lets one machine emulate several nodes.
    on_nonfinite: ``skip`` (drop the step on every rank, count it) or ``raise`` (stop the run)
        when some rank reduced a NaN/Inf gradient; see the module docstring.
    param_dtype: ``float32`` or ``bfloat16`` (FSDP2 mixed precision, gradients reduced in fp32);
        ``None`` = bfloat16 on CUDA, float32 on CPU.
    device: ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU a process); ``None`` = ``cuda`` if there is
        one. Only used when ``train_worker`` creates the process group.
    cache_dir: token and tokenizer caches; ``None`` = ``$QSDP_CACHE_DIR`` or ``~/.cache/qsdp``.
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
    log_every: int = 1
    local_world_size: int | None = None
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    device: str | None = None
    timeout_s: float = 600.0
    on_nonfinite: str = "skip"
    cache_dir: str | None = None
    progress: bool = True

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


def validate_args(args: TrainArgs) -> None:
    """Raise TrainError (or ConfigError for the quantization config) naming the first bad
    argument. Checks values only; the data, the run directory and the checkpoint are checked by
    :func:`prepare_dataset`, :func:`check_out_dir` and :func:`check_resume`."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise TrainError(msg)

    need(args.model in MODEL_SIZES, f"unknown model {args.model!r}; allowed: {', '.join(MODEL_SIZES)}")
    need(args.tokenizer in TOKENIZER_KINDS,
         f"unknown tokenizer {args.tokenizer!r}; allowed: {', '.join(TOKENIZER_KINDS)}")
    for name in ("steps", "batch_size", "seq_len", "eval_batches", "log_every"):
        v = getattr(args, name)
        need(is_int(v) and v > 0, f"{name} must be a positive integer, got {v!r}")
    for name in ("eval_every", "ckpt_every", "seed"):
        v = getattr(args, name)
        need(is_int(v) and v >= 0, f"{name} must be a non-negative integer, got {v!r}")
    need(is_int(args.keep_checkpoints), f"keep_checkpoints must be an integer, got {args.keep_checkpoints!r}")
    for name in ("warmup", "decay_steps"):
        v = getattr(args, name)
        need(v is None or (is_int(v) and v >= 0), f"{name} must be a non-negative integer, got {v!r}")
    need(math.isfinite(args.lr) and args.lr > 0, f"lr must be a positive number, got {args.lr!r}")
    need(args.min_lr is None or (math.isfinite(args.min_lr) and 0 <= args.min_lr <= args.lr),
         f"min_lr must be in [0, lr={args.lr}], got {args.min_lr!r}")
    need(math.isfinite(args.weight_decay) and args.weight_decay >= 0,
         f"weight_decay must be >= 0, got {args.weight_decay!r}")
    need(math.isfinite(args.grad_clip) and args.grad_clip >= 0,
         f"grad_clip must be >= 0 (0 = off), got {args.grad_clip!r}")
    need(isinstance(args.timeout_s, (int, float)) and 0 < args.timeout_s <= MAX_TIMEOUT_S,
         f"timeout must be a positive number of seconds (at most {MAX_TIMEOUT_S:.0e}), got {args.timeout_s!r}")
    need(args.on_nonfinite in ON_NONFINITE,
         f"unknown on_nonfinite {args.on_nonfinite!r}; allowed: {', '.join(ON_NONFINITE)}")
    need(args.local_world_size is None or (is_int(args.local_world_size) and args.local_world_size > 0),
         f"local_world_size must be a positive integer, got {args.local_world_size!r}")
    need(args.param_dtype is None or args.param_dtype in PARAM_DTYPES,
         f"unknown param_dtype {args.param_dtype!r}; allowed: {', '.join(PARAM_DTYPES)}")
    need(args.device in (None, "cpu", "cuda"), f"unknown device {args.device!r}; allowed: cpu, cuda")
    need(args.device != "cuda" or torch.cuda.is_available(), "device cuda requested but CUDA is not available")
    need(bool(args.out), "out must be a directory path")
    resolve_config(args.preset, args.quant_overrides())  # raises ConfigError


def default_cache_dir() -> str:
    return os.environ.get("QSDP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qsdp")


def _usable_cache_dir(args: TrainArgs) -> str | None:
    path = args.cache_dir or default_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # no cache: every rank encodes the text itself
    return path if os.access(path, os.W_OK) else None


def prepare_dataset(args: TrainArgs) -> tuple[TokenDataset, str]:
    """The dataset of a run (building the token and tokenizer caches if missing) and a
    fingerprint of its text and tokenizer. Raises DataError if the text is missing, unreadable
    or too short for ``seq_len``."""
    text = load_corpus(args.data)
    cache = _usable_cache_dir(args)
    tok = get_tokenizer(args.tokenizer, text, cache)
    ds = TokenDataset.from_text(text, tok, cache_dir=cache, seed=args.seed)
    # Both splits must hold a window of seq_len + 1 tokens (raises DataError naming the split).
    ds.batch(0, 0, 1, 1, args.seq_len)
    next(ds.val_batches(1, 1, args.seq_len))
    h = hashlib.sha256(tok.fingerprint.encode() + b"\0")
    h.update(text.encode("utf-8"))
    return ds, h.hexdigest()[:16]


def check_out_dir(args: TrainArgs) -> None:
    """A fresh run needs a run directory without a previous run's metrics or checkpoints."""
    out = Path(args.out)
    if args.resume:
        return
    for name in (METRICS_FILE, "checkpoints/latest"):
        if (out / name).exists():
            raise TrainError(
                f"--out {args.out} already holds a run ({name}); pass --resume to continue it "
                "or choose another --out"
            )


def _run_identity(args: TrainArgs, world_size: int, data_id: str | None) -> dict[str, Any]:
    """What must be equal for a checkpoint to be resumed by this run."""
    cfg = resolve_config(args.preset, args.quant_overrides())
    ident = {
        "model": args.model, "tokenizer": args.tokenizer, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "seed": args.seed, "world_size": world_size,
        "config": cfg.to_dict(),
    }
    if data_id is not None:
        ident["data_id"] = data_id
    return ident


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check_identity(path: Path, meta: dict[str, Any], args: TrainArgs, world_size: int,
                    data_id: str | None) -> None:
    mine = _flatten(_run_identity(args, world_size, data_id))
    theirs = _flatten(meta.get("identity", {}))
    # Only what both know: a field added to the config since the checkpoint is not a change.
    diffs = [f"{k}: checkpoint {theirs[k]!r} != now {v!r}" for k, v in mine.items()
             if k in theirs and theirs[k] != v]
    if diffs:
        raise TrainError(f"--resume: checkpoint {path} was written by a different run: " + "; ".join(diffs))


def check_resume(args: TrainArgs, world_size: int, data_id: str | None = None) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``--resume`` continues from and its ``trainer.json``; TrainError if there
    is none, if it was written by a different run, or if it is already at ``--steps``."""
    path = latest_checkpoint(args.out)
    if path is None:
        raise TrainError(f"--resume: no checkpoint in {os.path.join(args.out, 'checkpoints')} "
                         "(checkpoints/latest is missing)")
    meta = read_meta(path)
    _check_identity(path, meta, args, world_size, data_id)
    if int(meta["step"]) >= args.steps:
        raise TrainError(f"--resume: checkpoint {path.name} is already at step {meta['step']} >= "
                         f"--steps {args.steps}; pass a larger --steps to train further")
    return path, meta


def restart_count() -> int:
    """How many times torch's elastic agent has restarted this worker group (0: first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def _restart_checkpoint(args: TrainArgs, world_size: int, data_id: str | None) -> Path | None:
    """The checkpoint a restarted attempt resumes from: ``latest`` if this run wrote one (the
    identity is checked as for ``--resume``; it may already be at ``--steps`` if the crash came
    after the final save), else ``None`` (start afresh)."""
    path = latest_checkpoint(args.out)
    if path is not None:
        _check_identity(path, read_meta(path), args, world_size, data_id)
    return path


def _drop_metrics_after(out: str, step: int) -> None:
    """Rewrite ``metrics.jsonl`` without the records of steps after ``step`` (what an attempt
    that crashed logged past the checkpoint a resume continues from). Rank 0 only."""
    path = Path(out) / METRICS_FILE
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]  # a partial last line is dropped
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and int(rec.get("step", 0)) <= step:
            kept.append(line + "\n")
    if len(kept) == len(lines):
        return
    atomic_write(path, lambda f: f.write("".join(kept).encode("utf-8")))


# ---------------------------------------------------------------------------------------------
# Test-only fault injection (see the module docstring)


@dataclass(frozen=True)
class _Faults:
    nan_at: tuple[int, int] | None = None
    kill_at: tuple[int, int] | None = None
    stall_at: tuple[int, int, float] | None = None

    @classmethod
    def from_env(cls) -> _Faults:
        if restart_count() > 0:
            return cls()

        def parse(var: str, n: int) -> tuple | None:
            text = os.environ.get(var)
            if not text:
                return None
            parts = text.split(":")
            try:
                if len(parts) != n:
                    raise ValueError
                return (int(parts[0]), int(parts[1]), *(float(x) for x in parts[2:]))
            except ValueError:
                raise ValueError(f"{var}={text!r}: expected {':'.join(['STEP', 'RANK', 'SECONDS'][:n])}") from None

        return cls(parse("QSDP_TEST_NAN_AT", 2), parse("QSDP_TEST_KILL_AT", 2), parse("QSDP_TEST_STALL_AT", 3))

    def stall(self, step: int, rank: int) -> None:
        if self.stall_at is not None and self.stall_at[:2] == (step, rank):
            time.sleep(self.stall_at[2])

    def nan(self, step: int, rank: int) -> bool:
        return self.nan_at == (step, rank)

    def kill(self, step: int, rank: int) -> None:
        if self.kill_at == (step, rank):
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Process group and device


def _init_process_group(args: TrainArgs) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise TrainError(
                f"train_worker needs an initialized process group or the torchrun environment "
                f"({var} is not set); launch with `qsdp train --nproc N` or torchrun"
            )
    timeout = datetime.timedelta(seconds=args.timeout_s)
    backend = "nccl" if use_cuda(args) else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    attempt = restart_count()
    if attempt > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The elastic agent keeps one TCPStore across restarts and init_process_group does not
        # separate the attempts' keys, so a restarted group would read the dead group's gloo
        # addresses / NCCL ids (pytorch/pytorch#135712): give each attempt its own key prefix.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"qsdp/attempt_{attempt}", store),
                                rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def use_cuda(args: TrainArgs) -> bool:
    """Whether a process group this job creates runs on CUDA/NCCL."""
    return args.device == "cuda" or (args.device is None and torch.cuda.is_available())


def _device() -> torch.device:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rank0_first(fn, rank: int):
    """``fn()`` on rank 0, then on the other ranks (rank 0 builds shared caches). If rank 0
    fails, the others raise PeerError instead of waiting at the barrier."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the others
            error = e
    status = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(status, src=0)
    if error is not None:
        raise error
    if status[0] is not None:
        raise PeerError(f"rank 0 failed: {status[0]}")
    return result if rank == 0 else fn()


# ---------------------------------------------------------------------------------------------
# Bytes on the wire


class WireTotals:
    """Cumulative bytes and elements per (kind, level), summed over all ranks."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.counts = {k: {lv: [0, 0] for lv in LEVELS} for k in KINDS}
        for k, per in (state or {}).items():
            for lv, c in per.items():
                if k in self.counts and lv in self.counts[k]:
                    self.counts[k][lv] = [int(c["bytes"]), int(c["elements"])]

    def collect(self, device: torch.device, extra: list[float] = ()) -> list[float]:
        """Add what the meter counted on every rank since the last call (collective: one
        all-reduce, which also sums ``extra`` over the ranks and returns it)."""
        stats = qsdp.comm_stats(reset=True)
        vec = list(extra)
        for k in KINDS:
            for lv in LEVELS:
                vec += [stats[k][lv]["bytes"], stats[k][lv]["elements"]]
        t = torch.tensor(vec, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        vals = t.tolist()
        n = len(extra)
        i = n
        for k in KINDS:
            for lv in LEVELS:
                self.counts[k][lv][0] += int(vals[i])
                self.counts[k][lv][1] += int(vals[i + 1])
                i += 2
        return vals[:n]

    def total_bytes(self) -> int:
        return sum(c[0] for per in self.counts.values() for c in per.values())

    def as_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for k, per in self.counts.items():
            d: dict[str, dict[str, float]] = {}
            for lv, (b, e) in per.items():
                d[lv] = {"bytes": b, "elements": e, "bits_per_element": 8.0 * b / e if e else 0.0}
            tb, te = sum(c[0] for c in per.values()), sum(c[1] for c in per.values())
            d["total"] = {"bytes": tb, "elements": te, "bits_per_element": 8.0 * tb / te if te else 0.0}
            out[k] = d
        return out

    def flat(self) -> dict[str, float]:
        rec: dict[str, float] = {"wire_bytes_total": self.total_bytes()}
        for k, per in self.as_dict().items():
            for lv, c in per.items():
                rec[f"wire_bytes_{k}_{lv}"] = c["bytes"]
                if k != "control":
                    rec[f"bits_per_elt_{k}_{lv}"] = round(c["bits_per_element"], 4)
        return rec


# ---------------------------------------------------------------------------------------------
# The job


def _build_model(args: TrainArgs, vocab_size: int, device: torch.device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = make_gpt(args.model, vocab_size, args.seq_len).to(device)
    dtype_name = args.param_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    param_dtype = PARAM_DTYPES[dtype_name]
    mp = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
          if param_dtype != torch.float32 else MixedPrecisionPolicy())
    for block in transformer_blocks(model):
        fully_shard(block, reshard_after_forward=args.reshard_after_forward, mp_policy=mp)
    fully_shard(model, reshard_after_forward=args.reshard_after_forward, mp_policy=mp)
    return model, dtype_name


def _make_optimizer(model: torch.nn.Module, args: TrainArgs) -> torch.optim.Optimizer:
    # No weight decay on biases, norms and other 1-D parameters (GPT-2 / nanoGPT practice).
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def _clip_grads(model: torch.nn.Module, max_norm: float) -> float:
    """Global gradient norm (FSDP2 DTensor gradients), clipped to ``max_norm`` unless 0."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


def _evaluate(model, ds: TokenDataset, args: TrainArgs, rank: int, world: int, device) -> float:
    """Mean validation loss over ``eval_batches`` fixed batches split across the ranks (each
    rank runs the same number of forwards: FSDP2's gathers are collective)."""
    per_rank = -(-args.eval_batches // world)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i, (x, y) in enumerate(ds.val_batches(per_rank * world, args.batch_size, args.seq_len)):
            if i % world != rank:
                continue
            _, loss = model(x.to(device), y.to(device))
            total += float(loss)
            count += 1
    model.train()
    t = torch.tensor([total, count], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t[0].item() / t[1].item()


def train_worker(args: TrainArgs) -> dict[str, Any]:
    """Run the training job on this rank; returns the run summary (the same on every rank).

    Uses the initialized default process group, or initializes one from the torchrun
    environment (and destroys it at the end).
    """
    validate_args(args)
    owns_group = not dist.is_initialized()
    if owns_group:
        _init_process_group(args)
    try:
        return _Trainer(args).run()
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


class _Trainer:
    def __init__(self, args: TrainArgs) -> None:
        self.args = args
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = _device()

    def run(self) -> dict[str, Any]:
        args, rank, world, device = self.args, self.rank, self.world, self.device
        t_start = time.perf_counter()
        restarted = restart_count() > 0
        faults = _Faults.from_env()
        if not args.resume and not restarted:
            check_out_dir(args)
        ds, data_id = _rank0_first(lambda: prepare_dataset(args), rank)
        resume_from = None
        if restarted:  # the elastic agent restarted the group: continue from the last good checkpoint
            resume_from = _restart_checkpoint(args, world, data_id)
        elif args.resume:
            resume_from, _ = check_resume(args, world, data_id)
        dist.barrier()  # every rank has checked the run directory before rank 0 writes to it

        model, dtype_name = _build_model(args, ds.vocab_size, device)
        handle = qsdp.quantize_comms(model, args.preset, overrides=args.quant_overrides())
        optimizer = _make_optimizer(model, args)
        qsdp.comm_stats(reset=True)

        start_step, wire, skipped = 0, WireTotals(), 0
        last_loss = last_val = float("nan")
        if resume_from is not None:
            meta = load_checkpoint(resume_from, model, optimizer, handle, device)
            start_step = int(meta["step"])
            wire = WireTotals(meta.get("wire"))
            skipped = int(meta.get("nonfinite_skipped", 0))
            last_loss = float(meta.get("train_loss", float("nan")))
        if rank == 0 and (resume_from is not None or restarted):
            _drop_metrics_after(args.out, start_step)
        identity = _run_identity(args, world, data_id)

        writer = MetricsWriter(args.out, enabled=rank == 0)
        bar = None
        if rank == 0 and args.progress:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, initial=start_step, desc=handle.config.name, unit="step",
                       dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 5.0)
        tokens_per_step = args.batch_size * args.seq_len * world
        step_times: list[float] = []
        postfix: dict[str, str] = {}  # progress bar: loss, tokens/s, bits/element on the wire
        step = start_step
        try:
            for step in range(start_step + 1, args.steps + 1):
                t0 = time.perf_counter()
                faults.stall(step, rank)
                lr = lr_at(step - 1, args)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                x, y = ds.batch(step - 1, rank, world, args.batch_size, args.seq_len)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                _, loss = model(x, y)
                (loss * float("nan") if faults.nan(step, rank) else loss).backward()
                faults.kill(step, rank)
                grad_norm: float | None
                if handle.nonfinite_gradients():  # collective: the same answer on every rank
                    optimizer.zero_grad(set_to_none=True)
                    if args.on_nonfinite == "raise":
                        raise NonFiniteGradientError(
                            f"non-finite gradient (NaN/Inf) at step {step} (--on-nonfinite raise); "
                            f"the weights were not updated at step {step}, the last checkpoint is "
                            f"{_latest_name(args.out)}")
                    skipped += 1
                    grad_norm = None
                else:
                    grad_norm = _clip_grads(model, args.grad_clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                step_times.append(dt)

                if step % args.log_every == 0 or step == args.steps:
                    (loss_sum,) = wire.collect(device, [loss.detach().double().item()])
                    last_loss = loss_sum / world
                    rec = {"step": step, "loss": last_loss, "lr": lr, "grad_norm": grad_norm,
                           "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                           "nonfinite_skipped": skipped, **wire.flat()}
                    writer.write(rec)
                    postfix.update(loss=f"{last_loss:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                   bits_w=f"{rec['bits_per_elt_weights_total']:.1f}",
                                   bits_g=f"{rec['bits_per_elt_grads_total']:.1f}")
                    if skipped:
                        postfix["skipped"] = str(skipped)
                    if bar is not None:
                        bar.set_postfix(postfix, refresh=False)
                if bar is not None:
                    bar.update(1)

                # Checkpoint before evaluating: the evaluation's forward gathers advance the
                # direct-quantization version counters that the training step of step + 1
                # would otherwise advance, so a checkpoint taken after them would not resume
                # bit-identically.
                if (args.ckpt_every and step % args.ckpt_every == 0) or step == args.steps:
                    wire.collect(device)
                    meta = {"identity": identity, "wire": wire.as_dict(), "preset": args.preset,
                            "torch_version": torch.__version__, "nonfinite_skipped": skipped,
                            "train_loss": last_loss}
                    save_checkpoint(args.out, step, model, optimizer, handle, meta,
                                    keep=args.keep_checkpoints)
                if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
                    last_val = _evaluate(model, ds, args, rank, world, device)
                    writer.write({"step": step, "val_loss": last_val})
                    postfix["val"] = f"{last_val:.3f}"
                    if bar is not None:
                        bar.set_postfix(postfix, refresh=False)
            if start_step >= args.steps:
                # A restart after the final checkpoint: only the final evaluation is left.
                last_val = _evaluate(model, ds, args, rank, world, device)
                if rank == 0 and not any(r.get("step") == args.steps and "val_loss" in r
                                         for r in read_metrics(args.out)):
                    writer.write({"step": args.steps, "val_loss": last_val})
        except RuntimeError as e:
            if isinstance(e, (NonFiniteGradientError, PeerError)) or "timed out" not in str(e).lower():
                raise
            raise CollectiveTimeoutError(
                f"step {step}: a collective waited longer than "
                f"the timeout ({args.timeout_s:g} s, --timeout): a peer stopped answering or is far "
                f"behind ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
        finally:
            if bar is not None:
                bar.close()
            writer.close()

        wire.collect(device)
        weights_sha, optim_sha = _state_digests(model, optimizer)
        summary = {
            "config": handle.config.to_dict(),
            "preset": args.preset,
            "args": dataclasses.asdict(args),
            "final_val_loss": last_val,
            "final_train_loss": last_loss,
            "wire": wire.as_dict(),
            "wire_bytes_total": wire.total_bytes(),
            "steps": args.steps,
            "start_step": start_step,
            "restarts": restart_count(),
            "nonfinite_skipped": skipped,
            "final_weights_sha256": weights_sha,
            "final_optimizer_sha256": optim_sha,
            "wall_time_s": time.perf_counter() - t_start,
            "median_step_time_s": statistics.median(step_times) if step_times else None,
            "tokens_per_step": tokens_per_step,
            "world_size": world,
            "local_world_size": handle.topology.ranks_per_node,
            "nodes": handle.topology.nodes,
            "n_params": count_params(model),
            "param_dtype": dtype_name,
            "vocab_size": ds.vocab_size,
            "data_id": data_id,
            "torch_version": torch.__version__,
            "qsdp_version": qsdp.__version__,
            "device": _device_name(device),
            "backend": str(dist.get_backend()),
        }
        if rank == 0:
            write_summary(args.out, json.loads(json.dumps(summary, default=str)))
        return summary


def _latest_name(out: str) -> str:
    try:
        path = latest_checkpoint(out)
    except CheckpointError:
        path = None
    return path.name if path is not None else "none"


def _state_digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, str]:
    """SHA-256 of the model parameters and of the optimizer state (collective): each rank
    hashes its local shards in a fixed order, rank 0's to the last rank's digests are hashed
    together. Equal for two runs of the same world size iff their states are bit-identical."""
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> torch.Tensor:
        t = t.to_local() if isinstance(t, DTensor) else torch.as_tensor(t)
        return t.detach().contiguous().cpu()

    def update(h: Any, name: str, t: Any) -> None:
        t = local(t)
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")

    hw, ho = hashlib.sha256(), hashlib.sha256()
    for name, p in model.named_parameters():
        update(hw, name, p)
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            update(ho, f"{name}.{key}", value)
    mine = [hw.hexdigest(), ho.hexdigest()]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return tuple(hashlib.sha256("".join(d[i] for d in everyone).encode()).hexdigest()
                 for i in range(2))  # type: ignore[return-value]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads/rank)"
