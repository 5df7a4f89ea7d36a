"""Pre-flight: every check a run needs before it starts, done once, and the plan it yields.

:func:`preflight` takes the arguments and the world size and returns a :class:`Plan`: the built
:class:`qsdp.QuantConfig`, the checkpoint to resume from (if any) and the identity of the data.
The command line calls it before launching workers; each worker calls it again only where the
answer can have changed (a restarted attempt, or a launch under ``torchrun`` that had no data
identity yet), and passes the plan's config to :func:`qsdp.quantize_comms`.

A run is *resumable* from a checkpoint whose identity (model, tokenizer, sequence length, seed,
config and data) equals this run's, apart from the layout: the number of ranks, the ranks per
node and the per-rank batch may change (:mod:`qsdp.train.elastic`; the global batch is kept
unless ``--new-global-batch``, split over any number of ranks). Fields only one side knows are
not compared, so a config field added since the checkpoint is not a change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qsdp.config import AUTO_PIPELINE_SLICES, QuantConfig
from qsdp.extras import require
from qsdp.hsdp import quantizes_only_replicas
from qsdp.launch import under_torchrun
from qsdp.train.args import TrainArgs, TrainError, validate_args
from qsdp.train.checkpoint import latest_checkpoint, named_checkpoint, read_meta
from qsdp.train.data import TokenDataset, get_tokenizer, load_corpus, require_default_corpus
from qsdp.train.elastic import LAYOUT_FIELDS, RESUMABLE_CHANGES, BatchSplit, resume_batch, split_batch
from qsdp.train.files import atomic_write
from qsdp.train.metrics import METRICS_FILE, SUMMARY_FILE
from qsdp.train.runlock import holder_refusal

__all__ = [
    "Plan", "preflight", "require_packages", "prepare_dataset", "open_dataset", "check_out_dir", "check_resume",
    "run_identity", "restart_count", "torchrun_job", "rejoins_job", "record_job", "default_cache_dir", "hsdp_layout",
]


@dataclass(frozen=True)
class Plan:
    """What the checks decided. ``resume_from``: the checkpoint directory to load (``None``: a
    fresh start). ``data_id``: a fingerprint of the text and the tokenizer (``None`` until the
    dataset was prepared). ``restarted``: this is a restart by torch's elastic agent (or a
    node that joined the same torchrun job after one, see :func:`rejoins_job`). ``batch_size``:
    the per-rank batch of a resume, the bound on every rank's micro-batch (``None``: the
    arguments' own); ``global_batch``: the sequences per step of a resume, which it keeps on any
    number of ranks (``None``: the per-rank batch times the ranks)."""

    config: QuantConfig
    world_size: int
    data_id: str | None = None
    resume_from: Path | None = None
    restarted: bool = False
    batch_size: int | None = None
    global_batch: int | None = None

    def run_args(self, args: TrainArgs) -> TrainArgs:
        """``args`` with the plan's per-rank batch: what the workers train with."""
        if self.batch_size is None or self.batch_size == args.batch_size:
            return args
        return dataclasses.replace(args, batch_size=self.batch_size)

    def batch_split(self, args: TrainArgs) -> BatchSplit:
        """How each step's global batch is drawn by this plan's ranks (``args``: the run's,
        :meth:`run_args`)."""
        total = self.global_batch if self.global_batch is not None else args.batch_size * self.world_size
        return split_batch(total, self.world_size, args.batch_size)

    def identity(self, args: TrainArgs) -> dict[str, Any]:
        """What must be equal for a checkpoint to be resumed by this run (stored in it)."""
        return run_identity(args, self.world_size, self.data_id, self.config, self.global_batch)


def restart_count() -> int:
    """How many times torch's elastic agent has restarted this worker group (0: first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


JOB_FILE = "torchrun_job"


def torchrun_job() -> str | None:
    """The ``--rdzv-id`` of the torchrun job this worker belongs to; ``None`` outside torchrun
    or for torchrun's default id ``none``, which names no job."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return job if job and job != "none" else None


