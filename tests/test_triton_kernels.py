"""The fused Triton kernels give exactly the bytes of the torch reference.

Every comparison is bit for bit (``same``: equal shapes, dtypes and bit patterns) between a codec
step run by the kernels and the same step run by the reference on CPU, the oracle.

The file runs in three modes (``QSDP_TRITON_TEST_MODE``):

* ``driver`` (plain pytest, CPU CI included): :func:`test_interpreter_suite` re-runs this file
  in a subprocess in ``interpret`` mode, :func:`test_kernels_compile_for_sm90` in ``compile``
  mode; both skip when triton is not installed. Triton's interpreter must be switched on before
  triton is first imported, hence the subprocess; it starts with the run, at low priority, and
  the driver waits for it (tests/prestarted.py).
* ``interpret``: ``TRITON_INTERPRET=1`` and ``QSDP_TRITON_ON_CPU=1``: the kernels run on CPU
  tensors under the interpreter and the codec functions dispatch to them. The interpreter's
  float min/max are first given the GPU's NaN rule (:func:`_interpret_with_gpu_nan_semantics`);
  the tests of non-finite inputs also give its float operations the GPU's canonical NaN
  (:func:`_interpret_with_gpu_nan_results`).
* ``compile``: the kernels are compiled for sm_90 (no GPU needed) and the PTX is checked for
  what would break exactness on a GPU: FMA contraction, approximate division, flushed denormals.

The ``gpu`` tests (``pytest -m gpu``) run the same comparisons on CUDA tensors.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os

import pytest
import torch

from prestarted import PRESTARTED, Command

MODE = os.environ.get("QSDP_TRITON_TEST_MODE", "driver")
HAVE_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = "triton is not installed (pip install 'qsdp[gpu]' or the triton wheel)"

interpret_only = pytest.mark.skipif(MODE != "interpret", reason="runs in the interpreter subprocess of test_interpreter_suite")
compile_only = pytest.mark.skipif(MODE != "compile", reason="runs in the compile subprocess of test_kernels_compile_for_sm90")


def _interpret_with_gpu_nan_semantics() -> None:
    """Make Triton's interpreter take NaN where the GPU does. It runs every float min/max and
    clamp with numpy's NaN-keeping ``np.maximum`` / ``np.clip``, while on the GPU the default
    (``propagate_nan=NONE``: PTX ``max.f32``, IEEE maxNum) returns the other operand; only
    ``propagate_nan=ALL`` keeps NaN (``max.NaN.f32``). (Its reductions already drop NaN, as the
    GPU's do.) Without this, a kernel that differs from the reference on the GPU alone, for
    NaN or infinite inputs, passes here."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder as builder

    keep_nan = int(tl.PropagateNan.ALL)

    def num_clip(v, lo, hi):
        return np.fmin(np.fmax(v, lo), hi)

    def clampf(self, x, lo, hi, propagate_nan):
        return self.ternary_op(x, lo, hi, np.clip if int(propagate_nan) == keep_nan else num_clip)

    builder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    builder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)
    builder.create_clampf = clampf


