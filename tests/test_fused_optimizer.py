"""Fused optimizers (``AdamW(fused=True)``, the Hugging Face Trainer's default) update parameters
without bumping their version counters: the weight gathers still follow every step."""

import pytest
import torch

import qsdp
from distributed import run_world
from fsdp_models import batch, build


def _gathered_matches_shards_after_fused_steps(rank, world, preset):
    model = build(seed=0)
    handle = qsdp.quantize_comms(model, preset)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for step in range(4):
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    weight = model.blocks[0].fc1.weight
    seen = {}

    def record(module, _inputs):
        seen["w"] = module.weight.detach().clone()

    hook = model.blocks[0].fc1.register_forward_pre_hook(record)
    with torch.no_grad():
        model(batch(99, rank)[0])
    hook.remove()
    exact = weight.full_tensor()
    handle.close()
    # the gathered weight is the stepped weight, up to the 4-bit quantization of one difference
    return float((seen["w"] - exact).abs().max()), handle.all_gathers[1].version


@pytest.mark.timeout(120)
def test_sdp4bit_gathers_follow_a_fused_optimizer():
    for err, versions in run_world(_gathered_matches_shards_after_fused_steps, 2, "sdp4bit", local_world_size=1):
        assert versions >= 4  # a difference was sent after every step
        assert err < 5e-3  # one 4-bit grid step of a ~1e-2 Adam update; stale weights differ by ~4e-2
