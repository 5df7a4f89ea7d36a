"""quantize_comms on real FSDP2 models: exactness of the fsdp preset, training with every
preset, the byte meter, and the errors users get for bad configurations."""

from __future__ import annotations

import pytest
import torch

import qsdp
from distributed import run_pooled
import fsdp_models as fm

pytestmark = pytest.mark.timeout(180)


def _losses_and_params(rank, world, preset, steps, reshard, param_dtype, prefetch):
    model = fm.build(reshard_after_forward=reshard, param_dtype=param_dtype)
    if prefetch:
        blocks = list(model.blocks)
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    if preset is not None:
        qsdp.quantize_comms(model, preset)
    losses = fm.train(model, steps, rank)
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    return losses, params


@pytest.mark.parametrize("reshard,param_dtype,prefetch", [
    (True, None, False), (False, None, True), (True, torch.bfloat16, True),
], ids=["zero3-fp32", "zero2-fp32-prefetch", "zero3-bf16-prefetch"])
def test_fsdp_preset_is_bit_identical_to_unmodified_fsdp2(reshard, param_dtype, prefetch):
    plain = run_pooled(_losses_and_params, 2, None, 4, reshard, param_dtype, prefetch)
    ours = run_pooled(_losses_and_params, 2, "fsdp", 4, reshard, param_dtype, prefetch)
    for (l0, p0), (l1, p1) in zip(plain, ours):
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))


# 30 steps: the runs are deterministic, and at 30 steps every preset's worst rank is further
# inside both bounds below than at 40 (qsdp-w4g4, the closest: its last losses at 0.83 of the
# bound against 0.97, the loss fallen to 0.23 of its start against 0.18); at 25 they would not
# be (qsdp-w4g4's curve is not monotone), so fewer steps would not check the same thing.
TRAIN_STEPS = 30


def _train_preset(rank, world, preset, reshard):
    model = fm.build(reshard_after_forward=reshard)
    qsdp.quantize_comms(model, preset)
    losses = fm.train(model, TRAIN_STEPS, rank)
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


@pytest.fixture(scope="module")
def baseline():
    return run_pooled(_train_preset, 4, "fsdp", True, local_world_size=2)


@pytest.mark.parametrize("preset", ["qsdp", "sdp4bit", "zeropp", "qw4", "qwd4", "tlq4", "tlq-hs", "qsdp-w4g4"])
def test_every_preset_trains_close_to_the_baseline(preset, baseline):
    base = baseline
    got = run_pooled(_train_preset, 4, preset, preset in ("sdp4bit", "qwd4"), local_world_size=2)
    for (b_first, b_last), (first, last) in zip(base, got):
        assert last < 0.5 * first  # the loss falls
        assert last < b_last * 1.5 + 0.05  # and stays near the unquantized run


def _replicas_identical(rank, world):
    model = fm.build(reshard_after_forward=True)
    handle = qsdp.quantize_comms(model, "sdp4bit")
    fm.train(model, 5, rank)
    return [ag.replica.clone() for ag in handle.all_gathers]


def test_weight_difference_replicas_are_identical_on_every_rank_inside_fsdp():
    results = run_pooled(_replicas_identical, 4, local_world_size=2)
    for rank, other in enumerate(results):  # node replicas: local rank j of every node holds the same rows
        assert all(torch.equal(a, b) for a, b in zip(results[rank % 2], other))


def _losses_with_replica(rank, world, replica):
    model = fm.build(reshard_after_forward=True)
    qsdp.quantize_comms(model, "sdp4bit", overrides={"weights.replica": replica})
    losses = fm.train(model, 6, rank)
    return losses, [p.full_tensor() for p in model.parameters()]


def test_node_replicas_train_bit_identically_to_full_replicas():
    full = run_pooled(_losses_with_replica, 4, "full", local_world_size=2)
    node = run_pooled(_losses_with_replica, 4, "node", local_world_size=2)
    for (lf, pf), (ln, pn) in zip(full, node):
        assert lf == ln
        assert all(torch.equal(a, b) for a, b in zip(pf, pn))


def _meter_after_warmup(rank, world, replica):
    model = fm.build(width=128, depth=2)
    handle = qsdp.quantize_comms(model, "sdp4bit", overrides={"weights.replica": replica})
    fm.train(model, 1, rank)  # the first gather sends exact values to establish the replicas
    qsdp.comm_stats(reset=True)
    fm.train(model, 2, rank)
    return qsdp.comm_stats(), [ag.replica.numel() for ag in handle.all_gathers]


