"""Quantized HSDP on 2 nodes x 2 ranks: 1-D FSDP2 inside the node, the gradient all-reduce
across the nodes quantized; replicas, accuracy, convergence, checkpoints and bad input."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import qsdp
from distributed import run_pooled
import fsdp_models as fm
from torch.distributed.fsdp import fully_shard

pytestmark = pytest.mark.timeout(240)

NODES, PER_NODE = 2, 2


def _hsdp_model(seed: int = 0, width: int = 32, depth: int = 2, native: bool = False, mp=None, device="cpu"):
    """TinyNet sharded with 1-D FSDP2 on this node's ranks (``native``: FSDP2's own HSDP on the
    2-D mesh); returns the model and the groups."""
    groups = qsdp.hsdp_groups(nodes=NODES, device_type=device)
    torch.manual_seed(seed)
    model = fm.TinyNet(width, depth).to(device)
    mesh = groups.mesh if native else groups.shard_mesh
    kw = {"mp_policy": mp} if mp is not None else {}
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=True, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, **kw)
    return model, groups


def _quantized_hsdp(preset: str, seed: int = 0, **kw):
    model, groups = _hsdp_model(seed)
    handle = qsdp.quantize_comms(model, preset, group=groups.shard_group,
                                 replicate_group=groups.replicate_group, **kw)
    return model, groups, handle


def _local_shards(model) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------ replicas


def _replicas_after_training(rank, world, preset, steps):
    # Every node starts from different weights: quantize_comms must make the replicas equal.
    model, groups, _ = _quantized_hsdp(preset, seed=groups_seed(rank, world))
    losses = fm.train(model, steps, rank)
    return groups.replicate_group.rank(), groups.shard_group.rank(), _local_shards(model), losses


def groups_seed(rank: int, world: int) -> int:
    return rank // (world // NODES)


# One rank per node: FSDP2 skips the reduce-scatter, the all-reduce runs as its hook.
@pytest.mark.parametrize("preset,per_node", [("hsdp4", 2), ("sdp4bit", 2), ("qsdp", 2), ("hsdp4", 1)])
def test_replicas_stay_bit_identical_across_nodes_after_many_steps(preset, per_node):
    results = run_pooled(_replicas_after_training, NODES * per_node, preset, 20, local_world_size=per_node)
    by_slot: dict[int, list] = {}
    for replica, slot, shards, losses in results:
        by_slot.setdefault(slot, []).append(shards)
        assert losses[-1] < 0.5 * losses[0]
    for copies in by_slot.values():
        assert len(copies) == NODES
        assert all(torch.equal(a, b) for a, b in zip(copies[0], copies[1]))


# ------------------------------------------------------------------ the all-reduce itself


def _all_reduce_trials(rank, world, overrides, trials, n):
    from qsdp.comm.hsdp import ReplicaAllReduce

    groups = qsdp.hsdp_groups(nodes=NODES, device_type="cpu")
    cfg = qsdp.resolve_config("hsdp4", overrides)
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * (1 + torch.arange(n) % 7)
    exact = x.clone()
    dist.all_reduce(exact, group=groups.replicate_group)
    reduce = ReplicaAllReduce(cfg, groups.replicate_group, comm_id=0)
    got = torch.stack([reduce(x) for _ in range(trials)])
    parts = [torch.empty_like(x) for _ in range(NODES)]
    dist.all_gather(parts, x, group=groups.replicate_group)
    return x, torch.stack(parts), exact, got


def _hadamard_absmax(x: torch.Tensor, block: int, group: int) -> torch.Tensor:
    """The largest magnitude of ``x`` (padded to whole groups) after the blockwise transform."""
    from qsdp.codecs import hadamard

    pad = -x.numel() % group
    xp = torch.cat([x, x[-1:].expand(pad)]) if pad else x
    return hadamard(xp.view(1, -1), block=block).abs().max()


def test_quantized_all_reduce_is_within_the_quantizers_bound_of_the_exact_sum():
    n, block, group, qmax = 1000, 32, 128, 7
    for x, parts, exact, got in run_pooled(_all_reduce_trials, 4, None, 3, n, local_world_size=PER_NODE):
        # Chunks are quantized separately, but the global largest value bounds every group's.
        first = sum(_hadamard_absmax(p, block, group) / qmax for p in parts)
        second = (_hadamard_absmax(exact, block, group) + first) / qmax
        err = (got - exact).abs().max()
        assert 0 < err <= (first + second) * (1 + 1e-5)


def test_every_replica_gets_the_same_bits():
    results = run_pooled(_all_reduce_trials, 4, None, 3, 300, local_world_size=PER_NODE)
    # world ranks 0 and 2 form one replicate group, 1 and 3 the other
    assert torch.equal(results[0][3], results[2][3]) and torch.equal(results[1][3], results[3][3])
    assert not torch.equal(results[0][3][0], results[0][3][1])  # each call rounds afresh


@pytest.mark.parametrize("overrides", [None, {"hsdp.bits": 8, "hsdp.hadamard_block": 0}], ids=["4bit-hadamard", "8bit"])
def test_quantized_all_reduce_is_unbiased(overrides):
    trials = 400
    x, _, exact, got = run_pooled(_all_reduce_trials, 4, overrides, trials, 256, local_world_size=PER_NODE)[0]
    err = got - exact
    std = err.std(dim=0)
    assert (std > 0).all()
    z = err.mean(dim=0) / (std / trials**0.5)
    assert z.abs().max() < 5.0  # 256 elements: P(max |z| > 5) is about 1e-4 for an unbiased quantizer


# ------------------------------------------------------------------ FSDP2's all-reduce hook


def _spy_on_the_all_reduce(record) -> None:
    """Call ``record()`` at every call of ReplicaAllReduce (in a child process: the patch dies
    with it)."""
    from qsdp.comm.hsdp import ReplicaAllReduce

    original = ReplicaAllReduce.__call__

    def spy(self, x, inplace=False):
        record()
        return original(self, x, inplace)

    ReplicaAllReduce.__call__ = spy


def _callers() -> list[tuple[str, str]]:
    """(function, class of its ``self``) of every frame above the spy."""
    frame, out = sys._getframe(2), []
    while frame is not None:
        owner = frame.f_locals.get("self")
        out.append((frame.f_code.co_name, type(owner).__name__ if owner is not None else ""))
        frame = frame.f_back
    return out


def _who_calls_the_all_reduce(rank, world):
    calls: list[list[tuple[str, str]]] = []
    _spy_on_the_all_reduce(lambda: calls.append(_callers()))
    model, _, _ = _quantized_hsdp("hsdp4")
    fm.train(model, 1, rank)
    return calls


def test_the_inter_node_all_reduce_runs_in_fsdp2s_all_reduce_hook_not_in_the_reduce_scatter():
    for calls in run_pooled(_who_calls_the_all_reduce, 4, local_world_size=PER_NODE):
        assert len(calls) == 3  # one per FSDP group
        for frames in calls:
            assert ("hook", "HsdpReduceScatter") in frames
            assert ("__call__", "HsdpReduceScatter") not in frames
            assert "foreach_reduce" in [name for name, _ in frames]  # FSDP2 calls the hook


class _ReduceScatterThenAllReduce:
    """The reference: the intra-node reduce-scatter and the all-reduce across replicas composed
    in FSDP2's reduce-scatter call, one after the other, with the same pieces."""

    def __init__(self, rs) -> None:
        self.rs = rs

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        divisor = (group.size() if op == dist.ReduceOp.AVG else 1) * self.rs.replica_divisor
        self.rs.inner(output_tensor, input_tensor, group, dist.ReduceOp.SUM)
        total = self.rs.all_reduce(output_tensor.float(), inplace=True)
        if divisor != 1:
            total.div_(divisor)
        if total is not output_tensor:
            output_tensor.copy_(total)


