"""Resuming on another layout: another number of ranks, of nodes, or of HSDP replicas.

What a checkpoint's run identity may differ in across a resume (:data:`LAYOUT_FIELDS`): the
world size, the ranks per node (``config.local_world_size``), and the per-rank batch and global
batch that follow from them. Everything else (model, config, data, seed, sequence length) must
be equal, as :mod:`qsdp.train.preflight` checks.

The global batch (sequences per optimizer step, over all ranks) is kept by default, on any
number of ranks (:class:`BatchSplit`):

- the ranks draw it in consecutive shares that differ by at most one sequence (32 on 3 ranks:
  11, 11, 10), and each rank's loss is weighted so that the gradient is the mean over the
  global batch;
- no rank's micro-batch grows beyond the per-rank batch the run was started with (its
  ``--batch-size``): a rank with more to draw accumulates gradients over several micro-batches
  (2 nodes -> 1: the same micro-batch, twice);
- a global batch smaller than the number of ranks fits nothing: a launch refuses it in one
  line (:func:`resume_batch`), before any worker starts and so before any restart loop. A job
  that already ran in the run directory never refuses its batch at a restart (that refusal would
  repeat at every one of the agent's restarts): a rank left without a sequence computes on a
  stand-in weighted 0.

``--new-global-batch`` takes ``--batch-size`` per rank as given instead. Either way the data
stream continues from the samples already consumed (``samples`` in ``trainer.json``; sample
``k`` depends on the seed and ``k`` alone, :meth:`qsdp.train.data.TokenDataset.samples`).

The model and optimizer state are resharded by DCP; how the comm state follows (exact replicas,
counters past every one used before) is :func:`qsdp.train.checkpoint.load_checkpoint`'s part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qsdp.train.args import TrainArgs, TrainError

__all__ = ["LAYOUT_FIELDS", "RESUMABLE_CHANGES", "BatchSplit", "split_batch", "global_batch",
           "samples_consumed", "resume_batch"]

# Identity fields (flattened) that a resume may change; the global batch is handled apart.
LAYOUT_FIELDS = frozenset({"world_size", "config.local_world_size", "batch_size", "global_batch"})
RESUMABLE_CHANGES = ("the number of ranks (--nproc or torchrun's), the ranks per node (--local-world-size) "
                     "and, with --new-global-batch, the global batch")


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's global batch is drawn by the ranks.

    Rank ``r`` draws ``counts[r]`` consecutive samples of the step's global batch, after those of
    the lower ranks (:meth:`offset`), in ``accumulation`` micro-batches (:meth:`micro_sizes`) of
    at most ``micro_batch`` sequences each. Every rank runs the same number of micro-batches:
    FSDP2's gathers in the forward are collective.
    """

    global_batch: int
    micro_batch: int
    counts: tuple[int, ...]
    accumulation: int

    @property
    def world(self) -> int:
        return len(self.counts)

    @property
    def uniform(self) -> bool:
        """Every rank draws the same share in one micro-batch: the plain data-parallel step."""
        return self.accumulation == 1 and len(set(self.counts)) == 1

    def offset(self, rank: int) -> int:
        """Where rank ``rank``'s share starts within the step's global batch."""
        return sum(self.counts[:rank])

    def micro_sizes(self, rank: int) -> tuple[int, ...]:
        """Rank ``rank``'s micro-batch sizes, ``accumulation`` of them, as even as can be; a 0 is
        a micro-batch with nothing to draw (more micro-batches than sequences)."""
        count, steps = self.counts[rank], self.accumulation
        return tuple(count // steps + (1 if m < count % steps else 0) for m in range(steps))

    def weight(self, count: int) -> float:
        """The factor on the mean loss of a micro-batch of ``count`` sequences: ``count * world /
        global_batch``. FSDP2's reduce-scatter averages the ranks' gradients, so the weighted sum
        over every micro-batch of every rank is the gradient of the mean over the global batch.
        1.0 for the plain data-parallel step."""
        return count * self.world / self.global_batch

    def idle_ranks(self) -> int:
        """How many ranks draw no sequence (a global batch smaller than the world)."""
        return sum(1 for c in self.counts if c == 0)

    def describe(self) -> str:
        """One phrase: the global batch, the ranks' shares and the micro-batches."""
        shares = sorted(set(self.counts), reverse=True)
        per_rank = " or ".join(str(s) for s in shares)
        text = f"global batch {self.global_batch} as {per_rank} sequences per rank"
        if self.accumulation > 1:
            text += f" in {self.accumulation} micro-batches of at most {self.micro_batch}"
        return text


def split_batch(global_batch: int, world: int, micro_batch: int) -> BatchSplit:
    """Split ``global_batch`` sequences over ``world`` ranks with micro-batches of at most
    ``micro_batch``: the first ``global_batch % world`` ranks draw one sequence more than the
    others, and every rank accumulates over as many micro-batches as the largest share needs."""
    if global_batch < 1 or world < 1 or micro_batch < 1:
        raise ValueError(f"need a positive global batch, world and micro-batch, got {global_batch}, "
                         f"{world}, {micro_batch}")
    base, extra = divmod(global_batch, world)
    counts = tuple(base + (1 if r < extra else 0) for r in range(world))
    return BatchSplit(global_batch, micro_batch, counts, max(1, -(-counts[0] // micro_batch)))


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


def resume_batch(args: TrainArgs, world_size: int, meta: dict[str, Any], path: Any,
                 running: bool = False) -> tuple[int, int]:
    """``(global batch, micro-batch bound)`` of this run resuming the checkpoint in ``path``
    (``meta``: its ``trainer.json``) on ``world_size`` ranks: the checkpoint's global batch and
    per-rank batch, or, with ``args.new_global_batch``, ``args.batch_size`` per rank.

    ``running``: the job that trained in the run directory restarts (it never refuses its
    batch); otherwise a global batch smaller than ``world_size`` is a TrainError naming the
    ranks it could run on."""
    identity = meta.get("identity", {})
    if args.new_global_batch or "batch_size" not in identity:
        return args.batch_size * world_size, args.batch_size
    total, micro = global_batch(identity), int(identity["batch_size"])
    if total < world_size and not running:
        raise TrainError(
            f"--resume: checkpoint {path} trained with a global batch of {total} sequences, fewer than "
            f"the {world_size} ranks (each needs at least one); resume on at most {total} ranks, or pass "
            f"--new-global-batch to go on with --batch-size {args.batch_size} per rank "
            f"({args.batch_size * world_size} a step)")
    return total, micro