def rejoins_job(out: str) -> bool:
    """Whether the run in ``out`` was started by this worker's torchrun job. The restart count
    is per agent: a node brought in to replace a failed one starts at 0 while the survivors'
    agents count a restart, yet all of them must resume from the same checkpoint."""
    job = torchrun_job()
    if job is None:
        return False
    try:
        return (Path(out) / JOB_FILE).read_text(encoding="utf-8").strip() == job
    except OSError:
        return False


def record_job(out: str) -> None:
    """Rank 0, once every rank has checked the run directory: note the torchrun job that runs
    in ``out`` (nothing outside a named torchrun job)."""
    job = torchrun_job()
    if job is not None and not rejoins_job(out):
        atomic_write(Path(out) / JOB_FILE, lambda f: f.write(job.encode("utf-8")))


def require_packages(args: TrainArgs) -> None:
    """Raise :class:`qsdp.extras.MissingExtraError` (one line naming ``qsdp[train]``) when the
    run needs an optional package that is not installed: the embedded corpus (no ``--data``),
    the BPE tokenizer, the progress bar."""
    if args.data is None:
        require_default_corpus()
    if args.tokenizer == "bpe":
        require("tokenizers", "--tokenizer bpe", "or use --tokenizer byte")
    if args.progress:
        require_progress_bar()


def require_progress_bar() -> None:
    """Raise :class:`qsdp.extras.MissingExtraError` where tqdm (``qsdp[train]``) is not installed."""
    require("tqdm", "the progress bar", "or pass --no-progress")


def default_cache_dir() -> str:
    return os.environ.get("QSDP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qsdp")


def _usable_cache_dir(args: TrainArgs) -> str | None:
    path = args.cache_dir or default_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # no cache: every rank encodes the text itself
    return path if os.access(path, os.W_OK) else None


def open_dataset(args: TrainArgs) -> TokenDataset:
    """The run's dataset, read from the token and tokenizer caches when they are there."""
    text = load_corpus(args.data)
    cache = _usable_cache_dir(args)
    tokenizer = get_tokenizer(args.tokenizer, text, cache)
    return TokenDataset.from_text(text, tokenizer, cache_dir=cache, seed=args.seed)


def prepare_dataset(args: TrainArgs) -> tuple[TokenDataset, str]:
    """The dataset of a run (building the token and tokenizer caches if missing) and a
    fingerprint of its text and tokenizer. Raises DataError if the text is missing, unreadable
    or too short for ``seq_len``."""
    text = load_corpus(args.data)
    cache = _usable_cache_dir(args)
    tokenizer = get_tokenizer(args.tokenizer, text, cache)
    dataset = TokenDataset.from_text(text, tokenizer, cache_dir=cache, seed=args.seed)
    # Both splits must hold a window of seq_len + 1 tokens (raises DataError naming the split).
    dataset.batch(0, 0, 1, 1, args.seq_len)
    next(dataset.val_batches(1, 1, args.seq_len))
    digest = hashlib.sha256(tokenizer.fingerprint.encode() + b"\0")
    digest.update(text.encode("utf-8"))
    return dataset, digest.hexdigest()[:16]


def check_run_paths(args: TrainArgs) -> None:
    """What the run writes under ``--out`` must be able to go there: ``checkpoints`` a directory
    (or absent), the metrics and the summary files (or absent). Found at start-up, not when the
    first checkpoint or the summary is written after training."""
    out = Path(args.out)
    for name, directory in (("checkpoints", True), (METRICS_FILE, False), (SUMMARY_FILE, False)):
        path = out / name
        if path.exists() and path.is_dir() != directory:
            kind, wanted = ("a file", "its checkpoints directory") if directory else ("a directory", "a file")
            raise TrainError(f"--out {args.out}: {name} is {kind}, where the run writes {wanted}; move it away "
                             "or choose another --out")


