"""The accuracy guard under HSDP, on qsdp's recipe (``replicate_group=``) and on FSDP2's native
2-D mesh: the all-reduce across the replicas is part of the gradients' path it measures and
moves. 4 CPU ranks: 2 replicas (nodes) x a shard group of 2."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import qsdp
from qsdp.guard import GuardConfig
from distributed import run_pooled
import fsdp_models as fm
import layouts

pytestmark = pytest.mark.timeout(240)

RECIPE_AND_NATIVE = pytest.mark.parametrize("native", [False, True], ids=["recipe", "native"])


def _hsdp(native: bool, preset: str, guard):
    built = layouts.build("hsdp", native_hsdp=native)
    handle = qsdp.quantize_comms(built.model, preset, overrides={"local_world_size": 2},
                                 replicate_group=None if native else built.replicate_group, guard=guard)
    return built, handle


def _train(rank, world, native, preset, guard, steps=7, all_reduce_every=1):
    """``steps`` Adam steps; ``all_reduce_every`` micro-batches a step, FSDP2 all-reducing across
    the replicas only after the last (``set_requires_all_reduce``: a reduce-scatter each)."""
    built, handle = _hsdp(native, preset, guard)
    model = built.model
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        for micro in range(all_reduce_every):
            if all_reduce_every > 1:
                model.set_requires_all_reduce(micro == all_reduce_every - 1)
            x, y = fm.batch(step * all_reduce_every + micro, rank)
            loss = F.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    g = handle.guard
    shard = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses,
            "moves": None if g is None else [(e.step, e.group, e.part, e.before, e.after) for e in g.escalations],
            "readings": None if g is None else [(s, [r.grad_ratio for r in rs]) for s, rs in g.readings],
            "shard": hashlib.sha256(shard.numpy().tobytes()).hexdigest(),
            "hsdp": [(rs.all_reduce.config.hsdp.mode, rs.all_reduce.config.hsdp.bits) for rs in handle.reduce_scatters],
            "guard_bytes": handle.comm_stats()["guard"]["total"]["bytes"]}


@RECIPE_AND_NATIVE
@pytest.mark.parametrize("all_reduce_every", [1, 2])
def test_an_unmoved_guarded_hsdp_run_is_bit_identical_to_an_unguarded_one(native, all_reduce_every):
    guarded = run_pooled(_train, 4, native, "hsdp4", GuardConfig(every=2, start=1), 7, all_reduce_every,
                         local_world_size=2)
    plain = run_pooled(_train, 4, native, "hsdp4", None, 7, all_reduce_every, local_world_size=2)
    assert all(r["moves"] == [] for r in guarded)
    assert [r["losses"] for r in guarded] == [r["losses"] for r in plain]
    assert [r["shard"] for r in guarded] == [r["shard"] for r in plain]
    # Rounds after steps 1, 3 and 5, each decided at a later forward (5's in step 7 only with two
    # forwards a step), every group's gradient ratio measured, the same on every rank.
    readings = guarded[0]["readings"]
    assert [s for s, _ in readings] == [1, 3, 5][:2 if all_reduce_every == 1 else 3]
    assert all(g is not None and 0 < g < 1 for _, rs in readings for g in rs)
    assert all(r["readings"] == readings for r in guarded)
    assert all(r["guard_bytes"] > 0 == plain[0]["guard_bytes"] for r in guarded)


@RECIPE_AND_NATIVE
def test_the_all_reduce_across_replicas_climbs_4_8_exact_on_every_rank_at_the_same_step(native):
    low = GuardConfig(every=2, start=1, grad_start=0, grad_limit=1e-6)
    runs = run_pooled(_train, 4, native, "hsdp4", low, 7, local_world_size=2)
    moves = runs[0]["moves"]
    assert all(r["moves"] == moves for r in runs)
    assert [(step, before, after) for step, group, _, before, after in moves if group == 0] == [
        (3, "4-bit across replicas", "8-bit across replicas"), (5, "8-bit across replicas", "exact")]
    assert {group for _, group, *_ in moves} == {0, 1, 2}
    assert all(r["hsdp"] == [("plain", 4)] * 3 for r in runs)
    # 8 bits instead of 4: the quantization noise falls by about 16^2
    first, second = runs[0]["readings"][0][1], runs[0]["readings"][1][1]
    assert all(b < a / 50 for a, b in zip(first, second))
    # Ranks r and r + 2 hold the same shard in the two replicas: still identical bit for bit.
    assert runs[0]["shard"] == runs[2]["shard"] and runs[1]["shard"] == runs[3]["shard"]


def _ratio_against_every_ranks_gradient(rank, world, native):
    """The guard's q/SGD of the step after the first against the one computed from every rank's
    own gradient of that step, gathered whole: ``||Q(R) - R||^2`` over the variance of the mean
    ``R``, ``sum_r ||g_r - R||^2 / (W (W - 1))``, per FSDP group."""
    built, handle = _hsdp(native, "hsdp4", GuardConfig(every=100, start=1, grad_start=0))
    model = built.model
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    names = [n for n, _ in model.named_parameters()]
    group_of = {id(p): i for i, params in enumerate(handle.group_parameters) for p in params}
    groups = [group_of[id(p)] for p in model.parameters()]
    err, var = [0.0] * len(handle.group_parameters), [0.0] * len(handle.group_parameters)
    for step in range(2):
        x, y = fm.batch(step, rank)
        if step == 1:  # this rank's own gradient, on an unsharded copy of the weights
            copy = fm.TinyNet(32, 2)
            copy.load_state_dict({n: p.full_tensor() for n, p in zip(names, model.parameters())})
            F.mse_loss(copy(x), y).backward()
            own = [p.grad.double() for p in copy.parameters()]
        F.mse_loss(model(x), y).backward()
        if step == 1:
            for g, p, mine in zip(groups, model.parameters(), own):
                every = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(every, mine)
                mean = torch.stack(every).mean(0)
                var[g] += sum(float((e - mean).square().sum()) for e in every) / (world * (world - 1))
                err[g] += float((p.grad.full_tensor().double() - mean).square().sum())
        opt.step()
        opt.zero_grad()
    model(x)  # the weights' part of the round
    with torch.no_grad():
        model(x)  # the forward that decides
    return [r.grad_ratio for r in handle.guard.readings[0][1]], [e / v for e, v in zip(err, var)]


@RECIPE_AND_NATIVE
def test_the_hsdp_gradient_ratio_is_the_one_every_ranks_own_gradient_gives(native):
    for measured, expected in run_pooled(_ratio_against_every_ranks_gradient, 4, native, local_world_size=2):
        assert measured == pytest.approx(expected, rel=1e-3)



def _beside_tp(rank, world, guard):
    built = layouts.build("3d")
    handle = qsdp.quantize_comms(built.model, "hsdp4", overrides={"local_world_size": 4},
                                 replicate_group=built.replicate_group, guard=guard)
    losses = layouts.train(built, 5)
    g = handle.guard
    return losses, None if g is None else [(s, [r.grad_ratio for r in rs]) for s, rs in g.readings]


def test_beside_tensor_parallelism_an_unmoved_guard_changes_nothing_and_every_rank_reads_the_same():
    # 2 replicas x 2 shard ranks x 2 TP ranks (qsdp's recipe on a 3-D mesh): TP peers hold
    # different parts of a group, the sums add them up.
    guarded = run_pooled(_beside_tp, 8, GuardConfig(every=2, start=1), local_world_size=4, timeout=300)
    plain = run_pooled(_beside_tp, 8, None, local_world_size=4, timeout=300)
    assert [losses for losses, _ in guarded] == [losses for losses, _ in plain]
    readings = guarded[0][1]
    assert [s for s, _ in readings] == [1] and all(0 < g < 1 for g in readings[0][1])
    assert all(r == readings for _, r in guarded)
