"""Reliability of the collectives: non-finite gradients, stale and diverged replicas, hangs,
determinism."""

from __future__ import annotations

import os
import time

import pytest
import torch

import qsdp
from distributed import run_pooled
import fsdp_models as fm

pytestmark = pytest.mark.timeout(180)


def _snapshot(model, opt):
    params = [p.full_tensor().clone() for p in model.parameters()]
    state = [{k: v.full_tensor().clone() if hasattr(v, "full_tensor") else torch.as_tensor(v).clone()
              for k, v in s.items()} for s in opt.state.values()]
    return params, state


def _nan_at_step(rank, world, preset, bad_step, bad_rank):
    model = fm.build()
    handle = qsdp.quantize_comms(model, preset)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    skipped, before, after = [], None, None
    for step in range(6):
        x, y = fm.batch(step, rank)
        if step == bad_step and rank == bad_rank:
            x[0, 0] = float("nan")
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == bad_step:
            before = _snapshot(model, opt)
        if handle.nonfinite_gradients():
            skipped.append(step)
        else:
            opt.step()
        opt.zero_grad()
        if step == bad_step:
            after = _snapshot(model, opt)
    replicas = [ag.replica.clone() for ag in handle.all_gathers if getattr(ag, "replica", None) is not None]
    params = [p.full_tensor() for p in model.parameters()]
    return skipped, before, after, replicas, all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("preset", ["fsdp", "qsdp", "sdp4bit"])
def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(preset):
    results = run_pooled(_nan_at_step, 4, preset, 3, 2, local_world_size=2)
    for skipped, (p0, s0), (p1, s1), replicas, finite in results:
        assert skipped == [3]
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))  # weights unchanged
        assert all(torch.equal(a[k], b[k]) for a, b in zip(s0, s1) for k in a)  # optimizer state unchanged
        assert finite
    for rank, other in enumerate(results):  # 2 nodes x 2: local rank j of each node holds the same rows
        assert all(torch.equal(a, b) for a, b in zip(results[rank % 2][3], other[3]))


