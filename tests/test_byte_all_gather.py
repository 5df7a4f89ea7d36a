"""All-gathers of raw bytes (a tensor subclass's ``fsdp_pre_all_gather`` returning uint8, or
torchao's float8) are never quantized as numbers: under the qsdp, sdp4bit and fsdp presets the
weights FSDP2 gathers are native FSDP2's, bit for bit, and the comm says once which group it left
plain."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import qsdp
from byte_tensor import BytesWeight
from distributed import run_pooled

pytestmark = pytest.mark.timeout(180)

# Gradients travel plain so that the steps are native FSDP2's too: what differs is the gathers.
PLAIN_GRADS = {"grads.mode": "plain"}


class TwoBranches(nn.Module):
    """``raw`` (its own FSDP group) and ``num`` (the root group, fp32, still quantized) on
    separate inputs, so that ``raw``'s weights, gradients and input gradient never depend on
    how ``num``'s weights travelled."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = nn.Linear(32, 16)
        self.num = nn.Linear(32, 16)

    def forward(self, x, z):
        return self.raw(x), self.num(z)


def _train(model, rank, steps, preset):
    """Forward, backward and SGD ``steps`` times; what ``raw`` computed with its gathered weights
    (the plain ones it saw in each forward, its outputs, its input gradients), the byte warnings
    and the byte group's qsdp name."""
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    fully_shard(model.raw, mesh=mesh)
    fully_shard(model, mesh=mesh)
    name = None
    if preset is not None:
        handle = qsdp.quantize_comms(model, preset, overrides=PLAIN_GRADS)
        name = next(ag.name for ag in handle.all_gathers if ag.name.endswith("(raw)"))
    seen = []
    model.raw.register_forward_pre_hook(
        lambda mod, args: seen.append([p.detach().clone() for p in mod.parameters(recurse=False)
                                       if type(p) is nn.Parameter]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    outputs, input_grads = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(4, 32, generator=g).requires_grad_()
            out_raw, out_num = model(x, torch.randn(4, 32, generator=g))
            (out_raw.square().mean() + out_num.square().mean()).backward()
            opt.step()
            opt.zero_grad()
            outputs.append(out_raw.detach())
            input_grads.append(x.grad)
    byte_warnings = [str(w.message) for w in caught if "byte" in str(w.message).lower()]
    return seen, outputs + input_grads, byte_warnings, name


def _bytes_weight_run(rank, world, preset):
    torch.manual_seed(0)
    model = TwoBranches()
    initial = model.raw.weight.detach().clone()
    model.raw.weight = nn.Parameter(BytesWeight(model.raw.weight.detach()))
    result = _train(model, rank, 3, preset)
    assert torch.equal(result[0][0][0], initial)  # the subclass round-trips the weights
    return result


def _differing(expected, got):
    """Indices of the tensors of ``got`` that are not bit-identical to ``expected``'s."""
    assert len(got) == len(expected)
    return [i for i, (a, b) in enumerate(zip(expected, got)) if not torch.equal(a, b)]


def _assert_native_and_warned_once(native, ours, warned=True):
    for rank, ((seen0, computed0, _, _), (seen1, computed1, byte_warnings, name)) in enumerate(zip(native, ours)):
        for step, (params0, params1) in enumerate(zip(seen0, seen1)):
            bad = _differing(params0, params1)
            assert not bad, f"rank {rank}, forward {step}: gathered parameters {bad} differ"
        bad = _differing(computed0, computed1)
        assert not bad, f"rank {rank}: outputs / input gradients {bad} differ"
        if warned:
            assert len(byte_warnings) == 1 and name in byte_warnings[0], f"rank {rank}: {byte_warnings}"
        else:  # the fsdp preset quantizes nothing: nothing to warn about
            assert byte_warnings == [], f"rank {rank}: {byte_warnings}"


@pytest.mark.parametrize("preset", ["qsdp", "sdp4bit", "fsdp"])
def test_a_group_gathered_as_bytes_gets_native_fsdp2_weights_and_one_warning(preset):
    native = run_pooled(_bytes_weight_run, 2, None, local_world_size=1, timeout=80)
    ours = run_pooled(_bytes_weight_run, 2, preset, local_world_size=1, timeout=80)
    _assert_native_and_warned_once(native, ours, warned=preset != "fsdp")


def _float8_run(rank, world, preset, bias):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = TwoBranches()
    model.raw = nn.Linear(32, 16, bias=bias)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn == "raw")
    return _train(model, rank, 3, preset)


@pytest.mark.parametrize("bias", [False, True], ids=["float8-inputs", "float8-and-fp32-as-uint8"])
@pytest.mark.parametrize("preset", ["qsdp", "sdp4bit"])
def test_torchao_float8_all_gather_gets_native_fsdp2_weights_and_one_warning(preset, bias):
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    try:
        native = run_pooled(_float8_run, 2, None, bias, local_world_size=1, timeout=80)
    except RuntimeError as err:  # e.g. a gloo or CPU build without float8 support
        pytest.skip(f"torchao's float8 all-gather does not run with native FSDP2 here: {str(err).splitlines()[-1]}")
    ours = run_pooled(_float8_run, 2, preset, bias, local_world_size=1, timeout=80)
    _assert_native_and_warned_once(native, ours)
