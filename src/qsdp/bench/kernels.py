"""``qsdp bench kernels``: bandwidth of the fused Triton codec kernels on a CUDA GPU.

For each kernel and size: the bytes the kernel must read and write divided by its time (CUDA
events, warm-up, median of repeats; each timed call is replayed from a CUDA graph when capture
works, so that Python launch overhead does not count), the fraction of a plain device copy of
the same number of bytes measured in the same run, and the speedup over the torch reference
compiled with ``torch.compile`` (and over the eager reference). Every fused result is also
compared, bit for bit, with the eager reference.

The workloads are those of the presets (see :data:`WORKLOADS`). Without a CUDA device (or
without triton) nothing is measured: the command says so and exits with status 2.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Callable
from qsdp.usage import UsageParser

KERNELS = (
    "quantize",
    "hadamard_quantize",
    "dequantize_accumulate",
    "dequantize_requantize",
    "weight_difference_quantize",
    "replica_update",
)
WORKLOADS = {
    "quantize": "bf16 weights -> 8-bit min-max, random shift, group 1024 (qsdp weight gather)",
    "hadamard_quantize": "8 fp32 rows -> Hadamard 32 + 8-bit absmax stochastic, group 128 (sdp4bit intra hop)",
    "dequantize_accumulate": "8 rows 4-bit absmax group 128 -> fp32 sum + inverse Hadamard 32 (sdp4bit last step)",
    "dequantize_requantize": "4 sources x 2 rows 8-bit -> sum -> 4-bit absmax stochastic, group 128 (sdp4bit middle)",
    "weight_difference_quantize": "bf16 shard - bf16 replica -> 4-bit absmax stochastic, group 2048 (sdp4bit qWD)",
    "replica_update": "bf16 replica (8 rows) += dequantized 4-bit group 2048 (sdp4bit qWD, every rank)",
}
ROWS = 8
ALIGN = ROWS * 2048  # sizes are rounded down to whole groups of every row
DEFAULT_SIZES = ("16M", "64M", "256M")


@dataclass
class Workload:
    name: str
    n: int
    nbytes: int  # bytes the fused kernel reads plus bytes it writes
    fused: Callable[[], Any]
    reference: Callable[..., Any]  # a pure torch function of ``args`` (what torch.compile gets)
    args: tuple
    reset: Callable[[], None] = field(default=lambda: None)  # restores in-place inputs


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    mult = units.get(t[-1:], 1)
    value = int(float(t[:-1] if t[-1:] in units else t) * mult)
    if value < ALIGN:
        raise ValueError(f"size {text!r} is below the minimum of {ALIGN} elements")
    return value // ALIGN * ALIGN


def _wire(scales, zeros, codes, rows):
    import torch

    parts = [scales.view(rows, -1).view(torch.uint8)]
    if zeros is not None:
        parts.append(zeros.view(rows, -1).view(torch.uint8))
    parts.append(codes.view(rows, -1))
    return torch.cat(parts, dim=1)


def _unwire(buf, codec, length):
    """A QTensor over all rows of ``buf`` (RowCodec layout, no 4-byte padding)."""
    import torch

    from ..codecs.quantize import QTensor

    rows = buf.shape[0]
    sb = (length // codec.group_size) * 4
    scales = buf[:, :sb].contiguous().view(torch.float32).reshape(-1)
    off, zeros = sb, None
    if not codec.symmetric:
        zeros = buf[:, off:off + sb].contiguous().view(torch.float32).reshape(-1)
        off += sb
    codes = buf[:, off:].reshape(-1)
    return QTensor(codes, scales, zeros, torch.Size([rows * length]), torch.float32,
                   codec.bits, codec.group_size, codec.symmetric)


def _build_quantize(n: int, length: int, randn: Callable[..., Any]) -> Workload:
    import torch
    from ..codecs import quantize
    from ..codecs.quantize import quantize_reference

    x = randn(n, dtype=torch.bfloat16)
    kw = dict(bits=8, group_size=1024, symmetric=False, rounding="shift", seed=1)

    def fused():
        q = quantize(x, check_finite=False, **kw)
        return q.codes, q.scales, q.zeros

    def reference(x):
        return quantize_reference(x, **kw)

    return Workload("quantize", n, 2 * n + n + 8 * (n // 1024), fused, reference, (x,))


def _build_hadamard_quantize(n: int, length: int, randn: Callable[..., Any]) -> Workload:
    from ..codecs import hadamard
    from ..codecs.quantize import quantize_reference
    from ..comm.wire import RowCodec

    codec = RowCodec(bits=8, group_size=128, symmetric=True, rounding="stochastic", hadamard_block=32)
    x = randn(ROWS, length)

    def reference(x):
        codes, scales, zeros = quantize_reference(hadamard(x, block=32).reshape(-1), bits=8, group_size=128,
                                                  symmetric=True, rounding="stochastic", seed=1)
        return _wire(scales, zeros, codes, ROWS)

    return Workload("hadamard_quantize", n, 4 * n + codec.row_nbytes(length) * ROWS,
                    lambda: codec.encode(x, seed=1), reference, (x,))


def _build_dequantize_accumulate(n: int, length: int, randn: Callable[..., Any]) -> Workload:
    from ..codecs import inverse_hadamard
    from ..codecs.quantize import dequantize_reference
    from ..comm.wire import RowCodec, sum_rows

    codec = RowCodec(bits=4, group_size=128, symmetric=True, rounding="stochastic", hadamard_block=32)
    buf = codec.encode(randn(ROWS, length), seed=1)

    def reference(buf):
        vals = dequantize_reference(_unwire(buf, codec, length)).view(ROWS, length)
        return inverse_hadamard(sum_rows(vals), block=32)

    return Workload("dequantize_accumulate", n, buf.numel() + 4 * length,
                    lambda: codec.decode_sum(buf, length, finish=True), reference, (buf,))


def _build_dequantize_requantize(n: int, length: int, randn: Callable[..., Any]) -> Workload:
    from ..codecs.quantize import dequantize_reference, quantize_reference
    from ..comm.wire import RowCodec, sum_rows

    hop1 = RowCodec(bits=8, group_size=128, symmetric=True, rounding="stochastic", hadamard_block=32)
    hop2 = RowCodec(bits=4, group_size=128, symmetric=True, rounding="stochastic", hadamard_block=32)
    buf = hop1.encode(randn(ROWS, length), seed=1)
    sources, dests = 4, ROWS // 4

    def reference(buf):
        vals = dequantize_reference(_unwire(buf, hop1, length)).view(sources, dests, length)
        codes, scales, zeros = quantize_reference(sum_rows(vals).reshape(-1), bits=4, group_size=128,
                                                  symmetric=True, rounding="stochastic", seed=2)
        return _wire(scales, zeros, codes, dests)

    out_bytes = hop2.row_nbytes(length) * dests
    return Workload("dequantize_requantize", n, buf.numel() + out_bytes,
                    lambda: hop1.decode_sum_encode(buf, length, sources=sources, codec=hop2, seed=2),
                    reference, (buf,))


def _build_weight_difference_quantize(n: int, length: int, randn: Callable[..., Any]) -> Workload:
    import torch
    from ..codecs.quantize import quantize_reference
    from ..comm.wire import RowCodec

    codec = RowCodec(bits=4, group_size=2048, symmetric=True, rounding="stochastic")
    replica = randn(n, dtype=torch.bfloat16)
    shard = (replica.float() + 0.01 * randn(n)).bfloat16()

    def reference(shard, replica):
        codes, scales, zeros = quantize_reference(shard.float() - replica.float(), bits=4, group_size=2048,
                                                  symmetric=True, rounding="stochastic", seed=3)
        return _wire(scales, zeros, codes, 1)

    return Workload("weight_difference_quantize", n, 2 * n + 2 * n + codec.row_nbytes(n),
                    lambda: codec.encode_difference(shard.view(1, n), replica.view(1, n), seed=3),
                    reference, (shard, replica))


def _build_replica_update(n: int, length: int, randn: Callable[..., Any]) -> Workload:
    import torch
    from ..codecs.quantize import dequantize_reference
    from ..comm.wire import RowCodec

    codec = RowCodec(bits=4, group_size=2048, symmetric=True, rounding="stochastic")
    start = randn(ROWS, length, dtype=torch.bfloat16)
    replica = start.clone()
    gathered = codec.encode(0.01 * randn(ROWS, length), seed=4)

    def fused():
        codec.decode_into(gathered, length, replica, add=True)
        return replica

    def reference(replica, gathered):
        deltas = dequantize_reference(_unwire(gathered, codec, length)).view(ROWS, length)
        replica.copy_((replica.float() + deltas).to(replica.dtype))
        return replica

    return Workload("replica_update", n, 2 * n + gathered.numel() + 2 * n, fused, reference, (replica, gathered),
                    reset=lambda: replica.copy_(start))


_BUILDERS: dict[str, Callable[..., Workload]] = {
    "quantize": _build_quantize,
    "hadamard_quantize": _build_hadamard_quantize,
    "dequantize_accumulate": _build_dequantize_accumulate,
    "dequantize_requantize": _build_dequantize_requantize,
    "weight_difference_quantize": _build_weight_difference_quantize,
    "replica_update": _build_replica_update,
}


def build(name: str, n: int, device: str = "cuda") -> Workload:
    """The inputs, the fused call (through the codec API, dispatched to Triton on CUDA) and the
    reference (pure torch, the same result) of one kernel on ``n`` elements."""
    import torch

    if name not in _BUILDERS:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(KERNELS)}")
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    return _BUILDERS[name](n, n // ROWS, randn)


def _results_equal(a, b) -> bool:
    import torch

    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_results_equal(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def time_call(fn: Callable[[], Any], *, warmup: int, repeats: int) -> tuple[float, str]:
    """Median seconds of one call, and how it was timed (``cuda_graph`` or ``eager``)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run, how = fn, "eager"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        run, how = graph.replay, "cuda_graph"
    except Exception:  # capture is an optimization of the measurement only
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), how