def _first_loss_after(rank, world, action):
    """Train 3 steps with sdp4bit, change the parameters outside the optimizer, return the next
    loss; the reference is a fresh model holding the same parameters."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, StateDictOptions

    model = fm.build(seed=0)
    handle = qsdp.quantize_comms(model, "sdp4bit")
    fm.train(model, 3, rank)
    if action == "load_state_dict":
        other = fm.build(seed=123)
        sd = get_model_state_dict(other)
        set_model_state_dict(model, sd)
    elif action == "edit":
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
    elif action == "dcp":
        import tempfile
        import torch.distributed.checkpoint as dcp
        import torch.distributed as dist

        path = tempfile.mkdtemp() if rank == 0 else None
        box = [path]
        dist.broadcast_object_list(box)
        sd = {"model": get_model_state_dict(model)}
        dcp.save(sd, checkpoint_id=box[0])
        fm.train(model, 2, rank)  # move on, then go back to the checkpoint
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, checkpoint_id=box[0])
        set_model_state_dict(model, sd["model"])
    full = {k: v.full_tensor().clone() for k, v in get_model_state_dict(model).items()}
    x, y = fm.batch(99, rank)
    loss = torch.nn.functional.mse_loss(model(x), y).item()
    resends = sum(getattr(ag, "exact_resends", 0) for ag in handle.all_gathers)
    handle.close()

    fresh = fm.build(seed=7)
    set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True))
    qsdp.quantize_comms(fresh, "sdp4bit")
    reference = torch.nn.functional.mse_loss(fresh(x), y).item()
    return loss, reference, resends


@pytest.mark.parametrize("action", ["load_state_dict", "edit", "dcp"])
def test_parameters_changed_outside_the_optimizer_re_establish_the_replicas(action):
    for loss, reference, resends in run_pooled(_first_loss_after, 2, action, local_world_size=1):
        assert resends >= 1
        assert loss == reference


def _edit_one_group(rank, world):
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit")
    fm.train(model, 3, rank)
    with torch.no_grad():
        model.blocks[0].fc1.weight.mul_(0.5)
    fm.train(model, 1, rank)
    return [ag.exact_resends for ag in handle.all_gathers]


def test_an_edit_of_one_weight_re_establishes_only_its_group():
    for resends in run_pooled(_edit_one_group, 2, local_world_size=1):
        assert resends == [0, 1, 0]  # root, blocks.0 (edited), blocks.1


def _one_rank_edits_alone(rank, world):
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit")
    fm.train(model, 3, rank)
    if rank == 1:  # the other ranks' parameters are untouched: only rank 1 can see the change
        with torch.no_grad():
            for p in model.blocks[0].parameters():
                p.mul_(0.5)
    edited = model.blocks[0].fc1.weight.full_tensor().clone()
    seen = []
    hook = model.blocks[0].fc1.register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    fm.train(model, 1, rank)  # training goes on, every rank on the same path
    hook.remove()
    return torch.equal(seen[0], edited), [ag.exact_resends for ag in handle.all_gathers]


def test_an_edit_on_one_rank_alone_re_establishes_the_group_on_every_rank():
    for exact, resends in run_pooled(_one_rank_edits_alone, 2, local_world_size=1):
        assert resends == [0, 1, 0]  # root, blocks.0 (edited on rank 1 only), blocks.1
        assert exact  # the gathered weights are the edited ones, exactly


def _no_spurious_resends(rank, world):
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit")
    fm.train(model, 6, rank)
    return sum(ag.exact_resends for ag in handle.all_gathers)


def test_ordinary_training_never_resends_exact_weights():
    assert run_pooled(_no_spurious_resends, 2, local_world_size=1) == [0, 0]


def _corrupt_replica(rank, world):
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit", overrides={"verify_replicas_every": 1})
    fm.train(model, 2, rank)
    if rank == 1:
        handle.all_gathers[1].replica.view(-1)[5] += 1.0
    try:
        fm.train(model, 1, rank)
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("world", [2, 4], ids=["full-replica", "node-replica-2x2"])
def test_diverged_replicas_are_an_error_naming_the_group_and_step(world):
    # Every rank raises, also those whose own replica rows agree (node replicas: local rank 0).
    for rank, msg in enumerate(run_pooled(_corrupt_replica, world, local_world_size=2 if world == 4 else 1)):
        assert "replicas diverged" in msg and "group 1 (blocks.0)" in msg and "at gather" in msg


def _silent_until(seen: str, cap: float = 12.0) -> None:
    """A peer that stops answering: silent until its peers have raised their timeout (they
    create ``seen``), or ``cap`` seconds."""
    deadline = time.monotonic() + cap
    while not os.path.exists(seen) and time.monotonic() < deadline:
        time.sleep(0.05)


def _timed(collective, seen: str) -> tuple[float, str] | None:
    """Seconds until ``collective()`` raised and its message (``None`` if it returned); ``seen``
    is created either way, so that the silent peer returns."""
    start = time.monotonic()
    try:
        collective()
    except RuntimeError as e:
        return time.monotonic() - start, str(e)
    finally:
        open(seen, "w").close()
    return None


def _silent_peer(rank, world, seen):
    from qsdp.comm import QuantizedAllGather, build_topology
    import torch.distributed as dist

    comm = QuantizedAllGather(qsdp.resolve_config("qsdp"), build_topology(), 0)
    if rank == 1:
        return _silent_until(seen)  # longer than the 3 s timeout
    out = torch.empty(2 * 64)
    return _timed(lambda: comm(output_tensor=out, input_tensor=out[:64], group=dist.group.WORLD), seen)


def test_a_peer_that_stops_answering_ends_the_collective_within_the_timeout(tmp_path):
    elapsed, msg = run_pooled(_silent_peer, 2, str(tmp_path / "seen"), pg_timeout=3, timeout=40)[0]
    assert elapsed < 10 and "timed out" in msg.lower()


def _subgroup_timeouts(rank, world):
    from qsdp.comm import build_topology
    from qsdp.comm.topology import group_timeout

    topo = build_topology(ranks_per_node=2)
    return [group_timeout(g).total_seconds() for g in (topo.group, topo.intra_group, topo.inter_group)]


def test_node_subgroups_keep_the_timeout_the_world_was_created_with():
    # torch's new_subgroups_* default to the backend's 30 minutes, not the world's timeout.
    assert run_pooled(_subgroup_timeouts, 4, local_world_size=2, pg_timeout=7) == [[7.0, 7.0, 7.0]] * 4


def _silent_inter_node_peer(rank, world, seen):
    from qsdp.comm import build_topology
    import torch.distributed as dist

    topo = build_topology(ranks_per_node=2)
    if rank == 3:
        return _silent_until(seen)  # the peer on the other node stops answering
    if rank != 1:
        return None  # ranks 0 and 2: the other inter-node pair
    return _timed(lambda: dist.all_reduce(torch.ones(8), group=topo.inter_group), seen)


def test_a_silent_peer_on_another_node_ends_the_inter_node_collective_within_the_timeout(tmp_path):
    elapsed, msg = run_pooled(_silent_inter_node_peer, 4, str(tmp_path / "seen"), local_world_size=2, pg_timeout=3,
                              timeout=40)[1]
    assert elapsed < 10 and "timed out" in msg.lower()


def _losses(rank, world, preset):
    model = fm.build()
    qsdp.quantize_comms(model, preset)
    return fm.train(model, 5, rank)


@pytest.mark.parametrize("preset", ["fsdp", "qsdp", "sdp4bit", "zeropp"])
def test_same_seed_and_config_give_identical_losses(preset):
    a = run_pooled(_losses, 4, preset, local_world_size=2)
    b = run_pooled(_losses, 4, preset, local_world_size=2)
    assert a == b