def _interpret_with_gpu_nan_results(patch) -> None:
    """Make Triton's interpreter return the NaN the GPU's float arithmetic returns: NVIDIA's
    canonical NaN (``0x7FFFFFFF`` in fp32, ``0x7FFF`` in fp16), whatever the operands' payloads,
    where numpy (like x86) keeps a NaN operand's payload. Every interpreted float operation that
    can produce a NaN (arithmetic, conversions, min/max, clamp) gets this rule (``patch``: the
    ``setattr`` that installs it), so a kernel whose bytes depend on a NaN's payload differs from
    the reference here as it does on the GPU."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder as builder
    from triton.runtime.interpreter import TensorHandle

    canonical = {np.dtype(np.float32): (np.uint32, 0x7FFFFFFF), np.dtype(np.float16): (np.uint16, 0x7FFF)}

    def canonicalized(op):
        def run(self, *args):
            out = op(self, *args)
            rule = canonical.get(np.asarray(out.data).dtype)
            nan = None if rule is None else np.isnan(out.data)
            if nan is None or not nan.any():
                return out
            data = np.array(out.data, copy=True)  # the op may have returned a view of an operand
            data.view(rule[0])[nan] = rule[1]
            return TensorHandle(data, out.dtype)

        return run

    for name in ("create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_precise_divf", "create_frem",
                 "create_fma", "create_floor", "create_ceil", "create_sqrt", "create_precise_sqrt", "create_rsqrt",
                 "create_exp", "create_exp2", "create_log", "create_log2", "create_sin", "create_cos", "create_erf",
                 "create_minnumf", "create_maxnumf", "create_minimumf", "create_maximumf", "create_clampf",
                 "create_fp_to_fp", "create_fp_trunc", "create_fp_ext"):
        patch(builder, name, canonicalized(getattr(builder, name)))


if MODE == "interpret":
    _interpret_with_gpu_nan_semantics()


@pytest.fixture
def gpu_nan_results(monkeypatch):
    """The interpreter's NaN results made the GPU's for one test (see
    :func:`_interpret_with_gpu_nan_results`; the inputs of the others are finite, and the check
    costs time on every operation)."""
    _interpret_with_gpu_nan_results(monkeypatch.setattr)


def _gpu_skip_reason() -> str | None:
    if MODE != "driver":
        return "GPU tests run in the main pytest process only"
    if not HAVE_TRITON:
        return NO_TRITON
    if not torch.cuda.is_available():
        return "no CUDA device"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 is set"
    return None


def gpu_test(fn):
    """``@pytest.mark.gpu``, skipped with the reason when it cannot run here."""
    reason = _gpu_skip_reason()
    return pytest.mark.gpu(pytest.mark.skipif(reason is not None, reason=str(reason))(fn))

BITS = (2, 4, 8)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # every input dtype the kernels accept
ROUNDINGS = ("nearest", "stochastic", "shift")
SCHEMES = list(itertools.product(BITS, (True, False), ROUNDINGS))  # (bits, symmetric, rounding)


def sid(s) -> str:
    bits, symmetric, rounding = s
    return f"{bits}b-{'sym' if symmetric else 'minmax'}-{rounding}"


# ----------------------------------------------------------------------------- drivers


def _mode_command(mode: str, shard: str | None = None) -> Command | None:
    """The pytest subprocess of this file in ``mode`` (``None`` where the driver does not run)."""
    if MODE != "driver" or not HAVE_TRITON:
        return None
    set_env = {"QSDP_TRITON_TEST_MODE": mode, "PYTHONHASHSEED": "0"}
    drop_env: tuple[str, ...] = ("QSDP_TEST_SHARD",)
    if shard is not None:
        set_env["QSDP_TEST_SHARD"] = shard  # tests/conftest.py: this part of the suite only
    if mode == "interpret":
        set_env.update(TRITON_INTERPRET="1", QSDP_TRITON_ON_CPU="1")
    else:
        drop_env += ("TRITON_INTERPRET", "QSDP_TRITON_ON_CPU")
    return Command.pytest(__file__, set_env=set_env, drop_env=drop_env)


def _run_mode(request, mode: str, timeout: float, shard: str | None = None) -> None:
    rc, out = PRESTARTED.result(request.node.nodeid, _mode_command(mode, shard), timeout)
    assert rc == 0, f"{mode} subprocess failed (rc={rc}):\n{out[-8000:]}"
    assert " passed" in out and "no tests ran" not in out, out[-2000:]


# The interpreter suite in parts (every INTERPRET_SHARDS-th test each): whole, it took 52 s on
# 2 cores, past make test's 30 s a test.
INTERPRET_SHARDS = 3


@pytest.mark.skipif(MODE != "driver", reason="the driver itself")
@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
@pytest.mark.parametrize("shard", [f"{i}/{INTERPRET_SHARDS}" for i in range(INTERPRET_SHARDS)],
                         ids=[f"part{i + 1}of{INTERPRET_SHARDS}" for i in range(INTERPRET_SHARDS)])
@pytest.mark.prestart(lambda shard: _mode_command("interpret", shard))
def test_interpreter_suite(request, shard):
    _run_mode(request, "interpret", timeout=280, shard=shard)


@pytest.mark.skipif(MODE != "driver", reason="the driver itself")
@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
@pytest.mark.prestart(lambda: _mode_command("compile"))
def test_kernels_compile_for_sm90(request):
    _run_mode(request, "compile", timeout=280)


# ----------------------------------------------------------------------------- comparison helpers


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same(a, b, what: str = "") -> None:
    """Bit-for-bit equality of tensors (or tuples / None)."""
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{what}[{i}]")
        return
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    x, y = _bits(a), _bits(b)
    diff = (x != y).sum().item()
    assert diff == 0, f"{what}: {diff} of {x.numel()} elements differ; first at {(x != y).reshape(-1).nonzero()[:5].flatten().tolist()}"


@contextlib.contextmanager
def reference():
    old = os.environ.get("QSDP_DISABLE_TRITON")
    os.environ["QSDP_DISABLE_TRITON"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["QSDP_DISABLE_TRITON"]
        else:
            os.environ["QSDP_DISABLE_TRITON"] = old


class Launches:
    """Counts kernel launches, so that a comparison cannot pass by silently using the reference."""

    def __init__(self, monkeypatch):
        from qsdp.codecs import triton_kernels as tk

        self.n = 0
        for name in ("quantize_into", "dequantize_into"):
            fn = getattr(tk, name)

            def counted(*a, _fn=fn, **k):
                self.n += 1
                return _fn(*a, **k)

            monkeypatch.setattr(tk, name, counted)


@pytest.fixture
def launches(monkeypatch):
    return Launches(monkeypatch)


def compare(build, device: str, launches: Launches | None = None):
    """``build(device)`` returns tensors computed by the codec functions from inputs made on CPU
    (deterministic) and moved to ``device``; compared with the CPU reference, bit for bit."""
    with reference():
        expected = build("cpu")
    before = launches.n if launches is not None else 0
    got = build(device)
    if launches is not None:
        assert launches.n > before, "the Triton kernels were not used"
    same(got, expected)
    return got


def data(n: int, *, seed: int = 0, dtype=torch.float32, special: bool = True) -> torch.Tensor:
    """Gradient-like values: heavy tails, outliers, exact ties, signed zeros, a constant run, and
    a group so wide that its small elements divided by the scale are denormal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    if special and n >= 64:
        x[::37] *= 50
        x[3:20] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.0, -0.0, 3.5, -3.5, 0.0, -0.0, 7.0, -7.0, 1.0, -1.0, 0.25])
        x[20:40] = 1.25
        if dtype != torch.float16:  # a huge range: x / scale is denormal for the small elements
            x[40:48] = torch.tensor([7e30, -1e-10, 1e-10, -3e-9, 2e-12, -5e-11, 0.0, -1e-10])
    return x.to(dtype)


# ----------------------------------------------------------------------------- the checks (any device)


def check_quantize(device, n, group_size, dtype, scheme, launches=None, special=True):
    from qsdp.codecs import dequantize, quantize

    bits, symmetric, rounding = scheme
    x = data(n, seed=n + group_size, dtype=dtype, special=special)

    def build(dev):
        q = quantize(x.to(dev), bits=bits, group_size=group_size, symmetric=symmetric, rounding=rounding, seed=n)
        return q.codes, q.scales, q.zeros, dequantize(q), dequantize(q, dtype=torch.bfloat16), dequantize(q, dtype=torch.float16)

    compare(build, device, launches)


