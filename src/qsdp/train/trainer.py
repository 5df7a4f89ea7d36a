"""The training job of one worker process, as a :class:`Trainer`: data, GPT, FSDP2 + qsdp
comms, AdamW, metrics, checkpoints.

Every rank runs the same code; rank 0 alone writes metrics, the summary and the progress bar.
Steps are counted from 1: the record of step ``s`` is written after ``s`` optimizer steps. Each
step takes the next global batch of the data stream (``TokenDataset.samples`` from the samples
consumed so far, :attr:`RunState.samples`), so a checkpoint of step ``s`` resumes exactly
(model, optimizer, comm state, RNG, and :meth:`Trainer.state_dict`; the learning rate is a
function of the step), and on another number of ranks continues the same stream with the same
global batch (:mod:`qsdp.train.elastic`): the ranks' shares may differ by one sequence, a share
larger than the run's per-rank batch is drawn in several micro-batches whose gradients
accumulate (FSDP2 synchronizes on the last), and each micro-batch's mean loss is weighted
(:meth:`qsdp.train.elastic.BatchSplit.weight`) so that the gradient is the mean over the global
batch. Per step, in this order: :meth:`~Trainer.train_step`, :meth:`~Trainer.log`,
:meth:`~Trainer.maybe_checkpoint`, :meth:`~Trainer.maybe_evaluate`.

One host sync per step. After ``backward`` one all-reduce (:func:`qsdp.check_gradients`),
read once, tells every rank whether any rank reduced a NaN or Inf gradient, the gradient norm
(clipping then needs no read of its own), the ranks' weighted losses summed, on logged steps the
bytes the meters counted, and the weight-difference gathers' agreement on which shards the
coming optimizer step changes (the next forward then agrees on nothing). The step time is the
host's, from the start of the step to the end of its optimizer step as queued: the next step's
sync waits for what the device still had to do, so the times add up to the run's; with
``sync_timing`` each step waits for the device at its end (one more sync) and times it alone.

Non-finite gradients (``on_nonfinite``). ``skip`` (the default): every rank drops the step's
gradients and does not step the optimizer, so weights, optimizer state (AdamW's step count
included) and the weight-difference replicas stay unchanged and identical on all ranks; the step
number still advances, i.e. the batch of that step is consumed and the learning-rate schedule, a
function of the step number, does not shift (the skipped step's learning rate is simply never
applied). ``raise``: the run stops with
:class:`NonFiniteGradientError` naming the step (weights not updated at that step).

Restarts. Under torch's elastic agent a restarted attempt resumes from ``OUT/checkpoints/latest``
when there is one (see :mod:`qsdp.train.preflight`). A resume first drops the records of
``metrics.jsonl`` after the checkpoint's step: they belong to the attempt that crashed.

``summary.json`` at the end (:meth:`Trainer.summary`) holds the config, the final losses, the
bytes by kind and level, timings, the environment, ``nonfinite_skipped`` and
``hsdp``, ``nodes`` and ``local_world_size`` (the layout), and
``final_weights_sha256`` / ``final_optimizer_sha256``: SHA-256 over every rank's digest of its
local shards (model parameters; optimizer state), in rank order. Two runs with the same world
size have equal hashes exactly when their final states are bit-identical.

HSDP (``--hsdp``): the model is sharded on FSDP2's native HSDP mesh (:func:`qsdp.hsdp_groups`:
each node's ranks its shard dimension, the nodes its replicate dimension), so every node holds a
full copy of the sharded state and :func:`qsdp.quantize_comms` replaces only FSDP2's all-reduce
across the nodes. Checkpoints need nothing more: DCP writes each shard once (the nodes' copies
are bit-identical) and every node reads it back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import sys
import time
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import qsdp
from qsdp.codecs.usage import implementations_run
from qsdp.train.args import (
    PARAM_DTYPES,
    CollectiveTimeoutError,
    NonFiniteGradientError,
    PeerError,
    TrainArgs,
    lr_at,
)
from qsdp.train.checkpoint import (
    CheckpointError,
    checkpoint_root,
    latest_checkpoint,
    load_checkpoint,
    make_latest,
    save_checkpoint,
)
from qsdp import progress
from qsdp.train.data import TokenDataset
from qsdp.train.elastic import samples_consumed
from qsdp.train.faults import Faults
from qsdp.train.metrics import MetricsWriter, WireTotals, drop_records_after, read_metrics, train_record
from qsdp.train.model import count_params, make_gpt, transformer_blocks
from qsdp.train.preflight import Plan, hsdp_layout, require_progress_bar, restart_count
from qsdp.train.runtime import device_name

__all__ = ["Trainer", "RunState", "StepResult"]


@dataclass
class RunState:
    """What a run has done so far; with the model, optimizer and comms, what a checkpoint keeps."""

    step: int = 0
    samples: int = 0  # of the data stream, consumed by the steps so far
    wire: WireTotals = field(default_factory=WireTotals)
    nonfinite_skipped: int = 0
    train_loss: float = float("nan")
    val_loss: float = float("nan")


@dataclass
class StepResult:
    """One optimizer step: the mean loss over the global batch, the learning rate, the gradient
    norm before clipping (``None`` on a skipped step) and the wall time."""

    loss: float
    lr: float
    grad_norm: float | None
    seconds: float


def build_model(args: TrainArgs, vocab_size: int, device: torch.device,
                mesh: Any = None) -> tuple[torch.nn.Module, str]:
    """The GPT, each block and the root wrapped by FSDP2 (on ``mesh``: the node's ranks under
    HSDP; ``None``: the world); returns it and its param dtype name."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = make_gpt(args.model, vocab_size, args.seq_len).to(device)
    dtype_name = args.param_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    param_dtype = PARAM_DTYPES[dtype_name]
    policy = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
              if param_dtype != torch.float32 else MixedPrecisionPolicy())
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=args.reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard_after_forward, mp_policy=policy)
    return model, dtype_name


