"""A steady launch goes through the compiled kernel its first replay found, with Triton's own
arguments, and only where that variant fits (qsdp.codecs.kernel_handles).

On CPU: the constexprs a handle appends are the ones Triton binds, in its order, for the
kernels' real templates; handles are made only where this Triton launches as they do. On a GPU
(``-m gpu``): a launch through a handle gives the bytes of Triton's dispatch, and a tensor off
its 16-byte boundary goes through the dispatch instead.
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install 'qsdp[gpu]')")]


@pytest.fixture
def fresh_support(monkeypatch):
    from qsdp.codecs import kernel_handles

    monkeypatch.setattr(kernel_handles, "_SUPPORTED", None)
    return kernel_handles


def _positional(kernel) -> int:
    return next(i for i, p in enumerate(kernel.params) if p.is_constexpr)


def _triton_binds(kernel, args: tuple, kwargs: dict) -> tuple:
    params = {p.name for p in kernel.params}
    bound = inspect.signature(kernel.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    return tuple(bound.arguments.values())[len(args):]


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels have no compiled variants")
@pytest.mark.parametrize("sliced,tail", [(False, False), (True, False), (False, True)])
def test_a_quantize_handle_appends_the_constexprs_triton_binds(sliced, tail):
    from qsdp.codecs import triton_kernels as tk
    from qsdp.codecs.kernel_handles import constants_after

    kernel = tk._quantize_kernel
    _, kwargs = tk._quantize_template(128, 64, 32, 4, True, "stochastic", torch.bfloat16, None, False, sliced, tail)
    args = tuple(range(_positional(kernel)))
    assert constants_after(kernel, len(args), kwargs) == _triton_binds(kernel, args, kwargs)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels have no compiled variants")
@pytest.mark.parametrize("requantize,divisor,watch", [(None, 1, False), ((4, True, "stochastic"), 1, False),
                                                      (None, 8, True)])
def test_a_dequantize_handle_appends_the_constexprs_triton_binds(requantize, divisor, watch):
    from qsdp.codecs import triton_kernels as tk
    from qsdp.codecs.kernel_handles import constants_after

    kernel = tk._dequantize_kernel
    out = None if requantize else torch.bfloat16
    *_, kwargs = tk._dequantize_template(4, 128, 64, 0, 8, True, requantize, out, False, False, divisor, watch)
    args = tuple(range(_positional(kernel)))
    assert constants_after(kernel, len(args), kwargs) == _triton_binds(kernel, args, kwargs)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter never makes handles")
def test_the_pinned_triton_launches_as_the_handles_do(fresh_support, monkeypatch):
    monkeypatch.delenv("QSDP_TRITON_JIT_LAUNCH", raising=False)
    assert fresh_support.supported()


@pytest.mark.parametrize("env", ["TRITON_INTERPRET", "QSDP_TRITON_JIT_LAUNCH"])
def test_no_handles_under_the_interpreter_or_when_switched_off(fresh_support, monkeypatch, env):
    monkeypatch.setenv(env, "1")
    assert not fresh_support.supported()


def test_no_handle_for_cpu_tensors_or_a_launch_that_returned_nothing(fresh_support):
    from qsdp.codecs import triton_kernels as tk

    x = torch.zeros(4)
    assert fresh_support.found(None, tk._quantize_kernel, (1, 1, 1), (x, 1), {}) is None
    assert fresh_support.found(object(), tk._quantize_kernel, (1, 1, 1), (x, 1), {}) is None


# ----------------------------------------------------------------------------- on a GPU


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if INTERPRETED:
        return "TRITON_INTERPRET=1 is set"
    return None


def gpu(fn):
    """``@pytest.mark.gpu``, skipped with the reason where it cannot run."""
    reason = _gpu_skip_reason()
    return pytest.mark.gpu(pytest.mark.skipif(reason is not None, reason=str(reason))(fn))


def _encoded_with_launch(codec, x: torch.Tensor, seed: int):
    """codec.encode of ``x`` (Triton's dispatch: a new launch, which keeps no handle) and the
    Launch it made."""
    from qsdp.codecs import triton_kernels as tk

    with tk.recording() as made:
        buf = codec.encode(x, seed=seed)
    assert len(made) == 1 and made[0].handles == [None]
    return buf, made[0]


def _replayed(launch, x: torch.Tensor, like: torch.Tensor, seed: int) -> torch.Tensor:
    from qsdp.codecs import triton_kernels as tk

    from qsdp.codecs import rng

    got = torch.zeros_like(like)
    tk.quantize_again(launch, x, got, rng.launch_key(seed, launch.keying))  # a plan's steady call
    return got


@gpu
@pytest.mark.parametrize("scheme", [(4, True, "stochastic", 32), (8, False, "shift", 0), (2, True, "nearest", 0)])
def test_gpu_a_launch_through_its_handle_gives_the_bytes_of_tritons_dispatch(scheme):
    from qsdp.codecs import triton_kernels as tk
    from qsdp.codecs.kernel_handles import Handle
    from qsdp.comm.wire import RowCodec

    bits, symmetric, rounding, hb = scheme
    codec = RowCodec(bits=bits, group_size=128, symmetric=symmetric, rounding=rounding, hadamard_block=hb)
    x, y = (torch.randn(4, 10_000, device="cuda") for _ in range(2))
    expected_x, launch = _encoded_with_launch(codec, x, 11)
    expected_y, _ = _encoded_with_launch(codec, y, 12)  # a new launch: through the dispatch
    # the first replay goes through the dispatch and keeps its handle, the second through the handle
    assert torch.equal(_replayed(launch, x, expected_x, 11), expected_x)
    assert isinstance(launch.handles[0], Handle)
    assert torch.equal(_replayed(launch, y, expected_y, 12), expected_y)
    # decoding, likewise
    out1, out2, out3 = (torch.zeros(4, 10_000, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    with tk.recording() as made:
        codec.decode_into(expected_y, 10_000, out1)
    assert len(made) == 1
    for out in (out2, out3):
        tk.dequantize_again(made[0], expected_y, out)
        assert isinstance(made[0].handles[0], Handle)
        assert torch.equal(out1.view(torch.int16), out.view(torch.int16))


@gpu
def test_gpu_a_tensor_off_its_boundary_goes_through_tritons_dispatch():
    from qsdp.codecs.kernel_handles import Handle, launched
    from qsdp.comm.wire import RowCodec

    codec = RowCodec(bits=4, group_size=128, symmetric=True, rounding="stochastic", hadamard_block=32)
    x = torch.randn(4, 10_000, device="cuda")
    expected_x, launch = _encoded_with_launch(codec, x, 11)
    _replayed(launch, x, expected_x, 11)
    handle = launch.handles[0]
    assert isinstance(handle, Handle)
    shifted = torch.randn(4 * 10_000 + 1, device="cuda")[1:].view(4, 10_000)  # 4 bytes off
    expected, _ = _encoded_with_launch(codec, shifted.contiguous(), 13)
    assert not launched(handle, (shifted,) * (max(handle.tensors) + 1))
    assert torch.equal(_replayed(launch, shifted, expected, 13), expected)
    assert launch.handles[0] is handle  # kept for the calls that fit it
