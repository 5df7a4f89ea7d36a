"""``qsdp.check_gradients``: the one all-reduce after backward (non-finite flags, the gradient
norm, the caller's sums and the weight-difference agreement ahead of the optimizer step)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import qsdp
from distributed import run_pooled
import fsdp_models as fm

pytestmark = pytest.mark.timeout(180)


def _norm_and_sums(rank, world, nan_on):
    from torch.distributed.tensor import DTensor

    model = fm.build(depth=2)
    handle = qsdp.quantize_comms(model, "qsdp")
    x, y = fm.batch(0, rank)
    if rank == nan_on:
        x[0, 0] = float("nan")
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    reference = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    reference = reference.full_tensor() if isinstance(reference, DTensor) else reference
    check = qsdp.check_gradients(handle, model.parameters(), sums=[rank + 1, torch.tensor(10.0 * rank)])
    return check, reference.item()


def test_the_norm_is_the_global_gradient_norm_and_the_sums_are_over_every_rank():
    for check, reference in run_pooled(_norm_and_sums, 4, None, local_world_size=2):
        assert not check.nonfinite
        assert check.grad_norm == pytest.approx(reference, rel=1e-6)
        assert check.norm.item() == pytest.approx(check.grad_norm, rel=1e-6)
        assert check.sums == (1 + 2 + 3 + 4, 10.0 * (0 + 1 + 2 + 3))


def _hsdp_norm_and_sums(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    groups = qsdp.hsdp_groups(nodes=2, device_type="cpu")
    torch.manual_seed(0)
    model = fm.TinyNet()
    for b in model.blocks:
        fully_shard(b, mesh=groups.shard_mesh)
    fully_shard(model, mesh=groups.shard_mesh)
    handle = qsdp.quantize_comms(model, "hsdp4", group=groups.shard_group, replicate_group=groups.replicate_group)
    x, y = fm.batch(0, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    reference = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type=2.0)
    reference = reference.full_tensor() if isinstance(reference, DTensor) else reference
    return qsdp.check_gradients(handle, model.parameters(), sums=[rank + 1]), reference.item()


def test_under_hsdp_the_sums_hold_every_rank_and_the_norm_counts_the_replicas_once():
    for check, reference in run_pooled(_hsdp_norm_and_sums, 4, local_world_size=2):
        assert check.sums == (1 + 2 + 3 + 4,)
        assert check.grad_norm == pytest.approx(reference, rel=1e-6)


def test_a_non_finite_gradient_on_one_rank_is_seen_by_every_rank():
    assert [check.nonfinite for check, _ in run_pooled(_norm_and_sums, 4, 3, local_world_size=2)] == [True] * 4


def _train(rank, world, ahead, edit_rank=None):
    """sdp4bit on 2 nodes x 2 (node replicas): 4 steps, the weight-difference agreement at the
    first gather (``ahead=False``) or in the check after backward. ``edit_rank`` edits one
    group's weights after the check of step 1 (after its optimizer step)."""
    model = fm.build(depth=2)
    handle = qsdp.quantize_comms(model, "sdp4bit")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = []
    hook = model.blocks[0].fc1.register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    for step in range(4):
        x, y = fm.batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if ahead:
            assert not qsdp.check_gradients(handle, model.parameters(), agree_ahead=True).nonfinite
        opt.step()
        opt.zero_grad()
        if step == 1 and rank == edit_rank:
            with torch.no_grad():
                model.blocks[0].fc1.weight.mul_(0.5)
    hook.remove()
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    return shards, handle.comm_stats(), [ag.exact_resends for ag in handle.all_gathers], seen


def test_agreeing_ahead_trains_bit_identically_to_agreeing_at_the_gather():
    at_gather = run_pooled(_train, 4, False, local_world_size=2)
    ahead = run_pooled(_train, 4, True, local_world_size=2)
    for (shards, stats, _, _), (shards_, stats_, _, _) in zip(at_gather, ahead):
        assert all(torch.equal(a, b) for a, b in zip(shards, shards_))
        for kind in ("weights", "grads"):
            assert stats[kind] == stats_[kind]
        assert stats["control"]["total"]["bytes"] > 0 == stats_["control"]["total"]["bytes"]


def test_an_edit_after_the_check_keeps_the_ranks_together_and_is_resent_after_the_next_check():
    results = run_pooled(_train, 4, True, 1, local_world_size=2)
    for _, _, resends, seen in results:
        # root, blocks.0 (edited on rank 1 alone), blocks.1: resent at step 3, after step 2's check
        assert resends == [0, 1, 0]
    # every rank gathered the same weights at every step, the edit included
    for step in range(4):
        views = [seen[step] for _, _, _, seen in results]  # the forward's gathered weights
        assert all(torch.equal(views[0], v) for v in views[1:])


def _not_fsdp(rank, world):
    model = fm.build(depth=1)
    handle = qsdp.quantize_comms(model, "fsdp")
    probe = torch.nn.Linear(2, 1)
    probe(torch.ones(2)).sum().backward()
    try:
        qsdp.check_gradients(handle, probe.parameters())
    except ValueError as e:
        dist.barrier()
        return str(e)
    return None


def test_gradients_that_fsdp2_does_not_shard_are_refused_naming_the_fix():
    for message in run_pooled(_not_fsdp, 2, timeout=60):
        assert message is not None and "FSDP2's sharded gradients" in message and "pass the parameters" in message


def _dp_tp_check(rank, world, nan_on):
    """dp x tp (ranks [[0, 1], [2, 3]]: dp groups {0, 2} and {1, 3}, tp groups {0, 1} and {2, 3}).
    ``nan_on``: that rank's reduced root gradient holds a NaN, which no other rank reduces."""
    import layouts

    built = layouts.build("dp_tp")
    handle = qsdp.quantize_comms(built.model, "qsdp")
    if rank == nan_on:
        root = handle.reduce_scatters[-1]
        watch = root.watch

        def poisoned(output):
            output.view(-1)[0] = float("nan")
            watch(output)

        root.watch = poisoned
    x, y = fm.batch(0, built.data_rank)
    torch.nn.functional.mse_loss(built.model(x), y).backward()
    check = qsdp.check_gradients(handle, built.model.parameters(), sums=[1.0])
    # every element once: the full gradients, gathered
    reference = sum(float(p.grad.full_tensor().double().square().sum()) for p in built.model.parameters()) ** 0.5
    return check.nonfinite, check.grad_norm, reference, check.sums


def test_under_tensor_parallelism_the_norm_counts_each_element_once():
    for nonfinite, norm, reference, sums in run_pooled(_dp_tp_check, 4, None, local_world_size=2):
        assert not nonfinite
        assert norm == pytest.approx(reference, rel=1e-5)  # fp32 norms against a float64 sum
        assert sums == (4.0,)


def test_a_non_finite_gradient_skips_the_step_on_the_tensor_parallel_peers_too():
    # Rank 0's NaN is in dp group {0, 2}; ranks 1 and 3, its tp peers, must skip with it.
    assert [r[0] for r in run_pooled(_dp_tp_check, 4, 0, local_world_size=2)] == [True] * 4