def shard_and_quantize(
    args: TrainArgs, plan: Plan, vocab_size: int, device: torch.device,
) -> tuple[torch.nn.Module, str, qsdp.QuantizedComms, tuple[int, int] | None]:
    """The FSDP2 model and its qsdp comms; under ``--hsdp`` sharded inside each node and
    replicated across the nodes, whose ``(nodes, ranks_per_node)`` is returned last (``None``
    without HSDP)."""
    if not args.hsdp:
        model, dtype_name = build_model(args, vocab_size, device)
        return model, dtype_name, qsdp.quantize_comms(model, plan.config, guard=args.guard_every or None), None
    # The nodes are the hosts (or QSDP_NODE), however many torchrun agents each runs;
    # --local-world-size emulates nodes of consecutive ranks.
    groups = qsdp.hsdp_groups(ranks_per_node=plan.config.local_world_size, device_type=device.type)
    nodes, per_node = groups.nodes, groups.ranks_per_node
    hsdp_layout(args, dataclasses.replace(plan.config, local_world_size=per_node), nodes * per_node,
                resuming=plan.resume_from is not None)
    # FSDP2's native HSDP mesh: placements, state dict and checkpoints are FSDP2's own, and
    # quantize_comms replaces only its all-reduce across the replicas.
    model, dtype_name = build_model(args, vocab_size, device, groups.mesh)
    comms = qsdp.quantize_comms(model, plan.config, guard=args.guard_every or None)
    return model, dtype_name, comms, (nodes, per_node)


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The training job's AdamW (betas 0.9/0.95, eps 1e-8) over ``params``, with ``weight_decay``
    on the matrices only."""
    params = list(params)
    # No weight decay on biases, norms and other 1-D parameters (GPT-2 / nanoGPT practice).
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def make_optimizer(model: torch.nn.Module, args: TrainArgs) -> torch.optim.Optimizer:
    return adamw(model.parameters(), args.lr, args.weight_decay)


def clip_grads(model: torch.nn.Module, max_norm: float) -> float:
    """Global gradient norm (FSDP2 DTensor gradients), clipped to ``max_norm`` unless 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