def _codec(bits, symmetric, rounding, group_size, hadamard_block=0):
    from qsdp.comm.wire import RowCodec

    return RowCodec(bits=bits, group_size=group_size, symmetric=symmetric, rounding=rounding, hadamard_block=hadamard_block)


def check_rows(device, rows, length, group_size, hadamard_block, scheme, launches=None, dtype=torch.float32,
               out_dtype=torch.bfloat16):
    """encode (Hadamard fused) of ``dtype`` rows, decode, decode_into ``out_dtype`` rows,
    decode_sum (inverse Hadamard fused)."""
    codec = _codec(*scheme, group_size, hadamard_block)
    x = data(rows * length, seed=length, dtype=dtype).view(rows, length)
    base = torch.zeros(rows, length, dtype=out_dtype)

    def build(dev):
        buf = codec.encode(x.to(dev), seed=11)
        into = base.to(dev, copy=True)
        codec.decode_into(buf, length, into)
        return (buf, codec.decode(buf, length), codec.decode(buf, length, keep_padding=True), into,
                codec.decode_sum(buf, length), codec.decode_sum(buf, length, finish=True))

    compare(build, device, launches)


def check_transformed(device, scheme, launches=None, dtype=torch.float32):
    """encode(transformed=True): rows already in the Hadamard domain are not transformed again."""
    codec = _codec(*scheme, 32, 32)
    x = data(3 * 96, seed=5, dtype=dtype).view(3, 96)
    compare(lambda dev: codec.encode(x.to(dev), seed=3, transformed=True), device, launches)


def check_difference(device, rows, length, group_size, dtype, scheme, launches=None, shard_dtype=None):
    """The weight-difference gather: encode(shard - replica), replica += decode(all rows). The
    shard is in ``shard_dtype`` (default: the replica's ``dtype``); every value is finite."""
    codec = _codec(*scheme, group_size)
    shard_dtype = shard_dtype or dtype
    replica = data(rows * length, seed=1, dtype=dtype).view(rows, length)
    # The update's huge-range elements only where both dtypes hold them (in fp16, 0.01 * 7e30
    # is inf: non-finite shards have their own test).
    narrow = torch.float16 in (dtype, shard_dtype)
    update = data(length, seed=2, dtype=torch.float16 if narrow else torch.float32).float()
    shard = (replica[1].float() + 0.01 * update).to(shard_dtype).view(1, length)
    assert torch.isfinite(shard).all() and torch.isfinite(replica).all()

    def build(dev):
        rep = replica.to(dev, copy=True)
        send = codec.encode_difference(shard.to(dev), rep[1:2], seed=9)
        others = [codec.encode_difference(rep[r:r + 1] * 0.5, rep[r:r + 1], seed=10 + r) for r in range(rows)]
        gathered = torch.cat([send if r == 1 else others[r] for r in range(rows)])
        codec.decode_into(gathered, length, rep, add=True)
        return send, rep

    compare(build, device, launches)


def check_middle(device, sources, dests, length, hop1, hop2, group_size, hadamard_block, launches=None):
    """The two-level middle step: dequantize, sum over sources, requantize (hop2)."""
    c1 = _codec(*hop1, group_size, hadamard_block)
    c2 = _codec(*hop2, group_size, hadamard_block)
    x = data(sources * dests * length, seed=3).view(sources * dests, length)
    buf = c1.encode(x, seed=4)  # CPU reference bytes, the same input on both sides

    def build(dev):
        mid = c1.decode_sum_encode(buf.to(dev), length, sources=sources, codec=c2, seed=6)
        return mid, c2.decode_sum(mid, length, finish=True)

    compare(build, device, launches)


def check_nonfinite_quantize(device, dtype, scheme, launches=None):
    """NaN and infinite inputs: the same scales (non-finite in the same groups) and the same
    codes in every group, finite or not."""
    from qsdp.codecs import quantize

    bits, symmetric, rounding = scheme
    x = data(512, dtype=dtype)
    x[5], x[100], x[300], x[301] = float("nan"), float("inf"), -float("inf"), float("inf")

    def build(dev):
        q = quantize(x.to(dev), bits=bits, group_size=64, symmetric=symmetric, rounding=rounding, seed=1,
                     check_finite=False)
        return q.codes, q.scales, q.zeros

    compare(build, device, launches)


def check_nonfinite_difference(device, dtype, scheme, launches=None):
    """A shard holding an infinity and a NaN: the same bytes on the wire, and a replica update
    that is NaN exactly where the reference's is and bit-identical elsewhere (a NaN's sign and
    payload are the hardware's: x86's ``0 * inf`` is a negative NaN, CUDA's a positive one)."""
    codec = _codec(*scheme, 64)
    replica = data(2 * 300, seed=1, dtype=dtype).view(2, 300)
    shard = replica[1:2].clone()
    shard[0, 5], shard[0, 200] = float("inf"), float("nan")

    def build(dev):
        rep = replica.to(dev, copy=True)
        send = codec.encode_difference(shard.to(dev), rep[1:2], seed=9)
        codec.decode_into(send, 300, rep[1:2], add=True)
        return send, rep.cpu()

    with reference():
        want_send, want_rep = build("cpu")
    before = launches.n if launches is not None else 0
    send, rep = build(device)
    assert launches is None or launches.n > before, "the Triton kernels were not used"
    same(send, want_send, "send")
    nan = want_rep.isnan()
    assert nan.any() and torch.equal(rep.isnan(), nan), "NaN positions differ"
    same(rep[~nan], want_rep[~nan], "replica")