def test_sdp4bit_meter_reports_four_bit_weights_and_8_4_bit_gradients():
    for stats, _ in run_pooled(_meter_after_warmup, 4, "full", local_world_size=2):
        # padding of the last 2048-group of each shard is the only excess over 4 + 32/2048
        assert 4.0 < stats["weights"]["total"]["bits_per_element"] <= 4.02 * 1.12
        assert 8.0 < stats["grads"]["intra"]["bits_per_element"] <= 8.25 * 1.01
        assert 4.0 < stats["grads"]["inter"]["bits_per_element"] <= 4.25 * 1.01


def test_node_replicas_send_four_bit_weights_between_nodes_and_fp32_inside():
    full = run_pooled(_meter_after_warmup, 4, "full", local_world_size=2)
    for (stats, sizes), (_, full_sizes) in zip(run_pooled(_meter_after_warmup, 4, "node", local_world_size=2), full):
        assert 4.0 < stats["weights"]["inter"]["bits_per_element"] <= 4.02 * 1.12
        assert stats["weights"]["intra"]["bits_per_element"] == 32.0  # the parameter dtype
        assert [2 * n for n in sizes] == full_sizes  # M = 2: half of the full replica


def _tiny_layer(rank, world, preset):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Linear(1, 1))
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    fully_shard(model)
    qsdp.quantize_comms(model, preset)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(4, 2)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("preset", ["qsdp", "sdp4bit", "zeropp"])
def test_uneven_and_empty_shards_of_a_tiny_layer_work_on_four_ranks(preset):
    results = run_pooled(_tiny_layer, 4, preset, local_world_size=2)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    assert all(torch.isfinite(p).all() for p in results[0])


def _bf16_model(rank, world, preset):
    torch.manual_seed(0)
    model = fm.build(dtype=torch.bfloat16)
    qsdp.quantize_comms(model, preset)
    dtypes = set()
    handles = [m.register_forward_pre_hook(lambda mod, args: dtypes.update(p.dtype for p in mod.parameters(recurse=False)))
               for m in model.modules() if isinstance(m, torch.nn.Linear)]
    fm.train(model, 2, rank, dtype=torch.bfloat16)
    for h in handles:
        h.remove()
    return dtypes


@pytest.mark.parametrize("preset", ["qsdp", "sdp4bit"])
def test_bf16_parameters_are_gathered_as_bf16(preset):
    for dtypes in run_pooled(_bf16_model, 2, preset):
        assert dtypes == {torch.bfloat16}


def _mismatched(rank, world):
    model = fm.build()
    try:
        qsdp.quantize_comms(model, "sdp4bit" if rank == 0 else "qsdp")
    except qsdp.ConfigError as e:
        return str(e)
    return ""


def test_mismatched_configs_across_ranks_raise_on_every_rank_naming_the_difference():
    for msg in run_pooled(_mismatched, 2, timeout=60):
        assert "differs across ranks" in msg and "weights.mode" in msg


def _bad_local_world_size(rank, world):
    model = fm.build()
    try:
        qsdp.quantize_comms(model, "sdp4bit", overrides={"local_world_size": 3})
    except qsdp.ConfigError as e:
        return str(e)
    return ""


def test_local_world_size_must_divide_the_world():
    for msg in run_pooled(_bad_local_world_size, 4):
        assert "local_world_size=3" in msg and "world size 4" in msg


def _no_fsdp(rank, world):
    try:
        qsdp.quantize_comms(torch.nn.Linear(2, 2), "qsdp")
    except ValueError as e:
        return str(e)
    return ""


def test_a_model_without_fully_shard_is_refused():
    assert "fully_shard" in run_pooled(_no_fsdp, 1)[0]


def _one_rank_world(rank, world):
    import warnings

    model = fm.build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qsdp.quantize_comms(model, "sdp4bit")
    return [str(w.message) for w in caught]


def test_a_one_rank_group_warns_that_fsdp2_calls_no_custom_collective():
    messages = run_pooled(_one_rank_world, 1)[0]
    assert any("one rank" in m and "nothing is quantized or metered" in m for m in messages)


def test_an_unknown_replica_layout_is_refused_naming_the_field():
    with pytest.raises(qsdp.ConfigError, match=r"weights.replica='rack' is not supported; allowed: auto, node, full"):
        qsdp.resolve_config("sdp4bit", {"weights.replica": "rack"})