def _hook_or_composed(rank, world, preset, reduce_dtype, composed):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model, groups = _hsdp_model(width=64, mp=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    handle = qsdp.quantize_comms(model, preset, group=groups.shard_group, replicate_group=groups.replicate_group)
    if composed:
        for m, rs in zip(handle.modules, handle.reduce_scatters):
            m.set_custom_reduce_scatter(_ReduceScatterThenAllReduce(rs))
            m.set_all_reduce_hook(None)
    losses = fm.train(model, 4, rank)
    return losses, _local_shards(model), handle.comm_stats()


# fp32 reduces with AVG (divided in the hook); fp16 makes FSDP2 divide before and after the hook.
# bf16 takes fp32's path (FSDP2's _get_gradient_divide_factors: no overflow risk): make test-all.
@pytest.mark.parametrize("reduce_dtype", [
    torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow), torch.float16], ids=str)
@pytest.mark.parametrize("preset", ["hsdp4", "sdp4bit"])
def test_the_hook_gives_the_bits_and_bytes_of_the_all_reduce_composed_into_the_reduce_scatter(preset, reduce_dtype):
    hooked = run_pooled(_hook_or_composed, 4, preset, reduce_dtype, False, local_world_size=PER_NODE)
    composed = run_pooled(_hook_or_composed, 4, preset, reduce_dtype, True, local_world_size=PER_NODE)
    for (losses, shards, stats), (losses_, shards_, stats_) in zip(hooked, composed):
        assert losses == losses_
        assert all(torch.equal(a, b) for a, b in zip(shards, shards_))
        assert stats == stats_ and stats["grads"]["inter"]["bytes"] > 0


