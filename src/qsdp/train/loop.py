"""The training job of one worker process: ``train_worker(args)``.

It runs inside an initialized process group, or initializes one from the environment
``torchrun`` sets (:mod:`qsdp.train.runtime`), runs the pre-flight (:mod:`qsdp.train.preflight`)
where the launcher's answer may have changed, prepares the data once, and hands over to a
:class:`qsdp.train.trainer.Trainer`. The pieces live by concern:

- :mod:`qsdp.train.args`: ``TrainArgs``, validation, the learning-rate schedule, the errors;
- :mod:`qsdp.train.preflight`: the plan (config, resume point, data identity);
- :mod:`qsdp.train.faults`: test-only fault injection;
- :mod:`qsdp.train.trainer`: the steps, logging, checkpoints, evaluation and the summary;
- :mod:`qsdp.train.metrics`: the metrics schema and writer.

Their public names are re-exported here: ``qsdp.train.loop`` stays the entry point.
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from qsdp import progress
from qsdp.config import QuantConfig

from qsdp.train.args import (
    ON_NONFINITE,
    USER_ERRORS,
    CollectiveTimeoutError,
    NonFiniteGradientError,
    PeerError,
    TrainArgs,
    TrainError,
    lr_at,
    validate_args,
)
from qsdp.train.data import TokenDataset
from qsdp.train.metrics import WireTotals, write_summary
from qsdp.train.preflight import (
    Plan,
    check_out_dir,
    check_resume,
    default_cache_dir,
    hsdp_layout,
    open_dataset,
    preflight,
    prepare_dataset,
    record_job,
    rejoins_job,
    restart_count,
)
from qsdp.train.runlock import RunLockError, acquire, release
from qsdp.train.runtime import init_process_group, rank0_first, run_device
from qsdp.train.trainer import Trainer

__all__ = [
    "TrainArgs", "TrainError", "PeerError", "NonFiniteGradientError", "CollectiveTimeoutError",
    "USER_ERRORS", "ON_NONFINITE", "train_worker", "validate_args", "check_out_dir", "check_resume",
    "prepare_dataset", "lr_at", "default_cache_dir", "restart_count", "WireTotals", "Plan",
]


def _worker_plan(args: TrainArgs, plan: Plan | None, config: QuantConfig, rank: int,
                 world: int) -> tuple[TokenDataset, Plan]:
    """The dataset and the plan of this worker. A launcher's plan (with a data identity, for
    this world, first attempt) is taken as it is, and the data read from the caches the
    launcher built; otherwise rank 0 prepares the data first and the checks run here."""
    if plan is not None and plan.data_id is not None and plan.world_size == world and restart_count() == 0:
        return open_dataset(args), plan
    # Rank 0 prepares (checks the text, builds the caches, fingerprints it); the others read
    # the caches and take rank 0's fingerprint.
    dataset, data_id = rank0_first(lambda: prepare_dataset(args), rank,
                                   others=lambda: (open_dataset(args), None))
    shared = [data_id]
    dist.broadcast_object_list(shared, src=0)
    return dataset, preflight(args, world, shared[0], config)


def train_worker(args: TrainArgs, plan: Plan | None = None) -> dict[str, Any]:
    """Run the training job on this rank; returns the run summary (the same on every rank).

    ``plan``: the launcher's :func:`~qsdp.train.preflight.preflight` (``None``: run it here).
    Uses the initialized default process group, or initializes one from the torchrun
    environment (and destroys it at the end).
    """
    config = plan.config if plan is not None else validate_args(args)
    owns_group = not dist.is_initialized()
    if owns_group:
        init_process_group(args)
    locked = False
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.hsdp:  # a layout that cannot be HSDP fails on every rank before any collective
            hsdp_layout(args, config, world, resuming=args.resume or restart_count() > 0 or rejoins_job(args.out))
        progress.mark("data and plan")
        dataset, plan = _worker_plan(args, plan, config, rank, world)
        args = plan.run_args(args)  # a resume on another number of ranks: the global batch kept
        locked = _lock_run_directory(args.out, rank)
        dist.barrier()  # every rank has checked the run directory before rank 0 writes to it
        if rank == 0:
            record_job(args.out)
        progress.mark("building, sharding and loading the model")
        summary = Trainer(args, plan, dataset, run_device(args, owns_group)).fit()
        progress.mark("summary")
        if rank == 0:
            write_summary(args.out, json.loads(json.dumps(summary, default=str)))
        return summary
    finally:
        if locked:
            release(args.out)
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _lock_run_directory(out: str, rank: int) -> bool:
    """Rank 0 takes the run directory's lock (:mod:`qsdp.train.runlock`) before anything is
    written there; a directory another live run holds is refused on every rank at once (rank 0's
    answer is broadcast). Returns whether this rank holds the lock."""
    refusal = [None]
    if rank == 0:
        try:
            acquire(out)
        except RunLockError as e:
            refusal = [str(e)]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise TrainError(refusal[0])
    return rank == 0
