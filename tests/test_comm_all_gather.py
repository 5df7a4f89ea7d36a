"""Weight all-gathers against the exact all-gather, on real gloo groups."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import qsdp
from qsdp.comm import DifferenceAllGather, QuantizedAllGather, build_topology
from qsdp.comm.collectives import all_gather_flat
from qsdp.comm.versions import ChangeTracker
from distributed import run_pooled

pytestmark = pytest.mark.timeout(120)


def _config(mode="direct", bits=4, group_size=16, symmetric=True, rounding="stochastic", seed=0):
    # The worlds here are one node, where the default replica layout holds none: the weight-
    # difference algorithm is tested on SDP4Bit's full replica.
    return qsdp.QuantConfig(
        weights=qsdp.WeightComm(mode, bits=bits, group_size=group_size, symmetric=symmetric, rounding=rounding,
                                replica="full"),
        seed=seed,
    )


def _shard(rank: int, n: int, step: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(97 * rank + 10_000 * step + 1)
    return (torch.randn(n, generator=g) * (1 + rank)).to(dtype)


def _gather(comm, shard: torch.Tensor, world: int, group=None) -> torch.Tensor:
    """Call an FSDP2-style all-gather: the shard is first copied into its slice of the output."""
    import torch.distributed as dist

    group = group or dist.group.WORLD
    rank = dist.get_rank()
    n = shard.numel()
    out = comm.allocate((world * n,), dtype=shard.dtype, device=shard.device)
    inp = out[rank * n : (rank + 1) * n]
    inp.copy_(shard)
    comm(output_tensor=out, input_tensor=inp, group=group, async_op=False)
    return out


def _group_scales(x: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> torch.Tensor:
    """Per-element grid step of the group the element belongs to."""
    n = x.numel()
    pad = (-n) % group_size
    g = torch.cat([x.float(), x.float()[-1:].expand(pad)]).view(-1, group_size)
    if symmetric:
        s = g.abs().amax(1) / (2 ** (bits - 1) - 1)
    else:
        s = (g.amax(1) - g.amin(1)) / (2**bits - 1)
    return s.repeat_interleave(group_size)[:n]


def _direct_error_within_bound(rank, world, n, bits, symmetric, rounding):
    import torch.distributed as dist

    cfg = _config("direct", bits=bits, group_size=16, symmetric=symmetric, rounding=rounding)
    comm = QuantizedAllGather(cfg, build_topology(), 0)
    out = _gather(comm, _shard(rank, n), world)
    exact = torch.cat([_shard(r, n) for r in range(world)])
    bound = torch.cat([_group_scales(_shard(r, n), bits, 16, symmetric) for r in range(world)])
    factor = 0.5 if rounding == "nearest" else 1.0
    excess = ((out - exact).abs() - factor * bound * (1 + 1e-5) - 1e-6).max().item()
    return excess


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_direct_gather_error_within_quantizer_bound_for_every_world_size(world):
    excess = run_pooled(_direct_error_within_bound, world, 37, 4, True, "stochastic")
    assert max(excess) <= 0


@pytest.mark.parametrize("bits,symmetric,rounding", [(8, False, "shift"), (2, True, "nearest"), (4, False, "stochastic")])
def test_direct_gather_error_within_bound_for_each_scheme(bits, symmetric, rounding):
    excess = run_pooled(_direct_error_within_bound, 2, 45, bits, symmetric, rounding)
    assert max(excess) <= 0


def _gather_twice(rank, world):
    cfg = _config("direct", bits=4, rounding="stochastic")
    tracker = ChangeTracker()  # told of optimizer steps, as quantize_comms' hooks do
    comm = QuantizedAllGather(cfg, build_topology(), 0, tracker)
    a = _gather(comm, _shard(rank, 40), world)
    b = _gather(comm, _shard(rank, 40), world)  # the backward gather of the same step
    tracker.before_optimizer_step()
    tracker.after_optimizer_step()
    c = _gather(comm, _shard(rank, 40, step=1), world)
    d = _gather(comm, _shard(rank, 40, step=1), world)
    return torch.equal(a, b), torch.equal(c, d), torch.equal(a, c)


def test_forward_and_backward_gathers_of_one_step_are_bit_identical():
    for same_ab, same_cd, same_ac in run_pooled(_gather_twice, 2):
        assert same_ab and same_cd and not same_ac


def _mean_over_seeds(rank, world, mode, rounding, trials):
    total = None
    for seed in range(trials):
        cfg = _config(mode, bits=2, group_size=16, symmetric=False, rounding=rounding, seed=seed)
        comm = QuantizedAllGather(cfg, build_topology(), 0)
        out = _gather(comm, _shard(rank, 32), world).double()
        total = out if total is None else total + out
    exact = torch.cat([_shard(r, 32) for r in range(world)]).double()
    scale = torch.cat([_group_scales(_shard(r, 32), 2, 16, False) for r in range(world)]).double()
    # Each trial's error lies in (-scale, scale): variance <= scale^2 / 4 (Bernoulli), so the mean
    # of `trials` draws is within 6 standard deviations with overwhelming probability.
    z = ((total / trials - exact).abs() / (scale / 2 / trials**0.5)).max().item()
    return z


@pytest.mark.parametrize("rounding", ["stochastic", "shift"])
def test_direct_gather_is_unbiased_over_seeds(rounding):
    z = run_pooled(_mean_over_seeds, 2, "direct", rounding, 300)
    assert max(z) < 6.0


def test_nearest_rounding_fails_the_same_unbiasedness_test():
    z = run_pooled(_mean_over_seeds, 2, "direct", "nearest", 300)
    assert max(z) > 6.0


def _dtype_kept(rank, world, dtype):
    cfg = _config("direct", bits=8)
    comm = QuantizedAllGather(cfg, build_topology(), 0)
    out = _gather(comm, _shard(rank, 24, dtype=dtype), world)
    wd = DifferenceAllGather(dataclasses.replace(cfg, weights=dataclasses.replace(cfg.weights, mode="difference")), build_topology(), 1)
    out2 = _gather(wd, _shard(rank, 24, dtype=dtype), world)
    out3 = _gather(wd, _shard(rank, 24, step=1, dtype=dtype), world)
    return out.dtype, out2.dtype, out3.dtype, wd.replica.dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gathered_weights_keep_the_parameter_dtype(dtype):
    for dtypes in run_pooled(_dtype_kept, 2, dtype):
        assert set(dtypes) == {dtype}


def _difference_run(rank, world, steps, dtype):
    """`steps` random updates of every shard; returns per-step replicas and error ratios."""
    import torch.distributed as dist

    topo = build_topology()
    wd = DifferenceAllGather(_config("difference", bits=4, group_size=16), topo, 0)
    direct = QuantizedAllGather(_config("direct", bits=4, group_size=16), topo, 1)
    n = 48
    weights = [_shard(r, n, dtype=torch.float32) * 0.5 for r in range(world)]
    replicas, wd_excess, wd_err, direct_err = [], [], [], []
    for step in range(steps):
        if step:
            for r in range(world):
                g = torch.Generator().manual_seed(step * 31 + r)
                weights[r] = weights[r] - 0.01 * torch.randn(n, generator=g)
        exact = torch.cat(weights).to(dtype)
        prev = None if wd.replica is None else wd.replica.float().view(-1).clone()
        out = _gather(wd, weights[rank].to(dtype), world)
        replicas.append(wd.replica.clone())
        if prev is not None:
            diff_scale = torch.cat([
                _group_scales(exact.float()[r * n:(r + 1) * n] - prev[r * n:(r + 1) * n], 4, 16, True)
                for r in range(world)
            ])
            # The replica's error is the last difference's quantization error: no accumulation.
            wd_excess.append(((out.float() - exact.float()).abs() - diff_scale * (1 + 1e-4) - 1e-6).max().item())
        wd_err.append((out.float() - exact.float()).abs().max().item())
        direct_err.append((_gather(direct, weights[rank].to(dtype), world).float() - exact.float()).abs().max().item())
    return replicas, wd_excess, wd_err, direct_err


@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (3, torch.bfloat16), (4, torch.float32)])
def test_difference_replicas_stay_bit_identical_on_every_rank(world, dtype):
    results = run_pooled(_difference_run, world, 50, dtype)
    for step in range(50):
        ref = results[0][0][step]
        assert all(torch.equal(ref, res[0][step]) for res in results[1:]), f"replicas differ at step {step}"


def test_difference_error_is_bounded_by_the_last_difference_and_far_below_direct_quantization():
    results = run_pooled(_difference_run, 2, 50, torch.float32)
    for replicas, wd_excess, wd_err, direct_err in results:
        assert max(wd_excess) <= 0  # never more than one quantization step of the last update
        assert wd_err[0] == 0.0  # the first gather sends exact values
        assert max(wd_err[40:]) <= 1.5 * max(wd_err[1:10])  # no accumulation over 50 steps
        assert sum(wd_err[1:]) * 5 < sum(direct_err[1:])  # 4-bit differences beat 4-bit weights


def _unchanged_sends_nothing(rank, world):
    from qsdp.comm.meter import METER

    tracker = ChangeTracker()
    wd = DifferenceAllGather(_config("difference"), build_topology(), 0, tracker)
    _gather(wd, _shard(rank, 64), world)
    tracker.after_optimizer_step()
    updated = _gather(wd, _shard(rank, 64, step=1), world)  # a 4-bit difference
    METER.snapshot(reset=True)
    again = _gather(wd, _shard(rank, 64, step=1), world)  # no step since: the backward gather
    stats = METER.snapshot(reset=True)
    wd.reset()
    exact = _gather(wd, _shard(rank, 64, step=2), world)  # after reset: exact values
    return stats["weights"]["total"]["bytes"], torch.equal(again, updated), exact


def test_unchanged_shards_send_no_weight_bytes_and_reset_resends_exact_values():
    results = run_pooled(_unchanged_sends_nothing, 2)
    exact = torch.cat([_shard(r, 64, step=2) for r in range(2)])
    for weight_bytes, same_as_forward, after_reset in results:
        assert weight_bytes == 0
        assert same_as_forward
        assert torch.equal(after_reset, exact)


def _small_shard_fallback(rank, world, min_numel):
    from qsdp.comm.meter import METER

    cfg = dataclasses.replace(_config("direct", bits=4), min_shard_numel=min_numel)
    comm = QuantizedAllGather(cfg, build_topology(), 0)
    METER.snapshot(reset=True)
    out = _gather(comm, _shard(rank, 10 + rank * 0), world)
    return torch.equal(out, torch.cat([_shard(r, 10) for r in range(world)])), METER.snapshot()["weights"]["total"]["bits_per_element"]


def test_shards_below_min_shard_numel_travel_exactly_on_every_rank():
    for exact, bits in run_pooled(_small_shard_fallback, 3, 11):
        assert exact and bits == 32.0


def test_direct_gather_meter_counts_packed_bytes():
    def run(rank, world):
        from qsdp.comm.meter import METER

        comm = QuantizedAllGather(_config("direct", bits=4, group_size=128), build_topology(), 0)
        METER.snapshot(reset=True)
        _gather(comm, _shard(rank, 128 * 64), world)
        return METER.snapshot()["weights"]
    for stats in run_pooled(run, 4, local_world_size=2):
        assert stats["intra"]["bits_per_element"] == pytest.approx(4.25)
        assert stats["inter"]["bytes"] == 2 * stats["intra"]["bytes"]  # 2 peers in the other node, 1 in mine


def _node_and_full(rank, world, steps):
    """The same updates through full and node replicas (2 nodes x 2); per step the outputs of
    both, and the meter of the last node-replica gather."""
    from qsdp.comm.meter import METER

    topo = build_topology()
    comms = {}
    for layout in ("full", "node"):
        cfg = dataclasses.replace(_config("difference", bits=4, group_size=32), weights=qsdp.WeightComm(
            "difference", bits=4, group_size=32, symmetric=True, rounding="stochastic", replica=layout))
        tracker = ChangeTracker()
        comms[layout] = (DifferenceAllGather(cfg, topo, 0, tracker), tracker)
    outs = {"full": [], "node": []}
    for step in range(steps):
        for layout, (comm, tracker) in comms.items():
            if step:
                tracker.after_optimizer_step()
            METER.snapshot(reset=True)
            outs[layout].append(_gather(comm, _shard(rank, 96, step=step), world).clone())
    node = comms["node"][0]
    return outs, METER.snapshot(reset=True)["weights"], node.rows, tuple(node.replica.shape)


def test_node_replicas_give_bit_identical_weights_to_full_replicas_with_a_quarter_of_the_rows():
    results = run_pooled(_node_and_full, 4, 6, local_world_size=2)
    for rank, (outs, meter, rows, shape) in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(outs["full"], outs["node"]))
        assert not torch.equal(outs["node"][0], outs["node"][-1])  # the weights did move
        assert rows == [rank % 2, 2 + rank % 2] and shape == (2, 96)  # rows (d', j): full / M
        # 4 bits + one fp32 scale per 32 between nodes; the rows in fp32 inside the node
        assert meter["inter"]["bits_per_element"] == pytest.approx(4 + 32 / 32)
        assert meter["intra"]["bits_per_element"] == 32.0


def _node_fills(rank, world):
    """A node replica's fill of FSDP2's buffer (2 nodes x 2) both ways: the plan gloo gets (one
    gather into a temporary, reordered) and one grouped gather straight into each node's block."""
    import torch.distributed as dist

    cfg = qsdp.QuantConfig(weights=qsdp.WeightComm("difference", bits=4, group_size=16, replica="node"))
    tracker = ChangeTracker()
    comm = DifferenceAllGather(cfg, build_topology(), 0, tracker)
    _gather(comm, _shard(rank, 40), world)
    tracker.after_optimizer_step()
    _gather(comm, _shard(rank, 40, step=1), world)  # a difference: the replica rows are no shard's
    plan = next(iter(comm._plans.values()))
    fills = []
    for way in (plan, dataclasses.replace(plan, source=None)):
        out = torch.full((world * 40,), float("nan"))
        comm._fill(out, way)
        fills.append(out)
    everyone = torch.empty(world * comm.replica.numel())
    all_gather_flat(everyone, comm.replica.reshape(-1).contiguous(), dist.group.WORLD)
    # rank q's replica holds the rows of the ranks with its local index (q % 2, 2 + q % 2): row r
    # is row r // 2 of rank r % 2's replica (node 0's holder of it)
    held = everyone.view(world, 2, 40)
    expected = torch.stack([held[r % 2, r // 2] for r in range(world)])
    return plan.source is not None, fills, expected.view(-1)


def test_a_node_replicas_fill_puts_every_row_in_fsdp2s_order_whichever_way_it_gathers():
    # gloo keeps the temporary (its grouped gather copies through flat buffers of its own); NCCL
    # and the census's groups gather straight into the blocks: both give every rank's row in place
    for reordered, (through_temporary, grouped), expected in run_pooled(_node_fills, 4, local_world_size=2):
        assert reordered
        assert torch.equal(through_temporary, expected) and torch.equal(grouped, expected)


def test_a_groups_backend_is_read_for_the_tensors_device():
    from qsdp.comm.collectives import backend_of

    assert backend_of("cpu:gloo,cuda:nccl", "cuda") == "nccl" and backend_of("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_of("NCCL", "cuda") == "nccl" and backend_of("gloo", "cuda") == "gloo"


def _node_replica_on_one_node(rank, world):
    from qsdp.comm.meter import METER

    cfg = qsdp.QuantConfig(weights=qsdp.WeightComm("difference", bits=4, group_size=16, replica="node"))
    comm = DifferenceAllGather(cfg, build_topology(), 0, ChangeTracker())
    METER.snapshot(reset=True)
    out = _gather(comm, _shard(rank, 40), world)
    return torch.equal(out, torch.cat([_shard(r, 40) for r in range(world)])), comm.replica, METER.snapshot()


def test_node_replicas_on_a_single_node_gather_exactly_and_keep_nothing():
    for exact, replica, meter in run_pooled(_node_replica_on_one_node, 2):
        assert exact and replica is None
        assert meter["weights"]["intra"]["bits_per_element"] == 32.0