def _hook_replaced(rank, world):
    model, _, handle = _quantized_hsdp("hsdp4")
    for m in handle.modules:
        m.set_all_reduce_hook(lambda output: None)
    try:
        fm.train(model, 2, rank)
    except RuntimeError as e:
        return str(e)
    return None


def test_replacing_the_all_reduce_hook_fails_instead_of_leaving_the_replicas_apart():
    for message in run_pooled(_hook_replaced, 4, local_world_size=PER_NODE, timeout=90):
        assert message is not None and "never reached the all-reduce hook" in message
        assert "set_all_reduce_hook" in message


def _hook_streams(rank, world):
    from qsdp._fsdp2 import param_groups

    # Every rank on cuda:0: DeviceMesh leaves the device alone once CUDA is initialized (else it
    # would set cuda:LOCAL_RANK, which a one-GPU machine lacks).
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    model, groups = _hsdp_model(device="cuda")
    qsdp.quantize_comms(model, "hsdp4", group=groups.shard_group, replicate_group=groups.replicate_group)
    ctx = param_groups(model)[0].comm_ctx
    seen: list[tuple[bool, bool]] = []
    _spy_on_the_all_reduce(lambda: seen.append((torch.cuda.current_stream() == ctx.all_reduce_stream,
                                                torch.cuda.current_stream() == ctx.reduce_scatter_stream)))
    fm.train(model, 2, rank, device="cuda")
    return seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_all_reduce_runs_on_the_stream_fsdp2_passes_its_hook():
    # 4 ranks share cuda:0 over gloo (CUDA tensors); spawned: this process may hold a CUDA context.
    for seen in run_pooled(_hook_streams, 4, local_world_size=PER_NODE, start_method="spawn", timeout=200):
        assert seen == [(True, False)] * 6  # 3 groups x 2 steps, none on the reduce-scatter stream


# ------------------------------------------------------------------ against FSDP2's native HSDP


def _train_losses(rank, world, preset, steps):
    if preset is None:  # FSDP2's own HSDP on the 2-D mesh
        model, _ = _hsdp_model(native=True)
    else:
        model, _, _ = _quantized_hsdp(preset)
    return fm.train(model, steps, rank)


