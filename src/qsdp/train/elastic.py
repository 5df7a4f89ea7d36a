"""Resuming a run on another layout: another number of ranks, of nodes, or of HSDP replicas.

What a checkpoint's run identity may differ in across a resume (:data:`LAYOUT_FIELDS`): the
world size, the ranks per node (``config.local_world_size``) and the per-rank batch size that
follows from them. Everything else (model, config, data, seed, sequence length) must be equal,
as :mod:`qsdp.train.preflight` checks.

The global batch (sequences per optimizer step, over all ranks) is kept by default: the per-rank
batch becomes the checkpoint's global batch divided by the new number of ranks, and a number of
ranks that does not divide it is refused. ``--new-global-batch`` takes ``--batch-size`` per rank
as given instead. Either way the data stream continues from the samples already consumed
(``samples`` in ``trainer.json``, see :meth:`qsdp.train.data.TokenDataset.stream_batch`).

The model and optimizer state are resharded by DCP; how the comm state follows (exact replicas,
counters past every one used before) is :func:`qsdp.train.checkpoint.load_checkpoint`'s part.
"""

from __future__ import annotations

from typing import Any

from qsdp.train.args import TrainArgs, TrainError

__all__ = ["LAYOUT_FIELDS", "RESUMABLE_CHANGES", "global_batch", "samples_consumed", "resume_batch_size"]

# Identity fields (flattened) that a resume may change; ``global_batch`` is checked apart.
LAYOUT_FIELDS = frozenset({"world_size", "config.local_world_size", "batch_size", "global_batch"})
RESUMABLE_CHANGES = ("the number of ranks (--nproc or torchrun's), the ranks per node (--local-world-size) "
                     "and, with --new-global-batch, the global batch")


def global_batch(identity: dict[str, Any]) -> int:
    """Sequences per optimizer step of the run whose (nested) identity this is."""
    if "global_batch" in identity:
        return int(identity["global_batch"])
    return int(identity["batch_size"]) * int(identity["world_size"])


def samples_consumed(meta: dict[str, Any]) -> int:
    """How many samples of the data stream the checkpoint's run had drawn (``trainer.json``);
    a checkpoint that does not say drew one global batch a step."""
    if "samples" in meta:
        return int(meta["samples"])
    return int(meta["step"]) * global_batch(meta.get("identity", {}))


def resume_batch_size(args: TrainArgs, world_size: int, meta: dict[str, Any], path: Any) -> int:
    """The per-rank batch of this run resuming the checkpoint in ``path`` (``meta``: its
    ``trainer.json``) on ``world_size`` ranks: the checkpoint's global batch split over the
    ranks, or ``args.batch_size`` with ``args.new_global_batch``. TrainError when the global
    batch cannot be kept."""
    identity = meta.get("identity", {})
    if args.new_global_batch or "batch_size" not in identity:
        return args.batch_size
    total = global_batch(identity)
    if total % world_size:
        raise TrainError(
            f"--resume: checkpoint {path} trained with a global batch of {total} sequences, which "
            f"{world_size} ranks cannot split evenly; resume on a number of ranks that divides {total}, "
            f"or pass --new-global-batch to go on with --batch-size {args.batch_size} per rank "
            f"({args.batch_size * world_size} a step)")
    return total // world_size