def check_out_dir(args: TrainArgs) -> None:
    """A fresh run needs a run directory without a previous run's metrics or checkpoints."""
    if args.resume:
        return
    out = Path(args.out)
    # A checkpoint without `latest` is a run too: a fresh run's rotation would remove it.
    steps = sorted(f"checkpoints/{p.name}" for p in (out / "checkpoints").glob("step_*")
                   if p.is_dir() and p.name[5:].isdigit())
    for name in (METRICS_FILE, "checkpoints/latest", *steps[-1:]):
        if (out / name).exists():
            raise TrainError(
                f"--out {args.out} already holds a run ({name}); pass --resume to continue it "
                "or choose another --out"
            )


def run_identity(args: TrainArgs, world_size: int, data_id: str | None,
                 config: QuantConfig | None = None, global_batch: int | None = None) -> dict[str, Any]:
    """What must be equal for a checkpoint to be resumed by this run. ``global_batch``: the
    run's sequences per step where it is not ``args.batch_size`` per rank (a resume)."""
    config = config if config is not None else validate_args(args)
    total = global_batch if global_batch is not None else args.batch_size * world_size
    identity: dict[str, Any] = {
        "model": args.model, "tokenizer": args.tokenizer, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "global_batch": total, "seed": args.seed,
        "world_size": world_size, "config": config.to_dict(), "hsdp": args.hsdp,
    }
    if data_id is not None:
        identity["data_id"] = data_id
    return identity


def hsdp_layout(args: TrainArgs, config: QuantConfig, world_size: int,
                resuming: bool = False) -> tuple[int, int] | None:
    """``(nodes, ranks_per_node)`` of an ``--hsdp`` run of ``world_size`` ranks: ranks per node
    from ``--local-world-size`` (folded into ``config``), else as the launcher states them
    (``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE``); ``None`` where nothing states them before
    the process group exists (the hosts decide then, and the trainer checks them). TrainError
    unless they make whole nodes, at least 2 of them for a fresh run; ``resuming``: one node, a
    single replica, continues an HSDP run that lost its other nodes."""
    from qsdp.comm.topology import stated_ranks_per_node

    # What the workers will see: under torchrun its statement; the local workers qsdp starts are
    # one node of world_size ranks (their LOCAL_WORLD_SIZE), whatever the launching shell says.
    stated = stated_ranks_per_node() if under_torchrun() else [("LOCAL_WORLD_SIZE", world_size)]
    per_node = config.local_world_size or (stated[0][1] if stated else None)
    if per_node is None:
        return None
    source = "--local-world-size" if config.local_world_size else "=".join(map(str, stated[0]))
    if world_size % per_node:
        raise TrainError(f"--hsdp: {per_node} ranks per node ({source}) must divide the "
                         f"world size {world_size}")
    nodes = world_size // per_node
    if nodes < 2 and not resuming:
        raise TrainError(
            f"--hsdp needs at least 2 nodes to replicate across, but {world_size} rank(s) at {per_node} "
            f"per node make {nodes}; pass --local-world-size M (ranks per node) with M < {world_size} "
            "dividing it, or drop --hsdp")
    return nodes, per_node


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _same(key: str, theirs: Any, mine: Any) -> bool:
    """Whether an identity field is the same run's. ``grads.pipeline_slices`` ``"auto"`` rounds
    as 8 slices do (only their exchanges are grouped differently): a checkpoint written with 8
    resumes under ``"auto"`` (sdp4bit's value since) and back. ``grads.pipeline_min_bytes`` only
    groups slices into exchanges: any value resumes any other."""
    if key == "config.grads.pipeline_min_bytes":
        return True
    if key == "config.grads.pipeline_slices":
        theirs, mine = (AUTO_PIPELINE_SLICES if v == "auto" else v for v in (theirs, mine))
    return theirs == mine