# ----------------------------------------------------------------------------- the reference's fixed orders
# (no triton needed: these pin down what the kernels reproduce)


def test_reference_hadamard_is_the_documented_butterfly():
    """Stage k combines the elements whose in-block index differs in bit k: (a, b) -> (a + b, a - b)."""
    import numpy as np

    from qsdp.codecs import hadamard, inverse_hadamard

    x = data(4 * 32, seed=4)
    y = x.numpy().astype(np.float32).reshape(-1, 32).copy()
    h = 1
    while h < 32:
        for j in range(32):
            if not j & h:
                a, b = y[:, j].copy(), y[:, j + h].copy()
                y[:, j], y[:, j + h] = a + b, a - b
        h *= 2
    same(hadamard(x), torch.from_numpy(y.reshape(-1)))
    same(inverse_hadamard(x), torch.from_numpy(y.reshape(-1) * np.float32(1 / 32)))


def test_reference_row_sums_go_left_to_right():
    from qsdp.comm.wire import sum_rows

    x = torch.tensor([[1e8], [1.0], [-1e8], [1.0]])
    assert sum_rows(x).item() == 1.0  # fp32: (1e8 + 1) - 1e8 == 0, then + 1
    rows = data(5 * 300, seed=6).view(5, 300)
    same(sum_rows(rows), (((rows[0] + rows[1]) + rows[2]) + rows[3]) + rows[4])


def test_reference_zero_points_and_scales_of_signed_zeros_are_positive_zero():
    """Which signed zero amin/amax return depends on the reduction order; the reference makes
    it +0.0 so that any implementation gives the same bytes."""
    from qsdp.codecs import quantize

    x = torch.tensor([-0.0, 0.0, -0.0, 0.0] * 8 + [-0.0] * 32)
    q = quantize(x, bits=4, group_size=32, symmetric=False, rounding="nearest")
    assert q.zeros.view(torch.int32).tolist() == [0, 0] and q.scales.view(torch.int32).tolist() == [0, 0]


@pytest.mark.skipif(MODE == "interpret", reason="the interpreter sends CPU tensors to the kernels")
def test_the_codecs_that_ran_are_recorded_per_process():
    from qsdp.codecs import dequantize, quantize
    from qsdp.codecs.usage import implementations_run

    implementations_run(reset=True)
    assert implementations_run() == "none"
    q = quantize(data(300), bits=4, group_size=64, symmetric=True, rounding="nearest")
    assert implementations_run() == "torch"  # CPU tensors: the reference
    dequantize(q)
    assert implementations_run(reset=True) == "torch" and implementations_run() == "none"


# ----------------------------------------------------------------------------- interpreter tests

FLAT_CASES = [  # (n, group_size, dtype)
    (1, 8, torch.float32),
    (1001, 8, torch.float32),
    (777, 24, torch.bfloat16),
    (1000, 128, torch.float16),
    (2500, 1000, torch.float32),
]