def _local_bytes(tensor: Any) -> tuple[str, bytes]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else torch.as_tensor(tensor)
    local = local.detach().contiguous().cpu()
    header = f"{local.dtype}:{tuple(local.shape)}\0"
    return header, local.reshape(-1).view(torch.uint8).numpy().tobytes() if local.numel() else b""


def state_digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, str]:
    """SHA-256 of the model parameters and of the optimizer state (collective): each rank
    hashes its local shards in a fixed order, rank 0's to the last rank's digests are hashed
    together. Equal for two runs of the same world size iff their states are bit-identical."""
    weights, optim = hashlib.sha256(), hashlib.sha256()
    for name, param in model.named_parameters():
        header, data = _local_bytes(param)
        weights.update(f"{name}:{header}".encode() + data)
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            header, data = _local_bytes(value)
            optim.update(f"{name}.{key}:{header}".encode() + data)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [weights.hexdigest(), optim.hexdigest()])
    return tuple(hashlib.sha256("".join(d[i] for d in everyone).encode()).hexdigest()
                 for i in range(2))  # type: ignore[return-value]


def latest_name(out: str) -> str:
    """The name of the run's newest complete checkpoint, or ``none``."""
    try:
        path = latest_checkpoint(out)
    except CheckpointError:
        path = None
    return path.name if path is not None else "none"


