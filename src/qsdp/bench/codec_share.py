"""``qsdp bench codec-share``: the share of qsdp's work in one rank's training step, per preset.

One process plays rank ``--rank`` of a ``--nodes x --ranks-per-node`` world, as ``qsdp check``
emulates ranks. Each step it gathers every FSDP group's weights (before forward; the blocks'
again before backward, FSDP2's ``reshard_after_forward=True``; the root stays gathered), runs
forward and backward of the GPT on its micro-batch in ``--param-dtype``, reduce-scatters every
group's gradient in fp32 (FSDP2's reduce dtype) and steps AdamW on its fp32 shards. The
collectives' codec work is that rank's own, with the peers' rows stood in by copies of its own
(:mod:`qsdp.bench.one_rank`); forward and backward run on the model's own weights.

After ``--warmup`` steps (the Triton kernels' compilation among them), ``--steps`` steps run
under ``torch.profiler``:

* on CUDA, the step's time is the GPU time of every GPU activity of those steps (kernels,
  copies, fills), and qsdp's the GPU time of those inside the GPU-side spans of the
  ``qsdp.codec.*`` ranges; the two Triton kernels (``_quantize_kernel``, ``_dequantize_kernel``)
  are also summed by name, a check that needs no range;
* on CPU (the torch reference codecs, on one thread), the host time of the ``qsdp.codec.*``
  ranges over that of the steps.

``wall_over_step`` = the wall time of a step (timed apart, unprofiled) / the step's profiled
time: on CUDA, above 1 by the time the GPU waits for the host. ``share`` = qsdp's time / the
step's, also per codec step (the ranges are named after the
workloads of ``qsdp bench kernels`` where one matches). The step measured here has no collective
(device copies of the rank's own rows stand in for what each delivers, far shorter than a
transfer) and none of FSDP2's copies into and out of the gathered buffers, so a real rank's step
is longer and its share smaller: the number is an upper bound.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..check import emulate
from ..check.models import fsdp_groups, lm_loss
from ..codecs.usage import implementations_run
from ..config import ConfigError, resolve_config
from ..text_table import aligned
from ..train.args import PARAM_DTYPES
from ..train.model import MODEL_SIZES, count_params, default_vocab, make_gpt
from .one_rank import CODEC_RANGE, RankGather, RankReduceScatter
from .report import BENCH_PRESETS, emit, meta
from qsdp.usage import UsageParser, save_path

__all__ = ["STEP_RANGE", "TRITON_KERNELS", "ShareSpec", "Span", "spans", "profile_times", "OneRankStep",
           "measure", "format_table", "main"]

STEP_RANGE = "qsdp.step"
TRITON_KERNELS = ("_quantize_kernel", "_dequantize_kernel")


@dataclass(frozen=True)
class ShareSpec:
    """What one measurement builds: the GPT size, the world it plays one rank of, that rank's
    micro-batch (``batch_size`` sequences of ``seq_len`` tokens), the parameter dtype, and the
    warm-up and profiled step counts."""

    model: str = "gpt2-125m"
    nodes: int = 2
    ranks_per_node: int = 4
    rank: int = 0
    batch_size: int = 8
    seq_len: int = 1024
    param_dtype: str = "bfloat16"
    warmup: int = 3
    steps: int = 5
    device: str = "cuda"
    seed: int = 0

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if self.model not in MODEL_SIZES:
            raise ValueError(f"model={self.model!r}; allowed: {', '.join(MODEL_SIZES)}")
        for name in ("nodes", "ranks_per_node", "batch_size", "seq_len", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.world < 2:
            raise ValueError("the world must have at least 2 ranks (nodes x ranks_per_node): one rank communicates nothing")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank={self.rank} must be in [0, {self.world})")
        if self.warmup < 1:
            raise ValueError(f"warmup={self.warmup} must be at least 1: the first step compiles and allocates")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype={self.param_dtype!r}; allowed: {', '.join(PARAM_DTYPES)}")


# --------------------------------------------------------------------------- the profile


@dataclass(frozen=True)
class Span:
    """One profiler event: a range (``annotation``) or work, on the GPU or the host, in us."""

    name: str
    on_gpu: bool
    annotation: bool
    start_us: float
    end_us: float

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def spans(events: Iterable[Any]) -> list[Span]:
    """The profiler's events (``profile.events()``) as :class:`Span`."""
    from torch.autograd import DeviceType

    return [Span(e.name, e.device_type != DeviceType.CPU, bool(getattr(e, "is_user_annotation", False)),
                 e.time_range.start, e.time_range.end) for e in events]


def _codec_step(name: str) -> str | None:
    """``"qsdp.codec.quantize"`` -> ``"quantize"``; ``None`` for any other name."""
    prefix = CODEC_RANGE + "."
    return name[len(prefix):] if name.startswith(prefix) else None


