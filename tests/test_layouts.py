"""What works with what: every FSDP2 layout users run (1-D, HSDP, dp x tp, 3-D) with every
training feature (ZeRO-3, ZeRO-2, hpZ's ``reshard_after_forward=<int>``, activation
checkpointing with gradient accumulation, bf16 parameters with fp32 reduction, compiled blocks),
for the ``fsdp`` preset (bit-identical to native FSDP2) and the quantized ``qsdp`` and
``sdp4bit`` (finite losses close to native). docs/layouts.md is this matrix in words."""

from __future__ import annotations

import math

import pytest
import torch

import qsdp
import layouts
from distributed import run_pooled

pytestmark = pytest.mark.timeout(600)

STEPS = 6  # the first step sets the weight replicas; the rest update them by differences
FEATURES = {
    "zero3": {"reshard": True},
    "zero2": {"reshard": False},
    "hpz": {"reshard": 2},
    "checkpoint-accumulate": {"checkpoint": True, "accumulate": 2},
    "bf16-fp32-reduce": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "compile": {"compile_blocks": True},
}
PRESETS = (None, "fsdp", "qsdp", "sdp4bit")  # None: native FSDP2, no qsdp


def _matrix_cell(rank, world, layout, feature):
    kw = dict(FEATURES[feature])
    accumulate = kw.pop("accumulate", 1)
    out = {}
    for preset in PRESETS:
        built = layouts.build(layout, native_hsdp=preset is None, **kw)
        handle = None
        if preset is not None:
            handle = qsdp.quantize_comms(built.model, preset, replicate_group=built.replicate_group)
        losses = layouts.train(built, STEPS, accumulate)
        out[preset] = (losses, layouts.full_params(built.model), handle.comm_stats() if handle else None)
        if handle is not None:
            handle.close()
    return out


def _repeats_a_path(layout: str, feature: str) -> bool:
    """Whether the cell adds no code path of its own to make test: each feature's path is its
    cell on ``1d`` (where the fsdp preset is bit-identical to native FSDP2, the strictest check),
    each layout's is its ZeRO-3 cell; the crossings of the other layouts with the other features
    run in make test-all (docs/tests.md lists what covers each)."""
    return layout in ("hsdp", "dp_tp") and feature != "zero3"


def _cells():
    for layout in ("1d", "hsdp", "dp_tp", "3d"):
        for feature in FEATURES:
            if feature == "hpz" and layout != "1d":
                continue  # the other layouts' FSDP groups are one rank per node or one node
            marks = [pytest.mark.slow] if layout == "3d" or feature == "compile" or _repeats_a_path(layout, feature) else []
            yield pytest.param(layout, feature, id=f"{layout}-{feature}", marks=marks)


@pytest.mark.parametrize("layout,feature", list(_cells()))
def test_layout_trains_with_every_preset(layout, feature):
    results = run_pooled(_matrix_cell, layouts.WORLD[layout], layout, feature,
                        local_world_size=layouts.PER_NODE[layout], timeout=540)
    for by_preset in results:
        native_losses, native_params, _ = by_preset[None]
        losses, params, stats = by_preset["fsdp"]
        if layout in ("1d", "dp_tp"):  # the same collectives as native FSDP2, bit for bit
            assert losses == native_losses
            assert all(torch.equal(a, b) for a, b in zip(params, native_params))
        else:  # qsdp's HSDP recipe reduces in a different order than FSDP2's own HSDP
            assert losses == pytest.approx(native_losses, rel=1e-4, abs=1e-6)
        for preset in ("qsdp", "sdp4bit"):
            losses, _, stats = by_preset[preset]
            assert all(math.isfinite(x) for x in losses), preset
            assert sum(losses[-3:]) / 3 < sum(native_losses[-3:]) / 3 * 1.5 + 0.05, preset
            assert stats["grads"]["total"]["elements"] > 0, preset


# ------------------------------------------------------------------ dp x tp: the link each hop crosses

IN, OUT = 1024, 64  # TP halves the rows, FSDP over 2 dp ranks halves again: 16384-element shards


def _dp_tp_bits(rank, world, preset):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    handle = qsdp.quantize_comms(model, preset)  # no group=: read from FSDP2's mesh
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):  # the first step establishes the weight-difference replicas
        handle.comm_stats(reset=True)
        x = torch.randn(4, IN, generator=torch.Generator().manual_seed(10 * step + mesh["dp"].get_local_rank()))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    t = handle.topology
    return (t.nodes, t.ranks_per_node), handle.comm_stats()


