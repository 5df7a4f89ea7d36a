"""``qsdp bench codec-share``: each preset's step against fsdp's, and the share of qsdp's work in it.

One process trains as rank ``--rank`` of a ``--nodes x --ranks-per-node`` world, on one device:
the GPT sharded by FSDP2 (each block, then the root; ``reshard_after_forward=True``; the
parameters in ``--param-dtype``, the gradients reduced in fp32) and
:func:`qsdp.quantize_comms` attaching qsdp's comm objects, as ``qsdp train`` does. The process
group is the launch census's one-process backend (:mod:`qsdp.bench.one_rank`): its collectives
deliver this rank's own bytes as every peer's, one device copy each. A step is the training
job's: forward and backward on the rank's micro-batch, :func:`qsdp.check_gradients` (the step's
one host read), AdamW.

After ``--warmup`` steps (the Triton kernels' compilation among them), ``--steps`` steps are
timed on the wall clock, each from its start to the next one's (on CUDA the device is
synchronized before the first and after the last; the step's host read of the gradient check
keeps the host within a step of the device): ``wall_step_ms`` is their median,
``wall_steps_ms`` each. As many steps then run under ``torch.profiler`` with each call of a comm
object inside a range ``qsdp.comm.<class>`` and each collective inside ``qsdp.wire``:

* on CUDA the step's time is the GPU time of every GPU activity of those steps (kernels, copies,
  fills), and qsdp's the GPU time of the work the comm objects' calls launched, less the
  collectives' (the profiler ties each kernel to the host operator or range that launched it,
  whatever stream it runs on); the Triton kernels of :mod:`qsdp.codecs.triton_kernels` are also
  summed by name (``triton_ms``);
* on the CPU (the torch reference codecs, one thread) both are host times: the steps', and the
  comm objects' calls less their collectives'.

``share`` = qsdp's time / the step's; ``wall_over_step`` = the wall time / the profiled step time
(on CUDA above 1 by what the GPU waits for the host); ``wall_vs_fsdp`` = the wall time / the
fsdp preset's, measured in the same run. ``comm_calls`` counts the calls of each comm class a
step makes, ``wire_bits`` the bits per element the comm objects' byte meter counted (per kind and
level) in the timed steps: both say that the measured step ran the product's collectives.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from ..codecs.usage import implementations_run
from ..config import ConfigError, resolve_config
from ..text_table import aligned
from ..train.args import PARAM_DTYPES
from ..train.model import MODEL_SIZES, count_params, default_vocab, make_gpt, transformer_blocks
from .one_rank import BACKEND, COMM_RANGE, WIRE_RANGE, in_one_process_world, one_process_world, ranged_comms
from .report import BENCH_PRESETS, emit, meta
from qsdp.usage import UsageParser, save_path

__all__ = ["STEP_RANGE", "DEVICE_DEFAULTS", "ShareSpec", "Span", "spans", "profile_times", "OneRankStep",
           "measure", "measure_many", "format_table", "main"]

STEP_RANGE = "qsdp.step"
# What a step is made of where the command line does not say: on a GPU the step of the H200
# measurements (GPT-2 small's shape, 8 x 1024 tokens a rank, bf16); on the CPU a tiny GPT that
# runs in seconds.
DEVICE_DEFAULTS = {
    "cuda": {"model": "gpt2-125m", "batch_size": 8, "seq_len": 1024, "param_dtype": "bfloat16"},
    "cpu": {"model": "tiny", "batch_size": 2, "seq_len": 64, "param_dtype": "float32"},
}


@dataclass(frozen=True)
class ShareSpec:
    """What one measurement builds: the GPT size, the world it plays one rank of, that rank's
    micro-batch (``batch_size`` sequences of ``seq_len`` tokens), the parameter dtype, and the
    warm-up and timed step counts (as many steps again are profiled)."""

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
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}; allowed: cpu, cuda")


# --------------------------------------------------------------------------- the profile


@dataclass
class Span:
    """One profiler event, in us: a host operator or range (``kernels_us``: the GPU time of the
    kernels it launched itself; ``children``: the host events inside it, on its thread) or GPU
    work (``on_gpu``; ``annotation``: a range's GPU-side span, no work of its own)."""

    name: str
    on_gpu: bool
    start_us: float
    end_us: float
    kernels_us: float = 0.0
    annotation: bool = False
    children: list["Span"] = field(default_factory=list)

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def spans(events: Iterable[Any]) -> list[Span]:
    """The profiler's events (``profile.events()``) as :class:`Span`, children linked."""
    from torch.autograd import DeviceType

    events = list(events)
    made = {id(e): Span(e.name, e.device_type != DeviceType.CPU, e.time_range.start, e.time_range.end,
                        sum(k.duration for k in getattr(e, "kernels", ()) or ()),
                        bool(getattr(e, "is_user_annotation", False))) for e in events}
    for e in events:
        made[id(e)].children = [made[id(c)] for c in (getattr(e, "cpu_children", None) or ()) if id(c) in made]
    return [made[id(e)] for e in events]


def _comm(name: str) -> str | None:
    """``"qsdp.comm.QuantizedReduceScatter"`` -> ``"QuantizedReduceScatter"``; ``None`` for any other name."""
    prefix = COMM_RANGE + "."
    return name[len(prefix):] if name.startswith(prefix) else None


def _gpu_us(span: Span) -> tuple[float, float]:
    """(GPU time launched inside ``span`` outside the wire ranges, GPU time launched inside them)."""
    own, wire = span.kernels_us, 0.0
    for child in span.children:
        o, w = _gpu_us(child)
        if child.name == WIRE_RANGE:
            wire += o + w
        else:
            own, wire = own + o, wire + w
    return own, wire


def _wire_host_us(span: Span) -> float:
    """Host time of the outermost wire ranges inside ``span``."""
    return sum(c.us if c.name == WIRE_RANGE else _wire_host_us(c) for c in span.children)


def profile_times(events: Sequence[Span], gpu: bool, triton_kernels: Sequence[str] = ()) -> dict[str, Any]:
    """Microseconds of the profiled steps (see the module doc): ``step_us``, ``qsdp_us``,
    ``by_comm`` (qsdp's time per comm class), ``wire_us`` (the collectives inside the comm
    calls) and ``calls`` (comm calls per class); with ``gpu`` also ``triton_us`` (the GPU work
    named after one of ``triton_kernels``)."""
    by_comm: dict[str, float] = {}
    calls: Counter[str] = Counter()
    wire = 0.0
    for s in events:
        name = None if s.on_gpu else _comm(s.name)
        if name is None:
            continue
        calls[name] += 1
        if gpu:
            own, w = _gpu_us(s)
        else:
            w = _wire_host_us(s)
            own = s.us - w
        by_comm[name] = by_comm.get(name, 0.0) + own
        wire += w
    if gpu:
        work = [s for s in events if s.on_gpu and not s.annotation]
        step = sum(s.us for s in work)
    else:
        step = sum(s.us for s in events if not s.on_gpu and s.name == STEP_RANGE)
    t = {"step_us": step, "qsdp_us": sum(by_comm.values()), "by_comm": by_comm, "wire_us": wire, "calls": dict(calls)}
    if gpu:
        t["triton_us"] = sum(s.us for s in work if s.name.startswith(tuple(triton_kernels))) if triton_kernels else 0.0
    return t


def _triton_kernel_names() -> list[str]:
    """The names of the Triton kernels of :mod:`qsdp.codecs.triton_kernels` (none without Triton)."""
    try:
        from triton.runtime.jit import KernelInterface

        from ..codecs import triton_kernels as tk
    except ImportError:
        return []
    return sorted(name for name, k in vars(tk).items() if isinstance(k, KernelInterface))


# --------------------------------------------------------------------------- the step


class OneRankStep:
    """One rank's training state under one preset: the GPT sharded by FSDP2 over the
    one-process world (made here unless one is already there, and ended by :meth:`close` if
    made here), qsdp's comms attached by :func:`qsdp.quantize_comms` (``handle``), AdamW."""

    def __init__(self, spec: ShareSpec, preset: str) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ..fsdp import quantize_comms

        spec.validate()
        self.spec, self.preset = spec, preset
        self.device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
        self._world = None
        if not in_one_process_world():
            self._world = one_process_world(spec.nodes, spec.ranks_per_node, spec.rank)
            self._world.__enter__()
        elif (dist.get_world_size(), dist.get_rank()) != (spec.world, spec.rank):
            raise RuntimeError(f"a {BACKEND} world of {dist.get_world_size()} ranks (rank {dist.get_rank()}) is "
                               f"already there; this step needs {spec.world} (rank {spec.rank})")
        try:
            dtype = PARAM_DTYPES[spec.param_dtype]
            self.vocab = default_vocab(spec.model)
            torch.manual_seed(spec.seed)  # the same initial weights for every preset
            model = make_gpt(spec.model, self.vocab, spec.seq_len).to(self.device)
            self.n_params = count_params(model)
            policy = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
                      if dtype != torch.float32 else MixedPrecisionPolicy())
            mesh = DeviceMesh.from_group(dist.group.WORLD, self.device.type)
            for block in transformer_blocks(model):
                fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
            fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
            self.model = model.train()
            self.handle = quantize_comms(model, preset, overrides={"local_world_size": spec.ranks_per_node})
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
            # Tokens drawn on the device: no host-to-device copy of the benchmark's own.
            self.tokens = torch.Generator(device=self.device).manual_seed(spec.seed + spec.rank)
        except BaseException:
            self.close()
            raise

    def step(self) -> torch.Tensor:
        """One training step (inside the :data:`STEP_RANGE` range); its loss, on the device."""
        from ..gradient_check import check_gradients

        spec = self.spec
        with record_function(STEP_RANGE):
            ids = torch.randint(0, self.vocab, (spec.batch_size, spec.seq_len + 1), generator=self.tokens,
                                device=self.device)
            _, loss = self.model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            params = [p for p in self.model.parameters() if p.grad is not None]
            check = check_gradients(self.handle, params, sums=[loss.detach()], agree_ahead=True)
            if not check.nonfinite:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def close(self) -> None:
        """Release the comms (and end the world if it was made here)."""
        handle = getattr(self, "handle", None)
        if handle is not None:
            handle.close()
        if self._world is not None:
            world, self._world = self._world, None
            world.__exit__(None, None, None)

    def __enter__(self) -> "OneRankStep":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(spec: ShareSpec, preset: str) -> dict[str, Any]:
    """One preset: warm-up steps, ``spec.steps`` timed steps (wall time), as many profiled; per
    step in ms: the step, qsdp's part, each comm class's, and the shares (see the module doc)."""
    threads = torch.get_num_threads()
    if spec.device == "cpu":
        torch.set_num_threads(1)  # as `qsdp bench codecs`: one core's time, free of the others' load
    try:
        with OneRankStep(spec, preset) as state:
            return _measure(state)
    finally:
        torch.set_num_threads(threads)