def measure(names=KERNELS, sizes=DEFAULT_SIZES, *, warmup: int = 3, repeats: int = 20,
            compile_reference: bool = True, log=None) -> dict[str, Any]:
    import torch

    results: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        for size in sizes:
            n = parse_size(size) if isinstance(size, str) else int(size)
            w = build(name, n)
            entry: dict[str, Any] = {"n": n, "bytes": w.nbytes, "workload": WORKLOADS[name]}
            w.reset()
            expected = w.reference(*w.args)
            expected = tuple(t.clone() for t in expected) if isinstance(expected, tuple) else expected.clone()
            w.reset()
            entry["matches_reference"] = _results_equal(w.fused(), expected)
            del expected
            t_fused, how = time_call(w.fused, warmup=warmup, repeats=repeats)
            src = torch.empty(w.nbytes // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            t_copy, _ = time_call(lambda: dst.copy_(src), warmup=warmup, repeats=repeats)
            del src, dst
            t_eager, _ = time_call(lambda: w.reference(*w.args), warmup=1, repeats=max(3, repeats // 4))
            gbps = w.nbytes / t_fused / 1e9
            copy_gbps = 2 * (w.nbytes // 2) / t_copy / 1e9
            entry.update(time_s=t_fused, timing=how, gbps=gbps, copy_gbps=copy_gbps, fraction_of_copy=gbps / copy_gbps,
                         speedup_vs_eager_torch=t_eager / t_fused)
            entry["speedup_vs_compiled_torch"] = None
            if compile_reference:
                try:
                    compiled = torch.compile(w.reference, dynamic=False)
                    t_comp, _ = time_call(lambda: compiled(*w.args), warmup=max(2, warmup), repeats=repeats)
                    entry["speedup_vs_compiled_torch"] = t_comp / t_fused
                except Exception as e:  # report, do not guess
                    entry["compile_error"] = f"{type(e).__name__}: {e}"[:300]
            w.reset()
            results.setdefault(name, []).append(entry)
            if log:
                log(_row(name, entry))
            del w
            torch.cuda.empty_cache()
    kernels = {name: {**runs[-1], "by_size": runs} for name, runs in results.items()}
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(),
            "kernels": kernels}


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


HEADER = f"{'kernel':<28} {'n':>11} {'GB/s':>8} {'of copy':>8} {'vs compiled':>12} {'vs eager':>9} {'exact':>6}"


def _row(name: str, e: dict[str, Any]) -> str:
    comp = e.get("speedup_vs_compiled_torch")
    comp_s = f"{comp:.2f}x" if comp is not None else "n/a"
    return (f"{name:<28} {e['n']:>11,} {e['gbps']:>8.0f} {e['fraction_of_copy']:>8.0%} {comp_s:>12} "
            f"{e['speedup_vs_eager_torch']:>8.2f}x {'yes' if e['matches_reference'] else 'NO':>6}")


def unavailable_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "qsdp bench kernels needs a CUDA GPU: torch.cuda.is_available() is False here; nothing was measured"
    from ..codecs.dispatch import triton_available

    if not triton_available():
        return "qsdp bench kernels needs triton (pip install 'qsdp[gpu]'); nothing was measured"
    import os

    if os.environ.get("QSDP_DISABLE_TRITON") == "1":
        return "QSDP_DISABLE_TRITON=1 is set: the fused kernels are switched off; nothing was measured"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(prog="qsdp bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES),
                        help="elements per kernel, e.g. 16M 64M 256M (rounded down to whole groups)")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS, metavar="NAME",
                        help=f"which kernels (default all: {', '.join(KERNELS)})")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    try:
        for s in args.sizes:
            parse_size(s)
    except ValueError as e:
        parser.error(str(e))
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    reason = unavailable_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    log = None if args.json else print
    if log:
        print(HEADER)
    result = measure(args.kernels, args.sizes, warmup=args.warmup, repeats=args.repeats,
                     compile_reference=not args.no_compile, log=log)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"device: {result['device']}, torch {result['torch']}, triton {result['triton']}")
    return 0 if all(r["matches_reference"] for k in result["kernels"].values() for r in k["by_size"]) else 1


if __name__ == "__main__":
    sys.exit(main())