@pytest.mark.parametrize("preset", ["fsdp", "qsdp", "sdp4bit", "zeropp"])
def test_dp_ranks_on_different_nodes_cross_the_node_link_with_the_bits_presets_predict(preset):
    from qsdp.preset_table import link_bits

    predicted = link_bits(preset, shard=IN * OUT // 4, nodes=2, ranks_per_node=1, param_bytes=4, grad_bytes=4)["fsdp"]
    for layout, stats in run_pooled(_dp_tp_bits, 4, preset, local_world_size=2):
        assert layout == (2, 1)  # the dp group {0, 2} is one rank on each of two nodes
        measured = {k: {lv: stats[k][lv]["bits_per_element"] if stats[k][lv]["elements"] else None
                        for lv in ("intra", "inter")} for k in ("weights", "grads")}
        assert measured == predicted
        assert stats["grads"]["intra"]["elements"] == 0  # nothing stays inside a node
    if preset == "sdp4bit":
        assert predicted["grads"]["inter"] == pytest.approx(4.25, abs=0.01)  # 4-bit codes + fp32 scale per 128


# ------------------------------------------------------------------ hpZ: reshard_after_forward=<int>

def _hpz(rank, world, preset):
    built = layouts.build("1d", reshard=2)
    handle = qsdp.quantize_comms(built.model, preset) if preset else None
    losses = layouts.train(built, 2)  # the first step establishes the weight-difference replicas
    if handle is not None:
        handle.comm_stats(reset=True)
    losses += layouts.train(built, 1)
    return losses, layouts.full_params(built.model), handle.comm_stats() if handle else None


@pytest.mark.parametrize("preset", ["qsdp", "sdp4bit"])
def test_the_backward_gather_of_hpz_stays_inside_the_node_exactly(preset):
    """With reshard_after_forward=2 on 2 nodes x 2, the forward gathers cross nodes as the preset
    says, and the backward gathers over the node's 2 ranks travel in fp32 inside it."""
    for losses, _, stats in run_pooled(_hpz, 4, preset, local_world_size=2):
        assert all(math.isfinite(x) for x in losses)
        w = stats["weights"]
        assert w["intra"]["elements"] > 0 and w["inter"]["elements"] > 0
        inter, intra = w["inter"]["bits_per_element"], w["intra"]["bits_per_element"]
        # 8-bit weights (qsdp) or 4-bit differences (sdp4bit) between nodes, plus the scales and
        # the padding of the root's ~100-element shard to a whole 1024- or 2048-element group
        assert inter < 16.0
        if preset == "sdp4bit":  # the node replicas' rows and hpZ's regathers inside the node: exact
            assert intra == pytest.approx(32.0)
        else:  # the forward gather's shard to the node peer (n elements at the inter rate) and
            # hpZ's exact regather of the node's two shards (2n elements at 32 bits)
            assert intra == pytest.approx((inter + 2 * 32.0) / 3)


def test_hpz_gathers_the_same_weights_as_native_fsdp2_with_the_fsdp_preset():
    native = run_pooled(_hpz, 4, None, local_world_size=2)
    ours = run_pooled(_hpz, 4, "fsdp", local_world_size=2)
    for (l0, p0, _), (l1, p1, _) in zip(native, ours):
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))


# ------------------------------------------------------------------ one node: no replica

def _one_node_state(rank, world):
    built = layouts.build("1d")
    handle = qsdp.quantize_comms(built.model, "sdp4bit")
    layouts.train(built, 2)
    held = sum(r.numel() for ag in handle.all_gathers for r in ag.replica_rows().values())
    model = sum(p.numel() for p in built.model.parameters())
    return held, model, handle.topology.nodes


def test_sdp4bit_on_one_node_holds_no_weight_replica():
    for held, model, nodes in run_pooled(_one_node_state, 4):
        assert nodes == 1
        assert held <= model / 4


# ------------------------------------------------------------------ async unshard

def _async_unshard(rank, world, preset):
    built = layouts.build("1d")
    qsdp.quantize_comms(built.model, preset)
    layouts.train(built, 1)
    x, _ = __import__("fsdp_models").batch(5, rank)
    with torch.no_grad():
        sync = built.model(x)
        work = built.model.blocks[0].unshard(async_op=True)
        work.wait()
        after = built.model(x)
    return torch.equal(sync, after)


@pytest.mark.parametrize("preset", ["qsdp", "sdp4bit"])
def test_an_async_unshard_delivers_the_same_weights(preset):
    assert all(run_pooled(_async_unshard, 4, preset, local_world_size=2))
