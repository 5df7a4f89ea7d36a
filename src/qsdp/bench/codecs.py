"""``qsdp bench codecs``: what every codec step costs, per element, against a copy of its bytes.

Each step is run through the codec API exactly as the collectives run it (``quantize``, and
``RowCodec``'s encode, weight difference, decode-and-accumulate, dequantize-sum-requantize and
replica update; the workloads of :mod:`qsdp.bench.kernels`). On CPU it is the torch reference on
one thread (``torch.set_num_threads(1)``): nanoseconds per element and GB/s of the bytes the step
must read and write, beside a plain copy of the same number of bytes timed right after it (the
thread's CPU time, minimum over rounds that each run every step once). On CUDA the same steps
run the fused Triton kernels, timed with CUDA events (median of the repeats).

The three rounding rows answer one question: what the random bits of stochastic and shift
rounding cost over nearest rounding (``vs_nearest``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

from .kernels import ALIGN, build, parse_size
from .report import cpu_model, emit, meta
from qsdp.usage import UsageParser, save_path

ROUNDINGS = ("nearest", "stochastic", "shift")
STEPS = (
    "quantize_nearest",
    "quantize_stochastic",
    "quantize_shift",
    "hadamard_quantize",
    "dequantize_accumulate",
    "dequantize_requantize",
    "weight_difference_quantize",
    "replica_update",
)
QUANTIZE_WORKLOAD = "fp32 -> 4-bit absmax, group 128, {} rounding (quantize(), checked for NaN/Inf)"
DEFAULT_SIZE = "4M"


def _rounding_step(rounding: str, n: int, device: str) -> tuple[Callable[[], Any], int, str]:
    """``quantize(x, bits=4, group_size=128, symmetric=True, rounding=...)`` on fp32 ``x``."""
    import torch

    from ..codecs import quantize

    x = torch.randn(n, generator=torch.Generator(device=device).manual_seed(0), device=device)
    nbytes = 4 * n + n // 2 + 4 * (n // 128)

    def step():
        return quantize(x, bits=4, group_size=128, symmetric=True, rounding=rounding, seed=1)

    return step, nbytes, QUANTIZE_WORKLOAD.format(rounding)


def workload(name: str, n: int, device: str) -> tuple[Callable[[], Any], int, str]:
    """(the step as a no-argument call, bytes it reads plus writes, what it is) of ``name``."""
    if name.startswith("quantize_"):
        return _rounding_step(name.removeprefix("quantize_"), n, device)
    from .kernels import WORKLOADS

    w = build(name, n, device=device)
    return w.fused, w.nbytes, WORKLOADS[name]


def _thread_seconds(fn: Callable[[], Any]) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


Calls = list[tuple[Callable[[], Any], Callable[[], Any]]]  # (step, copy of the same bytes)


def _time_cpu(calls: Calls, repeats: int) -> list[tuple[float, float]]:
    """Minimum seconds of every ``(step, copy)`` pair over ``repeats`` rounds, each round running
    every step once followed by its copy (after one warm-up round). Rounds rather than one step
    at a time, so that a burst of load from other processes hits every step alike; this
    thread's CPU time, so that time spent descheduled does not count."""
    best = [[float("inf"), float("inf")] for _ in calls]
    for r in range(repeats + 1):
        for i, (step, copy) in enumerate(calls):
            t_step, t_copy = _thread_seconds(step), _thread_seconds(copy)
            if r:
                best[i] = [min(best[i][0], t_step), min(best[i][1], t_copy)]
    return [(a, b) for a, b in best]


def _time_cuda(calls: Calls, repeats: int) -> list[tuple[float, float]]:
    """Median seconds of every ``(step, copy)`` pair (CUDA events, CUDA graphs where they work)."""
    from .kernels import time_call

    return [(time_call(step, warmup=3, repeats=repeats)[0], time_call(copy, warmup=3, repeats=repeats)[0])
            for step, copy in calls]