@interpret_only
@pytest.mark.parametrize("scheme", SCHEMES, ids=sid)
@pytest.mark.parametrize("n,group_size,dtype", FLAT_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_quantize_and_dequantize_match_the_reference(launches, scheme, n, group_size, dtype):
    check_quantize("cpu", n, group_size, dtype, scheme, launches)


@interpret_only
@pytest.mark.parametrize("scheme", [(2, False, "shift"), (4, True, "stochastic"), (8, False, "nearest")], ids=sid)
@pytest.mark.parametrize("group_size", [200, 256])
def test_groups_larger_than_a_tile_are_processed_in_chunks(launches, monkeypatch, scheme, group_size):
    from qsdp.codecs import triton_kernels as tk

    monkeypatch.setattr(tk, "MAX_TILE", 64)
    check_quantize("cpu", 1100, group_size, torch.float32, scheme, launches)
    check_rows("cpu", 2, 500, group_size, 32 if group_size == 256 else 0, scheme, launches)


@interpret_only
@pytest.mark.parametrize("scheme", [(4, True, "stochastic", 32), (8, False, "shift", 0), (2, True, "nearest", 0)],
                         ids=lambda v: "-".join(map(str, v)))
def test_a_kept_launch_given_again_gives_the_bytes_of_a_new_one(scheme):
    # What a plan's steady call does: the first call's Launch given new tensors and the key
    # looked up for its seed (CallSeeds(keys=...)), against a launch derived for them.
    from qsdp.codecs import rng
    from qsdp.codecs import triton_kernels as tk
    from qsdp.comm.wire import RowCodec

    bits, symmetric, rounding, hb = scheme
    codec = RowCodec(bits=bits, group_size=128, symmetric=symmetric, rounding=rounding, hadamard_block=hb)
    x, y = (torch.randn(3, 1000, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    with tk.recording() as made:
        codec.encode(x, seed=11)
    expected = codec.encode(y, seed=12)
    table = rng.CallSeeds(7, ((1,),), keys=(made[0].keying,))
    assert table(0)[0] == rng.launch_key(rng.CallSeeds(7, ((1,),))(0)[0], made[0].keying)
    got = torch.zeros_like(expected)
    tk.quantize_again(made[0], y, got, rng.launch_key(12, made[0].keying))
    same(got, expected)
    with tk.recording() as decoding:
        out = codec.decode(expected, 1000)
    again = torch.zeros_like(out)
    tk.dequantize_again(decoding[0], expected, again)
    same(again, out)


@interpret_only
def test_more_rows_than_a_grid_holds_are_launched_in_several_grids(launches, monkeypatch):
    from qsdp.codecs import triton_kernels as tk

    monkeypatch.setattr(tk, "_MAX_GRID_ROWS", 2)
    check_rows("cpu", 5, 100, 32, 32, (4, True, "stochastic"), launches)
    check_difference("cpu", 5, 100, 32, torch.bfloat16, (4, False, "shift"), launches)
    check_middle("cpu", 2, 5, 64, (8, True, "stochastic"), (4, True, "stochastic"), 32, 0, launches)


@interpret_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", [(4, True, "nearest"), (8, False, "stochastic"), (2, True, "shift")], ids=sid)
def test_non_finite_inputs_give_the_same_scales_and_codes(launches, gpu_nan_results, scheme, dtype):
    check_nonfinite_quantize("cpu", dtype, scheme, launches)


@interpret_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", [(4, True, "stochastic"), (8, False, "shift")], ids=sid)
def test_non_finite_shard_gives_the_same_difference_bytes_and_nan_replica(launches, gpu_nan_results, scheme, dtype):
    check_nonfinite_difference("cpu", dtype, scheme, launches)


def check_slice_run(device, run_first, count, hop1, hop2, per, end, launches=None):
    """A run of ``count`` rounding slices starting at slice ``run_first`` (the grouping of a large
    shard's exchanges, e.g. slices 2 and 3 of 4) through the three codec steps of the two-level
    reduce-scatter: the same bytes as the reference, each slice with its own seed."""
    from qsdp.comm.wire import RowCodec, SliceRun

    c1, c2 = RowCodec(**hop1), RowCodec(**hop2)
    run = SliceRun(first=run_first, count=count, per=per, end=end)
    world, nodes = 4, 2

    def build(dev):
        x = data(world * end).view(world, end).to(dev)
        order = torch.tensor([2, 0, 3, 1], device=dev)
        send = torch.empty(world, run.nbytes(c1), dtype=torch.uint8, device=dev)
        c1.encode_slices(x, run, prefix=9, out=send, order=order)
        mid = torch.empty(nodes, run.nbytes(c2), dtype=torch.uint8, device=dev)
        c1.decode_sum_encode_slices(send, run, sources=world // nodes, codec=c2, prefix=10, out=mid)
        total = torch.full((end,), 7.0, device=dev)
        c2.decode_sum_slices(mid, run, total)
        return send, mid, total

    before = launches.n if launches is not None else 0
    compare(build, device, launches)
    if launches is not None:  # one launch a step for all the run's slices: the fused run itself
        assert launches.n - before == 3


SLICE_RUNS = [  # (first slice, slices, per, end): runs that start after slice 0
    (2, 2, 256, 4 * 256),        # slices 2-3 of 4: a large shard's second exchange on 2 x 2
    (1, 3, 128, 4 * 128 - 64),   # slices 1-3, the last one shorter
]


@interpret_only
@pytest.mark.parametrize("first,count,per,end", SLICE_RUNS, ids=str)
def test_a_run_of_several_slices_after_the_first_matches_the_reference(launches, first, count, per, end):
    check_slice_run("cpu", first, count, dict(bits=8, group_size=64, hadamard_block=32),
                    dict(bits=4, group_size=64, hadamard_block=32), per, end, launches)


@interpret_only
def test_a_kernel_run_is_recorded_as_triton(launches):
    from qsdp.codecs.usage import implementations_run

    implementations_run(reset=True)
    check_quantize("cpu", 200, 64, torch.float32, (8, True, "nearest"), launches)  # the reference first
    assert implementations_run(reset=True) == "torch+triton"
    _codec(4, True, "nearest", 64).encode(data(128).view(1, 128), seed=1)
    assert implementations_run() == "triton"


@interpret_only
def test_floor_round_and_uniform_helpers_match_torch():
    import triton
    import triton.language as tl

    from qsdp.codecs import rng

    global tk  # the kernel below looks its helpers up in the module's globals
    from qsdp.codecs import triton_kernels as tk

    @triton.jit
    def helpers(x_ptr, f_ptr, r_ptr, u_ptr, key, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        tl.store(f_ptr + i, tk._floor(x))
        tl.store(r_ptr + i, tk._rint(x))
        tl.store(u_ptr + i, tk._uniform((i.to(tl.int64) + 4294967000).to(tl.uint32), key.to(tl.uint32)))

    special = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.49999997, 1e-40, -1e-40, 0.0, -0.0,
               8388607.5, -8388607.5, 8388608.0, 16777217.0, 3e38, -3e38, 254.5, 255.5, -127.5]
    x = torch.cat([torch.tensor(special), torch.randn(1024 - len(special)) * 300])
    f, r, u = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    key = rng.seed_key(12345, 1)
    helpers[(1,)](x, f, r, u, key, N=1024)
    assert torch.equal(f, torch.floor(x)) and torch.equal(r, torch.round(x))  # == ignores the sign of 0
    same(u, rng.uniform(12345, 1024, offset=4294967000, stream=1))


ROW_CASES = [  # (rows, length, group_size, hadamard_block)
    (3, 100, 16, 0),
    (2, 300, 128, 32),
    (3, 70, 8, 32),     # small groups inside a Hadamard block
    (2, 200, 96, 32),   # a non power-of-two group of whole blocks
    (2, 100, 24, 32),   # blocks straddle groups: the transform is not fused (exact torch butterfly)
]


@interpret_only
@pytest.mark.parametrize("scheme", SCHEMES, ids=sid)
@pytest.mark.parametrize("rows,length,group_size,hadamard_block", ROW_CASES, ids=str)
def test_row_codec_steps_match_the_reference(launches, scheme, rows, length, group_size, hadamard_block):
    check_rows("cpu", rows, length, group_size, hadamard_block, scheme, launches)


@interpret_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_of_every_dtype_and_pretransformed_rows(launches, dtype):
    check_rows("cpu", 2, 150, 32, 32, (4, True, "stochastic"), launches, dtype=dtype, out_dtype=dtype)
    check_rows("cpu", 2, 150, 64, 0, (8, False, "shift"), launches, dtype=dtype, out_dtype=dtype)
    check_transformed("cpu", (4, True, "stochastic"), launches, dtype=dtype)


MIXED_DTYPES = [(torch.bfloat16, torch.float32), (torch.float32, torch.float16), (torch.float16, torch.bfloat16)]


@interpret_only
@pytest.mark.parametrize("scheme", [(4, True, "stochastic"), (8, False, "shift"), (2, True, "nearest")], ids=sid)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_difference_and_replica_update_match_the_reference(launches, scheme, dtype):
    check_difference("cpu", 3, 333, 64, dtype, scheme, launches)


@interpret_only
@pytest.mark.parametrize("dtype,shard_dtype", MIXED_DTYPES, ids=str)
def test_weight_difference_of_a_shard_and_replica_of_different_dtypes(launches, dtype, shard_dtype):
    check_difference("cpu", 2, 200, 64, dtype, (4, True, "stochastic"), launches, shard_dtype=shard_dtype)


@interpret_only
@pytest.mark.parametrize(
    "hop1,hop2,group_size,hadamard_block",
    [
        ((8, True, "stochastic"), (4, True, "stochastic"), 128, 32),
        ((4, True, "nearest"), (4, True, "shift"), 32, 0),
        ((8, False, "stochastic"), (2, False, "stochastic"), 64, 0),
        ((8, True, "stochastic"), (4, False, "nearest"), 16, 32),
    ],
    ids=str,
)
def test_dequantize_sum_requantize_matches_the_reference(launches, hop1, hop2, group_size, hadamard_block):
    check_middle("cpu", 3, 2, 256, hop1, hop2, group_size, hadamard_block, launches)


def _collectives_fused_vs_reference(rank, world):
    import torch.distributed as dist

    import qsdp
    from qsdp.comm import DifferenceAllGather, QuantizedReduceScatter, build_topology

    grads = qsdp.GradComm("two_level", bits_intra=8, bits_inter=4, group_size=32, symmetric=True,
                          rounding="stochastic", hadamard_block=32, pipeline_slices=3,
                          pipeline_min_slice=1)
    weights = qsdp.WeightComm("difference", bits=4, group_size=64, symmetric=True, rounding="stochastic")
    cfg = qsdp.QuantConfig(grads=grads, weights=weights, seed=5, min_shard_numel=1)
    g = torch.Generator().manual_seed(rank)
    grad = torch.randn(world * 200, generator=g)
    from qsdp.codecs import triton_kernels as tk

    calls = []
    # a step's first launch (``_into``) and a plan's launch of it again (``_again``) alike
    for name in ("quantize_into", "dequantize_into", "quantize_again", "dequantize_again"):
        def counted(*a, _fn=getattr(tk, name), _name=name.split("_")[0], **k):
            calls.append(_name)
            return _fn(*a, **k)

        setattr(tk, name, counted)  # a forked child: the patch dies with it
    results = []
    for disable in (True, False):
        ctx = reference() if disable else contextlib.nullcontext()
        with ctx:
            rs = QuantizedReduceScatter(cfg, build_topology(), 0)
            out = torch.empty(200)
            rs(output_tensor=out, input_tensor=grad, group=dist.group.WORLD, op=dist.ReduceOp.AVG)
            ag = DifferenceAllGather(cfg, build_topology(), 1)
            flat = torch.zeros(world * 150, dtype=torch.bfloat16)
            gathered = []
            for step in range(3):
                shard = flat.view(world, 150)[rank]
                shard.copy_(torch.randn(150, generator=torch.Generator().manual_seed(100 * step + rank)).bfloat16())
                ag(output_tensor=flat, input_tensor=shard, group=dist.group.WORLD)
                gathered.append(flat.clone())
        results.append((out, torch.stack(gathered)))
    same(results[1], results[0], f"rank {rank}")
    # two-level: encode (Hadamard fused), dequantize-sum-requantize, dequantize-sum-inverse per
    # slice; weight difference: encode_difference and the replica update per quantized gather
    assert calls.count("quantize") == 3 + 2 and calls.count("dequantize") == 3 * 2 + 2, calls
    return True


@interpret_only
def test_collectives_give_the_same_bytes_with_the_kernels():
    from distributed import run_pooled

    assert all(run_pooled(_collectives_fused_vs_reference, 4, local_world_size=2, timeout=200))


@interpret_only
@pytest.mark.parametrize("name", ["quantize", "hadamard_quantize", "dequantize_accumulate", "dequantize_requantize",
                                  "weight_difference_quantize", "replica_update"])
def test_benchmark_workloads_fused_equal_their_reference(launches, name):
    from qsdp.bench import kernels as bench

    w = bench.build(name, bench.ALIGN, device="cpu")
    expected = w.reference(*w.args)
    expected = tuple(t.clone() for t in expected) if isinstance(expected, tuple) else expected.clone()
    w.reset()
    got = w.fused()
    assert launches.n > 0
    same(got, expected)


# ----------------------------------------------------------------------------- compile checks


@compile_only
def test_kernels_compile_for_sm90_without_fma_approximate_division_or_ftz():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qsdp.codecs import triton_kernels as tk

    common_q = {"x_ptr": "*fp32", "y_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*fp32", "zeros_ptr": "*fp32",
                "order_ptr": "*i64",
                **{k: "i32" for k in ("L", "G", "NC", "NCB", "x_rs", "y_rs", "code_rs", "code_off", "scale_rs",
                                      "scale_off", "zero_off", "key", "row0", "SG", "SW", "slice0")}}
    common_d = {"codes_ptr": "*u8", "scales_ptr": "*fp32", "zeros_ptr": "*fp32", "out_ptr": "*fp32",
                "q_codes_ptr": "*u8", "q_scales_ptr": "*fp32", "q_zeros_ptr": "*fp32",
                **{k: "i32" for k in ("ROW_O", "ROW_J", "G", "NCB", "code_rs", "code_off", "scale_rs", "scale_off",
                                      "zero_off", "L_OUT", "out_rs", "q_NCB", "q_code_rs", "q_code_off", "q_scale_rs",
                                      "q_scale_off", "q_zero_off", "key", "row0", "SG", "SW", "Q_SW", "slice0")},
                "flag_ptr": "*i32"}
    variants = [
        (tk._quantize_kernel, common_q, dict(GS=128, BG=128, GPP=32, NCH=1, BITS=4, SYMMETRIC=True, ROUNDING=1,
                                             HB=32, HB_LOG=5, X_KIND=0, Y_KIND=-1)),
        (tk._quantize_kernel, {**common_q, "x_ptr": "*i16", "y_ptr": "*i16"},
         dict(GS=8192, BG=4096, GPP=1, NCH=2, BITS=2, SYMMETRIC=False, ROUNDING=2, HB=0, HB_LOG=0, X_KIND=1, Y_KIND=1)),
        (tk._dequantize_kernel, {**common_d, "out_ptr": "*i16"},
         dict(K=4, GS=2048, BG=2048, GPP=2, NCH=1, BITS=4, SYMMETRIC=False, HB=0, HB_LOG=0, MODE=0, OUT_KIND=1,
              ADD=True, Q_BITS=8, Q_SYMMETRIC=True, Q_ROUNDING=0)),
        (tk._dequantize_kernel, common_d,
         dict(K=8, GS=128, BG=128, GPP=32, NCH=1, BITS=8, SYMMETRIC=True, HB=32, HB_LOG=5, MODE=0, OUT_KIND=0,
              ADD=False, Q_BITS=8, Q_SYMMETRIC=True, Q_ROUNDING=0)),
        (tk._dequantize_kernel, common_d,
         dict(K=8, GS=128, BG=128, GPP=32, NCH=1, BITS=8, SYMMETRIC=True, HB=0, HB_LOG=0, MODE=1, OUT_KIND=0,
              ADD=False, Q_BITS=4, Q_SYMMETRIC=True, Q_ROUNDING=1)),
        # the two-level reduce-scatter's steps, rounding slices a grid axis
        (tk._quantize_kernel, {**common_q, "x_ptr": "*i16", "y_ptr": "*i16"},
         dict(GS=128, BG=128, GPP=32, NCH=1, BITS=8, SYMMETRIC=True, ROUNDING=1, HB=32, HB_LOG=5, X_KIND=1,
              Y_KIND=-1, SLICED=True, PERMUTED=True, KEY_TERM=0x9E3779B9)),
        (tk._dequantize_kernel, common_d,
         dict(K=4, GS=128, BG=128, GPP=32, NCH=1, BITS=8, SYMMETRIC=True, HB=0, HB_LOG=0, MODE=1, OUT_KIND=0,
              ADD=False, Q_BITS=4, Q_SYMMETRIC=True, Q_ROUNDING=1, SLICED=True, KEY_TERM=0x9E3779B9)),
        (tk._dequantize_kernel, common_d,
         dict(K=2, GS=128, BG=128, GPP=32, NCH=1, BITS=4, SYMMETRIC=True, HB=32, HB_LOG=5, MODE=0, OUT_KIND=0,
              ADD=False, Q_BITS=8, Q_SYMMETRIC=True, Q_ROUNDING=0, SLICED=True, KEY_TERM=0)),
        # ... its last step dividing into FSDP2's bf16 output and watching for NaN/Inf
        (tk._dequantize_kernel, {**common_d, "out_ptr": "*i16"},
         dict(K=2, GS=128, BG=128, GPP=32, NCH=1, BITS=4, SYMMETRIC=True, HB=32, HB_LOG=5, MODE=0, OUT_KIND=1,
              ADD=False, Q_BITS=8, Q_SYMMETRIC=True, Q_ROUNDING=0, SLICED=True, KEY_TERM=0, DIV=4, WATCH=True)),
    ]
    for fn, sig, consts in variants:
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False, "num_warps": 8}).asm["ptx"]
        lines = [ln.strip() for ln in ptx.splitlines()]
        fma = [ln for ln in lines if ln.startswith("fma.") and ".f32" in ln]
        div = [ln for ln in lines if ln.startswith("div.") and ".f32" in ln]
        assert not fma, f"{fn.__name__} {consts}: FMA contraction: {fma[:3]}"
        assert all(ln.startswith("div.rn.f32") for ln in div), f"{fn.__name__}: inexact division: {div[:3]}"
        assert not [ln for ln in lines if ".ftz" in ln and ".f32" in ln], f"{fn.__name__}: denormals flushed"
        if fn is tk._quantize_kernel or consts["MODE"] == 1:  # the code clamp keeps NaN, as torch.clamp
            assert [ln for ln in lines if ln.startswith(("min.NaN", "max.NaN"))], f"{fn.__name__}: the clamp drops NaN"


# ----------------------------------------------------------------------------- GPU tests


@pytest.mark.parametrize("scheme", SCHEMES, ids=sid)
@pytest.mark.parametrize(
    "n,group_size,dtype",
    [(1, 8, torch.float32), (1_000_003, 128, torch.float32), (300_001, 2048, torch.bfloat16),
     (100_003, 1000, torch.float16), (200_000, 8192, torch.float32)],
    ids=lambda v: str(v).replace("torch.", ""),
)
@gpu_test
def test_gpu_quantize_and_dequantize_match_the_cpu_reference(launches, scheme, n, group_size, dtype):
    check_quantize("cuda", n, group_size, dtype, scheme, launches)


@pytest.mark.parametrize("scheme", SCHEMES, ids=sid)
@pytest.mark.parametrize("rows,length,group_size,hadamard_block",
                         ROW_CASES + [(4, 100_003, 128, 32), (2, 50_000, 2048, 0)], ids=str)
@gpu_test
def test_gpu_row_codec_steps_match_the_cpu_reference(launches, scheme, rows, length, group_size, hadamard_block):
    check_rows("cuda", rows, length, group_size, hadamard_block, scheme, launches)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("scheme", [(4, True, "stochastic"), (8, False, "shift")], ids=sid)
@gpu_test
def test_gpu_weight_difference_middle_step_and_transformed_rows(launches, dtype, scheme):
    check_difference("cuda", 4, 100_001, 2048, dtype, scheme, launches)
    check_middle("cuda", 4, 2, 4096, (8, True, "stochastic"), (4, True, "stochastic"), 128, 32, launches)
    check_transformed("cuda", scheme, launches)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@gpu_test
def test_gpu_rows_of_every_dtype_and_mixed_dtype_differences(launches, dtype):
    check_rows("cuda", 3, 50_000, 128, 32, (4, True, "stochastic"), launches, dtype=dtype, out_dtype=dtype)
    check_transformed("cuda", (8, False, "shift"), launches, dtype=dtype)
    check_difference("cuda", 4, 100_001, 2048, dtype, (4, True, "stochastic"), launches,
                     shard_dtype=dict(MIXED_DTYPES)[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", [(4, True, "stochastic"), (8, False, "shift"), (2, True, "nearest")], ids=sid)
@gpu_test
def test_gpu_non_finite_inputs_give_the_cpu_bytes(launches, scheme, dtype):
    check_nonfinite_quantize("cuda", dtype, scheme, launches)
    check_nonfinite_difference("cuda", dtype, scheme, launches)


@gpu_test
def test_gpu_torch_reference_is_device_independent():
    """The reference run on CUDA (QSDP_DISABLE_TRITON=1) gives the CPU bytes too."""
    scheme = (4, False, "stochastic")
    codec = _codec(*scheme, 128, 32)
    x = data(4 * 10_000, seed=8).view(4, 10_000)
    with reference():
        a = codec.encode(x, seed=1)
        b = codec.encode(x.cuda(), seed=1)
        same(b, a)
        same(codec.decode_sum(b, 10_000, finish=True), codec.decode_sum(a, 10_000, finish=True))



# ----------------------------------------------------------------------------- non-finite groups, any NaN payload


def nonfinite_rows(dev, scheme):
    """Rows holding NaN and infinities, encoded with the Hadamard transform fused, and the
    two-level middle step (dequantize, sum, requantize) of those bytes."""
    codec = _codec(*scheme, 32, 32)
    x = data(4 * 256, seed=12).view(4, 256)
    x[0, 5], x[1, 40], x[2, 100], x[3, 101] = float("nan"), float("inf"), -float("inf"), float("nan")
    buf = codec.encode(x.to(dev), seed=13)
    return buf, codec.decode_sum_encode(buf, 256, sources=2, codec=codec, seed=14)


NONFINITE_ROW_SCHEMES = [(4, True, "stochastic"), (8, False, "shift"), (2, False, "nearest")]


@interpret_only
def test_the_interpreter_returns_the_gpus_canonical_nan(gpu_nan_results):
    """The emulation the non-finite tests stand on: float arithmetic on a NaN of any sign and
    payload returns 0x7FFFFFFF, as NVIDIA's does."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_zero(x_ptr, out_ptr):
        i = tl.arange(0, 4)
        tl.store(out_ptr + i, tl.load(x_ptr + i) + 0.0)

    nans = torch.tensor([0x7FC00000, 0x7FC00123, -0x400000, 0x7F800001], dtype=torch.int32)  # -0x400000: 0xFFC00000
    out = torch.empty(4)
    add_zero[(1,)](nans.view(torch.float32), out)
    assert out.view(torch.int32).tolist() == [0x7FFFFFFF] * 4


@interpret_only
@pytest.mark.parametrize("scheme", NONFINITE_ROW_SCHEMES, ids=sid)
def test_non_finite_rows_give_the_reference_bytes_through_hadamard_and_the_middle_step(launches, gpu_nan_results,
                                                                                       scheme):
    compare(lambda dev: nonfinite_rows(dev, scheme), "cpu", launches)


@gpu_test
def test_gpu_a_run_of_several_slices_after_the_first_gives_the_cpu_bytes(launches):
    # sdp4bit's codecs, 4M elements a rank on 2 x 2: runs of 2 slices of 512K, the second from slice 2
    per = 1 << 19
    check_slice_run("cuda", 2, 2, dict(bits=8, group_size=128, hadamard_block=32),
                    dict(bits=4, group_size=128, hadamard_block=32), per, 4 * per, launches)


@pytest.mark.parametrize("scheme", NONFINITE_ROW_SCHEMES, ids=sid)
@gpu_test
def test_gpu_non_finite_rows_give_the_cpu_bytes_through_hadamard_and_the_middle_step(launches, scheme):
    compare(lambda dev: nonfinite_rows(dev, scheme), "cuda", launches)


@pytest.mark.parametrize("scheme", NONFINITE_ROW_SCHEMES, ids=sid)
@gpu_test
def test_gpu_torch_reference_gives_the_cpu_bytes_for_non_finite_groups(scheme):
    """The reference on CUDA writes the non-finite encoding by an integer select too, so the
    GPU's canonical NaN does not reach the wire."""
    with reference():
        compare(lambda dev: nonfinite_rows(dev, scheme), "cuda")
