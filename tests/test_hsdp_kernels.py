"""The quantized HSDP all-reduce gives the same bytes with the fused Triton kernels as with the
torch reference: run under Triton's CPU interpreter in a subprocess (no GPU needed)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from prestarted import PRESTARTED, Command

INTERPRET = os.environ.get("QSDP_HSDP_KERNEL_TEST") == "interpret"
HAVE_TRITON = importlib.util.find_spec("triton") is not None

pytestmark = pytest.mark.timeout(300)


def _interpreted_command() -> Command | None:
    """This file in a pytest subprocess under the interpreter (``None`` where the driver does not run)."""
    if INTERPRET or not HAVE_TRITON:
        return None
    return Command.pytest(__file__, set_env={"QSDP_HSDP_KERNEL_TEST": "interpret", "TRITON_INTERPRET": "1",
                                             "QSDP_TRITON_ON_CPU": "1"})


@pytest.mark.skipif(INTERPRET, reason="the driver itself")
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install 'qsdp[gpu]')")
@pytest.mark.prestart(lambda: _interpreted_command())  # starts with the run, at low priority
def test_the_all_reduce_under_the_triton_interpreter(request):
    rc, out = PRESTARTED.result(request.node.nodeid, _interpreted_command(), timeout=280)
    assert rc == 0 and " passed" in out, out[-4000:]


def _fused_and_reference(rank, world, preset):
    import qsdp
    from qsdp.codecs import triton_kernels as tk
    from qsdp.comm.hsdp import ReplicaAllReduce

    calls = []
    for name in ("quantize_into", "dequantize_into"):
        def counted(*a, _fn=getattr(tk, name), _name=name, **k):
            calls.append(_name)
            return _fn(*a, **k)

        setattr(tk, name, counted)  # a forked child: the patch dies with it
    groups = qsdp.hsdp_groups(nodes=2, device_type="cpu")
    cfg = qsdp.resolve_config(preset)
    x = torch.randn(700, generator=torch.Generator().manual_seed(rank))
    out = []
    for disable in ("1", "0"):
        os.environ["QSDP_DISABLE_TRITON"] = disable
        out.append(ReplicaAllReduce(cfg, groups.replicate_group, 0)(x))
    return out, len(calls)


@pytest.mark.skipif(not INTERPRET, reason="runs in the interpreter subprocess")
@pytest.mark.parametrize("preset", ["hsdp4", "qsdp"])
def test_fused_kernels_give_the_reference_bits(preset):
    from distributed import run_world

    for (reference, fused), launches in run_world(_fused_and_reference, 4, preset, local_world_size=2, timeout=250):
        assert launches >= 3  # encode, decode-sum-requantize, decode: all fused
        assert torch.equal(reference.view(torch.int32), fused.view(torch.int32))


@pytest.mark.skipif(not INTERPRET, reason="runs in the interpreter subprocess")
@pytest.mark.parametrize("n", [8 * 1024, 6922, 778, 5])
def test_the_kernel_cuts_and_pads_a_vector_as_the_reference_does(n, monkeypatch):
    # whole rows, full rows then a short one then rows past the end, one short row, a few elements
    from qsdp.comm.hsdp import hsdp_codec
    from qsdp.config import resolve_config

    for preset in ("qsdp", "hsdp4"):
        codec = hsdp_codec(resolve_config(preset).hsdp)
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        length = codec.padded_len(-(-n // 8))
        monkeypatch.setenv("QSDP_DISABLE_TRITON", "1")
        reference = codec.encode_cut(x, 8, length, seed=11)
        monkeypatch.setenv("QSDP_DISABLE_TRITON", "0")
        assert torch.equal(codec.encode_cut(x, 8, length, seed=11), reference), preset