def _row(what: str, n: int, nbytes: int, t_step: float, t_copy: float) -> dict[str, Any]:
    """One row of the table: time, ns per element, GB/s, and the copy of the same bytes."""
    gbps, copy_gbps = nbytes / t_step / 1e9, 2 * (nbytes // 2) / t_copy / 1e9
    return {"workload": what, "n": n, "bytes": nbytes, "time_s": t_step, "ns_per_element": t_step / n * 1e9,
            "gbps": gbps, "copy_gbps": copy_gbps, "fraction_of_copy": gbps / copy_gbps,
            "copy_ns_per_element": t_copy / n * 1e9}


def _copy_of(nbytes: int, device: str) -> Callable[[], Any]:
    """A plain copy of ``nbytes // 2`` bytes into another buffer: ``nbytes`` read plus written."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def measure(n: int, *, device: str = "cpu", steps: tuple[str, ...] = STEPS, repeats: int = 5) -> dict[str, Any]:
    """A row per step on ``n`` elements (see :func:`_row`; the random roundings also get
    ``vs_nearest``); on CPU with one thread (the caller's thread count is restored)."""
    import torch

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        loads = {name: workload(name, n, device) for name in steps}
        calls = [(step, _copy_of(nbytes, device)) for step, nbytes, _ in loads.values()]
        times = (_time_cpu if device == "cpu" else _time_cuda)(calls, repeats)
    finally:
        torch.set_num_threads(threads)
    rows = {name: _row(what, n, nbytes, *t) for (name, (_, nbytes, what)), t in zip(loads.items(), times)}
    if "quantize_nearest" in rows:
        base = rows["quantize_nearest"]["time_s"]
        for r in ROUNDINGS[1:]:
            if f"quantize_{r}" in rows:
                rows[f"quantize_{r}"]["vs_nearest"] = rows[f"quantize_{r}"]["time_s"] / base
    return rows


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({cpu_model()}), 1 thread"


def format_table(result: dict[str, Any]) -> str:
    per = "ns/elt" if result["threads"] is None else "ns/elt/thr"
    lines = [f"{'step':<28} {per:>10} {'GB/s':>8} {'copy GB/s':>10} {'of copy':>8} {'vs nearest':>11}"]
    for name, r in result["steps"].items():
        vs = f"{r['vs_nearest']:.2f}x" if "vs_nearest" in r else ""
        lines.append(f"{name:<28} {r['ns_per_element']:>10.2f} {r['gbps']:>8.2f} {r['copy_gbps']:>10.2f} "
                     f"{r['fraction_of_copy']:>8.1%} {vs:>11}")
    m = result["meta"]
    lines.append(f"{result['n']:,} elements; {m['device']}; torch {m['torch']}; {result['timing']}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="qsdp bench codecs", description=__doc__.splitlines()[0])
    p.add_argument("--size", default=DEFAULT_SIZE,
                   help=f"elements per step, e.g. 4M (rounded down to a multiple of {ALIGN}; default {DEFAULT_SIZE})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu: the torch reference on one thread; cuda: the Triton kernels (auto: cuda when usable)")
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS, metavar="STEP",
                   help=f"which steps (default all: {', '.join(STEPS)})")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each step (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    return p


def _pick_device(choice: str) -> tuple[str | None, str | None]:
    """(device, None), or (None, why it cannot run)."""
    from .kernels import unavailable_reason

    if choice == "cpu":
        return "cpu", None
    reason = unavailable_reason()
    if reason is None:
        return "cuda", None
    if choice == "auto":
        return "cpu", None
    return None, reason.replace("bench kernels", "bench codecs --device cuda")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        n = parse_size(args.size)
    except ValueError as e:
        parser.error(str(e))
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    device, reason = _pick_device(args.device)
    if device is None:
        print(reason, file=sys.stderr)
        return 2
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    steps = measure(n, device=device, steps=tuple(args.steps), repeats=args.repeats)
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    # The machine's load around the run: CPU time excludes time spent descheduled, not the
    # caches and memory bandwidth that other processes share.
    load = {"before": load_before, "after": os.getloadavg()} if load_before else None
    timing = (f"minimum of {args.repeats} rounds (each runs every step once, each step followed by its copy), "
              "this thread's CPU time" if device == "cpu" else f"median of {args.repeats} runs, CUDA events")
    result = {"meta": meta("codecs", argv, _device_name(device), cpu_affinity=affinity, load_average=load),
              "n": n, "threads": 1 if device == "cpu" else None, "timing": timing, "steps": steps}
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)


if __name__ == "__main__":
    sys.exit(main())