def profile_times(events: Sequence[Span], gpu: bool) -> dict[str, Any]:
    """Microseconds of the profiled steps: ``step_us``, ``qsdp_us`` (inside the codec ranges)
    and ``by_step`` (per codec range name); with ``gpu`` also ``triton_us`` (the Triton kernels
    by name) and ``gpu_ranges`` (GPU-side codec spans found). See the module doc."""
    by_step: dict[str, float] = {}
    if not gpu:
        step = sum(s.us for s in events if not s.on_gpu and s.name == STEP_RANGE)
        for s in events:
            name = _codec_step(s.name)
            if name is not None and not s.on_gpu:
                by_step[name] = by_step.get(name, 0.0) + s.us
        return {"step_us": step, "qsdp_us": sum(by_step.values()), "by_step": by_step}
    work = [s for s in events if s.on_gpu and not s.annotation]
    ranges = sorted((s.start_us, s.end_us, _codec_step(s.name)) for s in events
                    if s.on_gpu and s.annotation and _codec_step(s.name) is not None)
    starts = [r[0] for r in ranges]
    for w in work:
        # GPU work of one stream runs in launch order: a kernel launched inside a range lies
        # inside that range's GPU-side span, and no other kernel does.
        i = bisect.bisect_right(starts, w.start_us) - 1
        if i >= 0 and w.end_us <= ranges[i][1]:
            by_step[ranges[i][2]] = by_step.get(ranges[i][2], 0.0) + w.us
    return {"step_us": sum(w.us for w in work), "qsdp_us": sum(by_step.values()), "by_step": by_step,
            "triton_us": sum(w.us for w in work if w.name in TRITON_KERNELS), "gpu_ranges": len(ranges)}


# --------------------------------------------------------------------------- the step