def _gradients(rank, world, preset, reduce_dtype, factor=None):
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    model, groups = _hsdp_model(native=preset is None, mp=mp)
    if factor is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(factor)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    if preset is not None:
        qsdp.quantize_comms(model, preset, group=groups.shard_group, replicate_group=groups.replicate_group)
    x, y = fm.batch(0, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.to_local().float().clone() for p in model.parameters()]


# Adam does not see the scale of the gradients: compare the averaged gradients themselves.
# fp32 reduces with ReduceOp.AVG; fp16 makes FSDP2 pre-divide and sum (its overflow guard).
@pytest.mark.parametrize("reduce_dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
def test_gradients_are_averaged_over_every_rank_as_native_hsdp_does(reduce_dtype, tol):
    native = run_pooled(_gradients, 4, None, reduce_dtype, local_world_size=PER_NODE)
    ours = run_pooled(_gradients, 4, "fsdp", reduce_dtype, local_world_size=PER_NODE)
    for a, b in zip(native, ours):
        for ga, gb in zip(a, b):
            assert torch.allclose(ga, gb, rtol=tol, atol=tol * ga.abs().max().item())


# A custom divide factor (torchtitan sets one) is the whole division, across replicas too.
@pytest.mark.parametrize("world,per_node", [(4, 2), (2, 1)], ids=["2x2", "2x1-hook"])
def test_a_custom_gradient_divide_factor_is_the_whole_division_as_in_native_hsdp(world, per_node):
    native = run_pooled(_gradients, world, None, torch.float32, 1.0, local_world_size=per_node)
    ours = run_pooled(_gradients, world, "fsdp", torch.float32, 1.0, local_world_size=per_node)
    for a, b in zip(native, ours):
        for ga, gb in zip(a, b):
            assert torch.allclose(ga, gb, rtol=1e-6, atol=1e-6 * ga.abs().max().item())


# 20 steps: the runs are deterministic, and hsdp4's and sdp4bit's last losses are as close to
# native at 20 as at 40 (0.17 and 0.12 of the bound below, against 0.29 and 0.26; the slow
# hsdp8 and zeropp: 0.03 and 0.59, against 0.03 and 0.53), the loss fallen to 0.30 of its start
# at most (the bound: 0.5).
CURVE_STEPS = 20


@pytest.fixture(scope="module")
def native_losses():
    return run_pooled(_train_losses, 4, None, CURVE_STEPS, local_world_size=PER_NODE)


def test_the_exact_route_matches_native_hsdp(native_losses):
    # fsdp preset: plain reduce-scatter in the node, fp32 all-reduce across nodes
    got = run_pooled(_train_losses, 4, "fsdp", CURVE_STEPS, local_world_size=PER_NODE)
    for ours, native in zip(got, native_losses):
        assert ours == pytest.approx(native, rel=1e-4, abs=1e-6)


# Only the all-reduce quantized: close. zeropp also gathers 4-bit weights (qW, nearest rounding),
# which SDP4Bit measured at +12% loss: the looser bound of the repo's other preset tests.
@pytest.mark.parametrize("preset,rel,slack", [
    ("hsdp4", 0.25, 0.02), ("sdp4bit", 0.25, 0.02),
    pytest.param("hsdp8", 0.25, 0.02, marks=pytest.mark.slow),
    pytest.param("zeropp", 0.5, 0.05, marks=pytest.mark.slow),
])
def test_quantized_hsdp_trains_close_to_native_hsdp(preset, rel, slack, native_losses):
    got = run_pooled(_train_losses, 4, preset, CURVE_STEPS, local_world_size=PER_NODE)
    for ours, native in zip(got, native_losses):
        last, base = sum(ours[-5:]) / 5, sum(native[-5:]) / 5
        assert last < 0.5 * sum(ours[:5]) / 5
        assert abs(last - base) < rel * base + slack


def _meter_one_step(rank, world, preset):
    model, groups = _hsdp_model(width=128)
    qsdp.quantize_comms(model, preset, group=groups.shard_group, replicate_group=groups.replicate_group)
    qsdp.comm_stats(reset=True)
    fm.train(model, 1, rank)
    return qsdp.comm_stats(reset=True)


def test_the_meter_shows_4_bit_gradients_between_nodes_and_exact_traffic_inside():
    for stats in run_pooled(_meter_one_step, 4, "hsdp4", local_world_size=PER_NODE):
        assert 4.0 < stats["grads"]["inter"]["bits_per_element"] < 4.6  # codes + fp32 scales + padding
        assert stats["grads"]["intra"]["bits_per_element"] == 32.0
        assert stats["weights"]["inter"]["bytes"] == 0  # weights are gathered inside the node
        assert stats["weights"]["intra"]["bits_per_element"] == 32.0


def test_the_plain_all_reduce_is_metered_at_full_precision():
    for stats in run_pooled(_meter_one_step, 4, "fsdp", local_world_size=PER_NODE):
        assert stats["grads"]["inter"]["bits_per_element"] == 32.0
        assert stats["grads"]["inter"]["bytes"] > 0


# ------------------------------------------------------------------ checkpoint and resume


def _steps(model, opt, start: int, n: int, rank: int) -> None:
    for step in range(start, start + n):
        x, y = fm.batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _resume(rank, world, path):
    from qsdp.train.checkpoint import load_checkpoint, save_checkpoint

    model, _, handle = _quantized_hsdp("sdp4bit")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _steps(model, opt, 0, 3, rank)
    save_checkpoint(path, 3, model, opt, handle, {})
    _steps(model, opt, 3, 3, rank)
    straight = _local_shards(model)
    handle.close()

    model, _, handle = _quantized_hsdp("sdp4bit", seed=5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _steps(model, opt, 0, 1, rank)  # optimizer state exists before the load, as in a restarted run
    load_checkpoint(f"{path}/checkpoints/step_00000003", model, opt, handle, torch.device("cpu"))
    _steps(model, opt, 3, 3, rank)
    return straight, _local_shards(model)


def test_checkpoint_and_resume_is_bit_identical(tmp_path):
    for straight, resumed in run_pooled(_resume, 4, str(tmp_path), local_world_size=PER_NODE):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


# ------------------------------------------------------------------ bad input


def _error(rank, world, case):
    model, groups = _hsdp_model()
    if case == "overlap":
        kwargs = {"group": groups.shard_group, "replicate_group": groups.shard_group}
    elif case == "overlap-on-one-rank":
        kwargs = {"group": groups.shard_group,
                  "replicate_group": groups.shard_group if rank == 0 else groups.replicate_group}
    elif case == "no-shard-mesh":  # nothing sharded names a mesh, so group= is needed
        model = torch.nn.Sequential(torch.nn.ReLU())
        fully_shard(model, mesh=groups.shard_mesh)
        kwargs = {"replicate_group": groups.replicate_group}
    elif case == "sharded-over-the-world":  # the group taken from the model holds the replicas
        torch.manual_seed(0)
        model = fm.TinyNet()
        fully_shard(model)
        kwargs = {"replicate_group": groups.replicate_group}
    else:  # "inconsistent": rank 0 (slot 0 of its node) paired with rank 3 (slot 1 of its node)
        bad, _ = dist.new_subgroups_by_enumeration([[0, 3], [1, 2]])
        kwargs = {"group": groups.shard_group, "replicate_group": bad}
    qsdp.comm_stats(reset=True)
    try:
        qsdp.quantize_comms(model, "sdp4bit", **kwargs)
    except qsdp.ConfigError as e:
        stats = qsdp.comm_stats(reset=True)
        return str(e), stats["grads"]["total"]["bytes"] + stats["weights"]["total"]["bytes"]
    return None, None


@pytest.mark.parametrize("case,words", [
    ("overlap", "must share exactly this rank"),
    ("overlap-on-one-rank", "rank 0: the replicate group"),
    ("no-shard-mesh", "needs group="),
    ("sharded-over-the-world", "must share exactly this rank"),
    ("inconsistent", "inconsistent HSDP groups"),
])
def test_bad_hsdp_setups_raise_a_clear_error_before_any_data_moves(case, words):
    for message, moved in run_pooled(_error, 4, case, local_world_size=PER_NODE, timeout=90):
        assert message is not None and words in message
        assert "replicate_group=groups.replicate_group" in message  # the recipe
        assert moved == 0


def _shard_group_from_the_model(rank, world):
    """The same model trained twice: with ``group=`` the shard mesh's group, and without it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    out = []
    for explicit in (True, False):
        torch.manual_seed(0)
        model = fm.TinyNet()
        for b in model.blocks:
            fully_shard(b, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        kw = {"group": mesh["shard"].get_group()} if explicit else {}
        handle = qsdp.quantize_comms(model, "sdp4bit", replicate_group=mesh["replicate"].get_group(), **kw)
        losses = fm.train(model, 2, rank)
        out.append((dist.get_process_group_ranks(handle.topology.group), losses, _local_shards(model)))
        handle.close()
    return out


def test_the_shard_group_is_taken_from_the_model_when_group_is_not_given():
    for rank, ((ranks, losses, shards), (ranks_, losses_, shards_)) in enumerate(
            run_pooled(_shard_group_from_the_model, 4, local_world_size=PER_NODE)):
        node = rank // PER_NODE
        assert ranks == ranks_ == [node * PER_NODE + j for j in range(PER_NODE)]
        assert losses == losses_
        assert all(torch.equal(a, b) for a, b in zip(shards, shards_))


def _without_replicate_group(rank, world, presets):
    messages = {}
    for preset in presets:
        try:
            qsdp.quantize_comms(fm.build(), preset)
            messages[preset] = None
        except qsdp.ConfigError as e:
            messages[preset] = str(e)
    return messages


def test_a_config_that_quantizes_only_the_replica_all_reduce_needs_a_replicate_group():
    presets = ("hsdp4", "hsdp8")
    for messages in run_pooled(_without_replicate_group, 2, presets, timeout=60):
        for preset in presets:
            message = messages[preset]
            assert message is not None and repr(preset) in message
            assert "without replicate_group=" in message and "plain FSDP" in message


# ------------------------------------------------------------------ non-finite gradients


def _nan_on_one_node(rank, world, preset, bad_step):
    model, _, handle = _quantized_hsdp(preset)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    skipped = []
    for step in range(4):
        x, y = fm.batch(step, rank)
        if step == bad_step and rank == 3:  # one rank of the second node
            x[0, 0] = float("nan")
        torch.nn.functional.mse_loss(model(x), y).backward()
        if handle.nonfinite_gradients():
            skipped.append(step)
        else:
            opt.step()
        opt.zero_grad()
    return skipped, _local_shards(model)


@pytest.mark.parametrize("preset", ["fsdp", "hsdp4"])
def test_a_nan_gradient_on_one_node_skips_the_step_on_every_node(preset):
    results = run_pooled(_nan_on_one_node, 4, preset, 2, local_world_size=PER_NODE)
    assert [skipped for skipped, _ in results] == [[2]] * 4
    for a, b in ((0, 2), (1, 3)):  # the replicas of each slot stay equal and finite
        assert all(torch.equal(x, y) and torch.isfinite(x).all() for x, y in zip(results[a][1], results[b][1]))


def _accumulate(rank, world, steps, micro):
    model, _, handle = _quantized_hsdp("hsdp4")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        for k in range(micro):
            model.set_requires_gradient_sync(k == micro - 1)
            x, y = fm.batch(step * micro + k, rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [rs.all_reduce.calls for rs in handle.reduce_scatters], _local_shards(model)


def test_gradient_accumulation_runs_one_all_reduce_per_step_on_the_last_micro_batch():
    results = run_pooled(_accumulate, 4, 3, 2, local_world_size=PER_NODE)
    assert all(calls == [3, 3, 3] for calls, _ in results)
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(x, y) for x, y in zip(results[a][1], results[b][1]))