def _check_identity(path: Path, meta: dict[str, Any], mine: dict[str, Any]) -> None:
    """TrainError naming every field of the identity that differs, the layout's apart."""
    theirs = _flatten(meta.get("identity", {}))
    diffs = [f"{key}: checkpoint {theirs[key]!r} != now {value!r}"
             for key, value in _flatten(mine).items()
             if key in theirs and key not in LAYOUT_FIELDS and not _same(key, theirs[key], value)]
    if diffs:
        raise TrainError(f"--resume: checkpoint {path} was written by a different run: " + "; ".join(diffs)
                         + f" (a resume may change only {RESUMABLE_CHANGES})")


def check_resume(args: TrainArgs, world_size: int, data_id: str | None = None,
                 config: QuantConfig | None = None) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``--resume`` continues from (``--resume-from``'s, else ``latest``) and its
    ``trainer.json``; TrainError if there is none, if it was written by a different run, or if it
    is already at ``--steps`` (CheckpointError if it is incomplete)."""
    path = named_checkpoint(args.out, args.resume_from) if args.resume_from else latest_checkpoint(args.out)
    if path is None:
        raise TrainError(f"--resume: no checkpoint in {os.path.join(args.out, 'checkpoints')} "
                         "(checkpoints/latest is missing)")
    meta = read_meta(path)
    _check_identity(path, meta, run_identity(args, world_size, data_id, config))
    if int(meta["step"]) >= args.steps:
        raise TrainError(f"--resume: checkpoint {path.name} is already at step {meta['step']} >= "
                         f"--steps {args.steps}; pass a larger --steps to train further")
    return path, meta


def _restart_checkpoint(args: TrainArgs, world_size: int, data_id: str | None,
                        config: QuantConfig) -> Path | None:
    """The checkpoint a restarted attempt resumes from: ``latest`` if this run wrote one (the
    identity is checked as for ``--resume``; it may already be at ``--steps`` if the crash came
    after the final save), else ``None`` (start afresh)."""
    path = latest_checkpoint(args.out)
    if path is not None:
        _check_identity(path, read_meta(path), run_identity(args, world_size, data_id, config))
    return path


def preflight(args: TrainArgs, world_size: int, data_id: str | None = None,
              config: QuantConfig | None = None) -> Plan:
    """Check the arguments, the run directory and the resume point for a world of
    ``world_size`` ranks; returns the plan. ``config``: an already built config of these
    arguments (skips building it again). Raises TrainError / ConfigError / CheckpointError
    naming the problem; touches no process group."""
    if config is None:
        config = validate_args(args)
    check_run_paths(args)
    # The launcher refuses a directory another live run holds before any worker starts; under
    # torchrun, rank 0 alone decides (train_worker), so that every rank refuses together.
    refusal = None if under_torchrun() else holder_refusal(args.out)
    if refusal is not None:
        raise TrainError(refusal)
    restarted = restart_count() > 0 or rejoins_job(args.out)
    if args.hsdp:
        hsdp_layout(args, config, world_size, resuming=args.resume or restarted)
    elif quantizes_only_replicas(config):
        raise TrainError(f"--preset {config.name} quantizes only the gradient all-reduce across HSDP "
                         "replicas: add --hsdp (without it the run is plain FSDP at full precision)")
    resume_from = None
    if restarted:  # the elastic agent restarted the group: continue from the last good checkpoint
        resume_from = _restart_checkpoint(args, world_size, data_id, config)
    elif args.resume:
        resume_from, _ = check_resume(args, world_size, data_id, config)
    else:
        check_out_dir(args)
    total = batch_size = None
    if resume_from is not None:
        # A job that already ran here restarts on whatever nodes it has left: refusing its batch
        # would only repeat at every restart. A launch refuses it once, before any worker starts.
        total, batch_size = resume_batch(args, world_size, read_meta(resume_from), resume_from,
                                         running=rejoins_job(args.out))
    return Plan(config=config, world_size=world_size, data_id=data_id, resume_from=resume_from,
                restarted=restarted, batch_size=batch_size, global_batch=total)