class OneRankStep:
    """One rank's training state under one config: the GPT in the parameter dtype (forward and
    backward), the rank's fp32 shard of every FSDP group with AdamW over them, and its gathers
    and reduce-scatters (:mod:`qsdp.bench.one_rank`)."""

    def __init__(self, spec: ShareSpec, preset: str) -> None:
        spec.validate()
        self.spec, self.cfg = spec, resolve_config(preset)
        self.device = torch.device(spec.device)
        self.dtype = PARAM_DTYPES[spec.param_dtype]
        self.vocab = default_vocab(spec.model)
        torch.manual_seed(spec.seed)
        self.model = make_gpt(spec.model, self.vocab, spec.seq_len).to(self.device)
        self.groups = fsdp_groups(self.model)
        world, rank, d, m = spec.world, spec.rank, spec.nodes, spec.ranks_per_node
        self.shards = [emulate.flat_rows([p.float() for p in g.params], world)[rank].clone() for g in self.groups]
        self.model.to(self.dtype).train()
        self.gathers = [RankGather(self.cfg, d, m, rank, i, s.to(self.dtype)) for i, s in enumerate(self.shards)]
        self.gathered = [torch.empty(world * s.numel(), dtype=self.dtype, device=self.device) for s in self.shards]
        self.reduces = [RankReduceScatter(self.cfg, d, m, rank, i) for i in range(len(self.groups))]
        self.optimizer = torch.optim.AdamW(self.shards, lr=1e-4, betas=(0.9, 0.95))
        self.tokens = torch.Generator().manual_seed(spec.seed + rank)

    def step(self) -> float:
        """One training step of this rank (inside the :data:`STEP_RANGE` range); its loss."""
        spec, world = self.spec, self.spec.world
        with record_function(STEP_RANGE):
            ids = torch.randint(0, self.vocab, (spec.batch_size, spec.seq_len + 1), generator=self.tokens)
            ids = ids.to(self.device)
            for shard, gather, out in zip(self.shards, self.gathers, self.gathered):
                gather(shard.to(self.dtype), out, changed=True)
            loss = lm_loss(self.model, ids[:, :-1], ids[:, 1:])
            loss.backward()
            # Backward gathers the blocks again; the root stays gathered.
            for shard, gather, out in list(zip(self.shards, self.gathers, self.gathered))[1:]:
                gather(shard.to(self.dtype), out, changed=False)
            for shard, group, reduce in zip(self.shards, self.groups, self.reduces):
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group.params]
                shard.grad = reduce(emulate.flat_rows([t.float() for t in grads], world))
            self.model.zero_grad(set_to_none=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(spec: ShareSpec, preset: str) -> dict[str, Any]:
    """One preset: warm-up steps, ``spec.steps`` timed steps (wall time), the same number
    profiled; per step in ms: the step, qsdp's part, each codec step's, and the shares."""
    threads = torch.get_num_threads()
    if spec.device == "cpu":
        torch.set_num_threads(1)  # as `qsdp bench codecs`: one core's time, free of the others' load
    try:
        return _measure(spec, preset)
    finally:
        torch.set_num_threads(threads)


def _measure(spec: ShareSpec, preset: str) -> dict[str, Any]:
    state = OneRankStep(spec, preset)
    for _ in range(spec.warmup):
        state.step()
    _sync(state.device)
    implementations_run(reset=True)
    t0 = time.perf_counter()
    for _ in range(spec.steps):
        loss = state.step()
    _sync(state.device)
    wall = (time.perf_counter() - t0) / spec.steps
    gpu = state.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(spec.steps):
            state.step()
        _sync(state.device)
    t = profile_times(spans(prof.events()), gpu)
    per = 1e-3 / spec.steps  # us over all steps -> ms per step
    row: dict[str, Any] = {
        "step_ms": t["step_us"] * per, "qsdp_ms": t["qsdp_us"] * per,
        "share": t["qsdp_us"] / t["step_us"] if t["step_us"] else None,
        "by_step_ms": {k: v * per for k, v in sorted(t["by_step"].items())},
        "by_step_share": {k: v / t["step_us"] for k, v in sorted(t["by_step"].items())} if t["step_us"] else {},
        "wall_step_ms": wall * 1e3, "loss": float(loss), "codec_kernels": implementations_run(reset=True),
        # Above 1 by what the step waits for beyond its profiled time: on a GPU, the host.
        "wall_over_step": wall * 1e3 / (t["step_us"] * per) if t["step_us"] else None,
    }
    if gpu:
        row.update(triton_ms=t["triton_us"] * per, triton_share=t["triton_us"] / t["step_us"] if t["step_us"] else None,
                   gpu_codec_ranges=t["gpu_ranges"])
    row["n_params"] = count_params(state.model)
    del state
    if gpu:
        torch.cuda.empty_cache()
    return row


def measure_many(spec: ShareSpec, presets: Sequence[str], log=None) -> dict[str, Any]:
    """:func:`measure` of every preset, with the spec."""
    rows = {}
    for i, p in enumerate(presets, 1):
        if log:
            log(f"[{i}/{len(presets)}] {p}")
        rows[p] = measure(spec, p)
    n_params = next(iter(rows.values()))["n_params"] if rows else None
    time_kind = "GPU time (torch.profiler, CUDA activities)" if spec.device.startswith("cuda") else "host time (torch.profiler)"
    return {**dataclasses.asdict(spec), "n_params": n_params, "time": time_kind, "presets": rows}


def format_table(result: dict[str, Any]) -> str:
    steps = sorted({k for r in result["presets"].values() for k in r["by_step_ms"]})
    head = ("preset", "step ms", "wall ms", "wall/step", "qsdp ms", "share", *steps)
    lines: list[Sequence[str]] = [head]
    for p, r in result["presets"].items():
        share = "n/a" if r["share"] is None else f"{r['share']:.2%}"
        ratio = "n/a" if r["wall_over_step"] is None else f"{r['wall_over_step']:.2f}x"
        lines.append((p, f"{r['step_ms']:.2f}", f"{r['wall_step_ms']:.2f}", ratio, f"{r['qsdp_ms']:.2f}", share,
                      *(f"{r['by_step_share'].get(k, 0.0):.2%}" for k in steps)))
    title = (f"one rank (rank {result['rank']} of {result['nodes']} x {result['ranks_per_node']}) of GPT "
             f"'{result['model']}' ({result['n_params'] / 1e6:.0f}M), {result['batch_size']} x {result['seq_len']} "
             f"tokens, {result['param_dtype']}; {result['time']} per step, mean of {result['steps']}")
    return "\n".join([title, *aligned(lines, rule=True)])


def _parser() -> argparse.ArgumentParser:
    d = ShareSpec()
    p = UsageParser(prog="qsdp bench codec-share", description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=list(BENCH_PRESETS), help="presets or variants")
    p.add_argument("--model", default=d.model, choices=tuple(MODEL_SIZES),
                   help=f"GPT size (default {d.model}: GPT-2's vocabulary, an untied head)")
    p.add_argument("--nodes", type=int, default=d.nodes, help=f"D of the world one rank of is played (default {d.nodes})")
    p.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node, help=f"M (default {d.ranks_per_node})")
    p.add_argument("--rank", type=int, default=d.rank, help="the rank played (default 0)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences in the rank's micro-batch")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--param-dtype", choices=tuple(PARAM_DTYPES), default=d.param_dtype)
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps before the timed ones (default 3)")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps, and as many profiled (default 5)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: GPU time, the Triton kernels; cpu: host time, the torch reference (auto: cuda when there)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    device = "cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device)
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here (use --device cpu)")
    spec = ShareSpec(model=a.model, nodes=a.nodes, ranks_per_node=a.ranks_per_node, rank=a.rank,
                     batch_size=a.batch_size, seq_len=a.seq_len, param_dtype=a.param_dtype, warmup=a.warmup,
                     steps=a.steps, device=device)
    try:
        spec.validate()
        for p in a.presets:
            resolve_config(p)
    except (ValueError, ConfigError) as e:
        parser.error(str(e))
    result = measure_many(spec, a.presets, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result["meta"] = meta("codec-share", argv, name)
    return emit(result, as_json=a.json, save=a.save, format_text=format_table)


if __name__ == "__main__":
    raise SystemExit(main())