class Trainer:
    """One rank's training run, in an initialized process group.

    ``__init__`` builds the model (FSDP2 + the plan's qsdp config), the optimizer and the
    metrics writer and resumes from ``plan.resume_from``; :meth:`fit` runs the steps left and
    returns :meth:`summary`. The run state lives in :attr:`state` (a :class:`RunState`).
    """

    def __init__(self, args: TrainArgs, plan: Plan, dataset: TokenDataset, device: torch.device) -> None:
        self.args, self.plan, self.dataset, self.device = args, plan, dataset, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.started = time.perf_counter()
        self.faults = Faults.from_env()
        self.model, self.dtype_name, self.comms, self.hsdp_layout = shard_and_quantize(
            args, plan, dataset.vocab_size, device)
        self.optimizer = make_optimizer(self.model, args)
        self.current_step = 0  # the step running (1-based), for the guard's records
        if self.comms.guard is not None:
            self.comms.guard.on_escalate.append(self._escalated)
        qsdp.comm_stats(reset=True)
        implementations_run(reset=True)  # the summary reports the codecs this run's steps used
        self.state = RunState()
        self.start_step = 0
        if plan.resume_from is not None:
            meta = load_checkpoint(plan.resume_from, self.model, self.optimizer, self.comms, device)
            self.load_state_dict(meta)
            self.start_step = self.state.step
            if self.rank == 0 and plan.resume_from.parent.resolve() == checkpoint_root(args.out).resolve():
                make_latest(plan.resume_from)  # --resume-from: a restart continues from it too
        self.skipped_at_start = self.state.nonfinite_skipped
        if self.rank == 0 and (plan.resume_from is not None or plan.restarted):
            drop_records_after(args.out, self.start_step)
        self.split = plan.batch_split(args)
        self.tokens_per_step = self.split.global_batch * args.seq_len
        if self.rank == 0 and self.split.idle_ranks():
            print(f"qsdp train: warning: {self.split.idle_ranks()} of the {self.world} ranks draw no sequence of "
                  f"the global batch of {self.split.global_batch}: each computes on a stand-in weighted 0 "
                  f"(pass --new-global-batch to resume with --batch-size per rank)", file=sys.stderr, flush=True)
        self.step_times: list[float] = []
        self.writer = MetricsWriter(args.out, enabled=self.rank == 0)
        self.bar = self._progress_bar()
        self.postfix: dict[str, str] = {}  # progress bar: loss, tokens/s, bits/element on the wire

    def _escalated(self, move: Any) -> None:
        """A metrics line for each move of the accuracy guard (``{"step", "guard": {...}}``)."""
        self.writer.write({"step": self.current_step, "guard": {
            "group": move.group, "name": move.name, "part": move.part, "from": move.before, "to": move.after,
            "ratio": move.ratio, "limit": move.limit}})

    def _progress_bar(self) -> Any:
        """rank 0's tqdm bar, or ``None`` (other ranks, ``--no-progress``)."""
        if self.rank != 0 or not self.args.progress:
            return None
        require_progress_bar()
        from tqdm import tqdm  # an optional package (qsdp[train]): loaded only for the bar

        return tqdm(total=self.args.steps, initial=self.start_step, desc=self.comms.config.name,
                    unit="step", dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 5.0)

    def state_dict(self) -> dict[str, Any]:
        """The run state a checkpoint stores beside the model (``trainer.json``, JSON-able);
        the step is added by the checkpoint itself."""
        return {"identity": self.plan.identity(self.args), "samples": self.state.samples,
                "wire": self.state.wire.as_dict(),
                "preset": self.args.preset, "torch_version": torch.__version__,
                "nonfinite_skipped": self.state.nonfinite_skipped, "train_loss": self.state.train_loss}

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        """Restore the run state from a checkpoint's ``trainer.json``."""
        self.state = RunState(step=int(meta["step"]), samples=samples_consumed(meta),
                              wire=WireTotals(meta.get("wire")),
                              nonfinite_skipped=int(meta.get("nonfinite_skipped", 0)),
                              train_loss=float(meta.get("train_loss", float("nan"))))

    def train_step(self, step: int) -> StepResult:
        """Forward, backward and (unless some rank's gradient is not finite) the optimizer
        step of the 1-based step ``step``."""
        args, started = self.args, time.perf_counter()
        self.current_step = step
        progress.mark(f"step {step}")
        self.faults.hold(step, self.rank)
        self.faults.stall(step, self.rank)
        lr = lr_at(step - 1, args)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self.forward_backward(step)
        progress.mark(f"step {step}: gradient check and optimizer step")
        self.state.samples += self.split.global_batch  # consumed even by a skipped step
        self.faults.kill(step, self.rank)
        logged = self.logs(step)
        params = [p for p in self.model.parameters() if p.grad is not None]
        wire = self.state.wire.local_counts() if logged else []
        # Collective, the same answer on every rank; the step's one host sync.
        check = qsdp.check_gradients(self.comms, params, sums=[loss.detach(), *wire], agree_ahead=True)
        if logged:
            self.state.wire.add(check.sums[1:])
        grad_norm: float | None = None
        if check.nonfinite:
            self.optimizer.zero_grad(set_to_none=True)
            if args.on_nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"non-finite gradient (NaN/Inf) at step {step} (--on-nonfinite raise); "
                    f"the weights were not updated at step {step}, the last checkpoint is "
                    f"{latest_name(args.out)}")
            self.state.nonfinite_skipped += 1
        else:
            grad_norm = check.grad_norm
            if args.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, args.grad_clip, check.norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if args.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # asked for: the step time is the GPU's
        self.state.step = step
        seconds = time.perf_counter() - started
        self.step_times.append(seconds)
        return StepResult(check.sums[0] / self.world, lr, grad_norm, seconds)

    def forward_backward(self, step: int) -> torch.Tensor:
        """This rank's share of the step's global batch, forward and backward, micro-batch by
        micro-batch (:attr:`split`); the gradients are those of the mean loss over the global
        batch once FSDP2 has averaged them over the ranks. Returns the rank's weighted loss
        (a 0-d tensor: the ranks' sum, divided by the world size, is the global batch's mean)."""
        split, seq_len = self.split, self.args.seq_len
        sizes = split.micro_sizes(self.rank)
        start = self.state.samples + split.offset(self.rank)
        losses: list[torch.Tensor] = []
        for m, count in enumerate(sizes):
            last = m == len(sizes) - 1
            if len(sizes) > 1:  # reduce-scatter the accumulated gradients once, on the last
                self.model.set_requires_gradient_sync(last)
            # A micro-batch with nothing to draw still runs: FSDP2's gathers are collective. It
            # computes on the next sample of the stream, weighted 0.
            inputs, targets = self.dataset.samples(start, max(count, 1), seq_len)
            start += count
            _, loss = self.model(inputs.to(self.device, non_blocking=True),
                                 targets.to(self.device, non_blocking=True))
            # By sequences, which is by tokens: every target of the stream counts (ids are in
            # [0, vocab), never the loss's ignore_index -1, and no sample is padded).
            weight = split.weight(count)
            if weight != 1.0:
                loss = loss * weight
            losses.append(loss.detach())  # the loss logged: an injected NaN reaches the gradient alone
            (loss * float("nan") if last and self.faults.nan(step, self.rank) else loss).backward()
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()

    def logs(self, step: int) -> bool:
        """Whether step ``step`` writes a metrics line: every ``log_every`` steps and the last."""
        return step % self.args.log_every == 0 or step == self.args.steps

    def log(self, step: int, result: StepResult) -> None:
        """On a logged step (:meth:`logs`): the mean loss over the ranks and the bytes on the
        wire so far, both summed in the step's check, as a metrics line and on the progress bar."""
        if self.logs(step):
            self.state.train_loss = result.loss
            record = train_record(step, self.state.train_loss, result.lr, result.grad_norm, result.seconds,
                                  self.tokens_per_step, self.state.nonfinite_skipped, self.state.wire)
            record["hsdp"] = self.args.hsdp
            self.writer.write(record)
            self.postfix.update(loss=f"{self.state.train_loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                bits_w=f"{record['bits_per_elt_weights_total']:.1f}",
                                bits_g=f"{record['bits_per_elt_grads_total']:.1f}")
            if self.state.nonfinite_skipped:
                self.postfix["skipped"] = str(self.state.nonfinite_skipped)
            if self.bar is not None:
                self.bar.set_postfix(self.postfix, refresh=False)
        if self.bar is not None:
            self.bar.update(1)

    def maybe_checkpoint(self, step: int) -> None:
        """Every ``ckpt_every`` steps and at the last.

        Called before evaluating: the evaluation's forward gathers advance the
        direct-quantization version counters that the training step of step + 1 would
        otherwise advance, so a checkpoint taken after them would not resume bit-identically.
        """
        args = self.args
        if (args.ckpt_every and step % args.ckpt_every == 0) or step == args.steps:
            progress.mark(f"checkpoint of step {step}")
            self.state.wire.collect(self.device)
            save_checkpoint(args.out, step, self.model, self.optimizer, self.comms, self.state_dict(),
                            keep=args.keep_checkpoints)

    def maybe_evaluate(self, step: int) -> None:
        """Every ``eval_every`` steps and at the last: a validation line."""
        args = self.args
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            self.state.val_loss = self.evaluate()
            self.writer.write({"step": step, "val_loss": self.state.val_loss})
            self.postfix["val"] = f"{self.state.val_loss:.3f}"
            if self.bar is not None:
                self.bar.set_postfix(self.postfix, refresh=False)

    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches`` fixed batches split across the ranks (each
        rank runs the same number of forwards: FSDP2's gathers are collective)."""
        args, world = self.args, self.world
        progress.mark("evaluation")
        per_rank = -(-args.eval_batches // world)
        losses: list[torch.Tensor] = []
        self.model.eval()
        with torch.no_grad():
            batches = self.dataset.val_batches(per_rank * world, args.batch_size, args.seq_len)
            for index, (inputs, targets) in enumerate(batches):
                if index % world == self.rank:
                    _, loss = self.model(inputs.to(self.device), targets.to(self.device))
                    losses.append(loss.double())
        self.model.train()
        # Summed on the device: one host sync for the whole evaluation, not one per batch.
        total = torch.stack(losses).sum() if losses else torch.zeros((), dtype=torch.float64, device=self.device)
        sums = torch.stack([total, torch.tensor(float(len(losses)), dtype=torch.float64, device=self.device)])
        dist.all_reduce(sums)
        loss_sum, count = sums.tolist()
        return loss_sum / count

    def fit(self) -> dict[str, Any]:
        """Run the steps from the resume point to ``steps``; returns :meth:`summary`."""
        args, step = self.args, self.start_step
        try:
            for step in range(self.start_step + 1, args.steps + 1):
                result = self.train_step(step)
                self.log(step, result)
                self.maybe_checkpoint(step)
                self.maybe_evaluate(step)
            if self.start_step >= args.steps:
                self._final_evaluation_only()
            self._require_progress()
        except RuntimeError as e:
            if isinstance(e, (NonFiniteGradientError, PeerError)) or "timed out" not in str(e).lower():
                raise
            raise CollectiveTimeoutError(
                f"step {step}: a collective waited longer than "
                f"the timeout ({args.timeout_s:g} s, --timeout): a peer stopped answering or is far "
                f"behind ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
        finally:
            if self.bar is not None:
                self.bar.close()
            self.writer.close()
        return self.summary()

    def _require_progress(self) -> None:
        """A run whose every step since its start or resume was skipped trained nothing (its
        weights may be damaged in a way no check saw): it fails instead of ending as done."""
        ran = self.args.steps - self.start_step
        if ran > 0 and self.state.nonfinite_skipped - self.skipped_at_start == ran:
            since = f"the resume from step {self.start_step}" if self.start_step else "the start"
            raise NonFiniteGradientError(
                f"every step since {since} (steps {self.start_step + 1}-{self.args.steps}) had non-finite "
                f"gradients (NaN/Inf) and was skipped: nothing was trained; the last checkpoint is "
                f"{latest_name(self.args.out)}")

    def _final_evaluation_only(self) -> None:
        # A restart after the final checkpoint: only the final evaluation is left.
        self.state.val_loss = self.evaluate()
        if self.rank == 0 and not any(record.get("step") == self.args.steps and "val_loss" in record
                                      for record in read_metrics(self.args.out)):
            self.writer.write({"step": self.args.steps, "val_loss": self.state.val_loss})

    def summary(self) -> dict[str, Any]:
        """The run summary (collective: the bytes and the state digests; the same on every rank)."""
        args, state, topology = self.args, self.state, self.comms.topology
        nodes, per_node = self.hsdp_layout or (topology.nodes, topology.ranks_per_node)
        state.wire.collect(self.device)
        weights_sha, optim_sha = state_digests(self.model, self.optimizer)
        return {
            "config": self.comms.config.to_dict(), "preset": args.preset, "args": dataclasses.asdict(args),
            "final_val_loss": state.val_loss, "final_train_loss": state.train_loss,
            "wire": state.wire.as_dict(), "wire_bytes_total": state.wire.total_bytes(),
            "steps": args.steps, "start_step": self.start_step, "restarts": restart_count(),
            "nonfinite_skipped": state.nonfinite_skipped,
            "final_weights_sha256": weights_sha, "final_optimizer_sha256": optim_sha,
            "wall_time_s": time.perf_counter() - self.started,
            "median_step_time_s": statistics.median(self.step_times) if self.step_times else None,
            "tokens_per_step": self.tokens_per_step, "world_size": self.world,
            "global_batch": self.split.global_batch, "rank_batches": list(self.split.counts),
            "micro_batch": self.split.micro_batch, "accumulation_steps": self.split.accumulation,
            "local_world_size": per_node, "nodes": nodes, "hsdp": args.hsdp,
            "n_params": count_params(self.model), "param_dtype": self.dtype_name,
            "vocab_size": self.dataset.vocab_size, "data_id": self.plan.data_id,
            "torch_version": torch.__version__, "qsdp_version": qsdp.__version__,
            "device": device_name(self.device), "backend": str(dist.get_backend()),
            "codec_kernels": implementations_run(),
            "guard": self._guard_summary(),
        }

    def _guard_summary(self) -> dict[str, Any] | None:
        """The accuracy guard's moves and every group's rungs at the end, or ``None`` without one."""
        guard = self.comms.guard
        if guard is None:
            return None
        return {"every": guard.config.every, "escalations": [dataclasses.asdict(e) for e in guard.escalations],
                "rungs": {guard.names[i]: dict(zip(("weights", "gradients"), guard.rungs(i)))
                          for i in range(len(guard.levels))},
                "readings": [{"step": step, "q_sgd": [r.grad_ratio for r in rs], "w_err_step": [r.weight_ratio for r in rs]}
                             for step, rs in guard.readings]}