def _bits(stats: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Bits per element on the wire, per kind (weights, grads) and level (intra, inter, total)."""
    return {kind: {level: (v["bits_per_element"] if v["elements"] else None) for level, v in stats[kind].items()}
            for kind in ("weights", "grads")}


def _measure(state: OneRankStep) -> dict[str, Any]:
    spec = state.spec
    for _ in range(spec.warmup):
        state.step()
    _sync(state.device)
    implementations_run(reset=True)
    state.handle.comm_stats(reset=True)
    # Each step's wall time, from its start to the next one's (the last: to the device's end). A
    # step reads the gradient check on the host, so the host never runs more than a step ahead,
    # and no synchronization is added between steps.
    clock = [time.perf_counter()]
    for i in range(spec.steps):
        loss = state.step()
        if i == spec.steps - 1:
            _sync(state.device)
        clock.append(time.perf_counter())
    walls = [b - a for a, b in zip(clock, clock[1:])]
    wall = statistics.median(walls)
    stats = state.handle.comm_stats(reset=True)
    kernels = implementations_run(reset=True)
    gpu = state.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with ranged_comms(state.handle), profile(activities=activities) as prof:
        for _ in range(spec.steps):
            state.step()
        _sync(state.device)
    t = profile_times(spans(prof.events()), gpu, _triton_kernel_names() if gpu else ())
    per = 1e-3 / spec.steps  # us over all steps -> ms per step
    step_us = t["step_us"]
    row: dict[str, Any] = {
        "step_ms": step_us * per, "qsdp_ms": t["qsdp_us"] * per,
        "share": t["qsdp_us"] / step_us if step_us else None,
        "by_comm_ms": {k: v * per for k, v in sorted(t["by_comm"].items())},
        "by_comm_share": {k: v / step_us for k, v in sorted(t["by_comm"].items())} if step_us else {},
        "wire_ms": t["wire_us"] * per,
        "comm_calls": {k: v / spec.steps for k, v in sorted(t["calls"].items())},
        "wall_step_ms": wall * 1e3, "wall_steps_ms": [w * 1e3 for w in walls], "loss": float(loss),
        "codec_kernels": kernels,
        # Above 1 by what the step waits for beyond its profiled time: on a GPU, the host.
        "wall_over_step": wall * 1e3 / (step_us * per) if step_us else None,
        "wire_bits": _bits(stats),
        "wire_bytes_per_step": (stats["weights"]["total"]["bytes"] + stats["grads"]["total"]["bytes"]) / spec.steps,
        "n_params": state.n_params,
    }
    if gpu:
        row.update(triton_ms=t["triton_us"] * per, triton_share=t["triton_us"] / step_us if step_us else None)
    return row


def measure_many(spec: ShareSpec, presets: Sequence[str], log=None) -> dict[str, Any]:
    """:func:`measure` of every preset, with the spec; each row's ``wall_vs_fsdp`` where the
    fsdp preset was measured too."""
    rows = {}
    for i, p in enumerate(presets, 1):
        if log:
            log(f"[{i}/{len(presets)}] {p}")
        rows[p] = measure(spec, p)
        if spec.device == "cuda":
            torch.cuda.empty_cache()
    base = rows.get("fsdp", {}).get("wall_step_ms")
    for r in rows.values():
        r["wall_vs_fsdp"] = r["wall_step_ms"] / base if base else None
    n_params = next(iter(rows.values()))["n_params"] if rows else None
    time_kind = "GPU time (torch.profiler, CUDA activities)" if spec.device == "cuda" else "host time (torch.profiler)"
    return {**dataclasses.asdict(spec), "n_params": n_params, "time": time_kind,
            "path": "FSDP2 + quantize_comms, one process emulating the world (qsdp.bench.one_rank)", "presets": rows}


def format_table(result: dict[str, Any]) -> str:
    comms = sorted({k for r in result["presets"].values() for k in r["by_comm_ms"]})
    head = ("preset", "wall ms", "vs fsdp", "step ms", "wall/step", "qsdp ms", "share", *comms)
    lines: list[Sequence[str]] = [head]
    na = lambda x, f: "n/a" if x is None else f.format(x)  # noqa: E731
    for p, r in result["presets"].items():
        lines.append((p, f"{r['wall_step_ms']:.2f}", na(r.get("wall_vs_fsdp"), "{:.2f}x"), f"{r['step_ms']:.2f}",
                      na(r["wall_over_step"], "{:.2f}x"), f"{r['qsdp_ms']:.2f}", na(r["share"], "{:.2%}"),
                      *(f"{r['by_comm_share'].get(k, 0.0):.2%} ({r['comm_calls'].get(k, 0):g})" for k in comms)))
    title = (f"rank {result['rank']} of {result['nodes']} x {result['ranks_per_node']} in one process (FSDP2 + "
             f"quantize_comms) training GPT '{result['model']}' ({result['n_params'] / 1e6:.1f}M), "
             f"{result['batch_size']} x {result['seq_len']} tokens, {result['param_dtype']}; {result['time']} per "
             f"step, mean of {result['steps']} (wall: their median)")
    notes = ["per comm class: its share of the step (its calls a step); share: the comm objects' work less "
             "their collectives"]
    return "\n".join([title, *aligned(lines, rule=True), *notes])


def _parser() -> argparse.ArgumentParser:
    d = ShareSpec()
    gpu, cpu = DEVICE_DEFAULTS["cuda"], DEVICE_DEFAULTS["cpu"]
    by_device = lambda key: f"default {gpu[key]} on cuda, {cpu[key]} on cpu"  # noqa: E731
    p = UsageParser(prog="qsdp bench codec-share", description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=list(BENCH_PRESETS), help="presets or variants")
    p.add_argument("--model", default=None, choices=tuple(MODEL_SIZES), help=f"GPT size ({by_device('model')})")
    p.add_argument("--nodes", type=int, default=d.nodes, help=f"D of the world one rank of is played (default {d.nodes})")
    p.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node, help=f"M (default {d.ranks_per_node})")
    p.add_argument("--rank", type=int, default=d.rank, help="the rank played (default 0)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"sequences in the rank's micro-batch ({by_device('batch_size')})")
    p.add_argument("--seq-len", type=int, default=None, help=f"tokens a sequence ({by_device('seq_len')})")
    p.add_argument("--param-dtype", choices=tuple(PARAM_DTYPES), default=None, help=by_device("param_dtype"))
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
    given = {"model": a.model, "batch_size": a.batch_size, "seq_len": a.seq_len, "param_dtype": a.param_dtype}
    shape = {k: DEVICE_DEFAULTS[device][k] if v is None else v for k, v in given.items()}
    spec = ShareSpec(**shape, nodes=a.nodes, ranks_per_node=a.ranks_per_node, rank=a.rank, warmup=a.warmup,
                     steps=a.steps, device=device)
    try:
        spec.validate()
        for p in a.presets:
            resolve_config(p)
    except (ValueError, ConfigError) as e:
        parser.error(str(e))
    if dist.is_initialized():
        parser.error("a process group is already initialized in this process: the benchmark makes its own world")
    result = measure_many(spec, a.presets, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result["meta"] = meta("codec-share", argv, name)
    return emit(result, as_json=a.json, save=a.save, format_text=format_table)


if __name__ == "__main__":
    raise SystemExit(main())
