"""Gradient reduce-scatters against the exact reduce-scatter, on real gloo groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import qsdp
from qsdp.comm import PlainReduceScatter, QuantizedReduceScatter, build_topology
from allocations import Allocations
from distributed import run_pooled

pytestmark = pytest.mark.timeout(120)


def _config(mode="one_level", quantize=True, seed=0, **grads):
    fields = dict(bits=8, group_size=16, symmetric=True, rounding="stochastic", pipeline_min_slice=1)
    fields.update(grads)
    return qsdp.QuantConfig(grads=qsdp.GradComm(mode, quantize=quantize, **fields), seed=seed)


def _grad(rank: int, numel: int, integer: bool = False, trial: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 * rank + 1000 * trial + 3)
    if integer:  # integer values: every summation order gives the same fp32 result
        return torch.randint(-50, 50, (numel,), generator=g).float()
    x = torch.randn(numel, generator=g)
    x[::53] *= 20  # outliers, as gradients have
    return x


def _reduce_scatter(comm, grad: torch.Tensor, op=dist.ReduceOp.AVG) -> torch.Tensor:
    world = dist.get_world_size()
    out = torch.empty(grad.numel() // world, dtype=grad.dtype)
    comm(output_tensor=out, input_tensor=grad, group=dist.group.WORLD, op=op)
    return out


def _exact(world: int, rank: int, numel: int, op, **kw) -> torch.Tensor:
    total = sum(_grad(r, numel, **kw).double() for r in range(world))
    if op == dist.ReduceOp.AVG:
        total = total / world
    shard = numel // world
    return total[rank * shard : (rank + 1) * shard]


def _unquantized_route(rank, world, mode, slices, op, hadamard):
    cfg = _config(mode, quantize=False, pipeline_slices=slices, hadamard_block=hadamard)
    comm = QuantizedReduceScatter(cfg, build_topology(), 0)
    plain = PlainReduceScatter(cfg, build_topology(), 1)
    grad = _grad(rank, world * 75, integer=True)
    return torch.equal(_reduce_scatter(comm, grad, op), _reduce_scatter(plain, grad, op))


@pytest.mark.parametrize("op", [dist.ReduceOp.AVG, dist.ReduceOp.SUM], ids=["avg", "sum"])
@pytest.mark.parametrize("slices", [1, 3, "auto"])
def test_two_level_route_without_quantization_equals_plain_reduce_scatter(op, slices):
    assert all(run_pooled(_unquantized_route, 4, "two_level", slices, op, 0, local_world_size=2))


def test_one_level_route_without_quantization_equals_plain_reduce_scatter():
    assert all(run_pooled(_unquantized_route, 3, "one_level", 1, dist.ReduceOp.AVG, 0))


def _error_ratio(rank, world, mode, numel, **grads):
    cfg = _config(mode, **grads)
    comm = QuantizedReduceScatter(cfg, build_topology(), 0)
    out = _reduce_scatter(comm, _grad(rank, numel)).double()
    exact = _exact(world, rank, numel, dist.ReduceOp.AVG)
    scales = []
    for r in range(world):  # each source's error is below its group's grid step
        chunk = _grad(r, numel).double()[rank * (numel // world):(rank + 1) * (numel // world)]
        pad = (-chunk.numel()) % 16
        g = torch.cat([chunk, chunk[-1:].expand(pad)]).view(-1, 16)
        scales.append((g.abs().amax(1) / (2 ** (grads.get("bits", 8) - 1) - 1)).repeat_interleave(16)[: chunk.numel()])
    bound = sum(scales) / world
    return ((out - exact).abs() - bound * (1 + 1e-4) - 1e-7).max().item(), ((out - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("world,numel", [(1, 40), (2, 2 * 37), (3, 3 * 50), (4, 4 * 33)])
def test_one_level_error_within_the_sum_of_the_sources_grid_steps(world, numel):
    for excess, _ in run_pooled(_error_ratio, world, "one_level", numel):
        assert excess <= 0


def test_two_level_hadamard_error_is_small_relative_to_the_gradient():
    results = run_pooled(_error_ratio, 4, "two_level", 4 * 256, local_world_size=2,
                        bits_intra=8, bits_inter=4, hadamard_block=32, pipeline_slices=4)
    for _, rel in results:
        assert rel < 0.15  # 4-bit inter-node hop dominates: about 1/7 of a group's absmax per element


def test_hadamard_lowers_the_two_level_error_on_gradients_with_outliers():
    plain = run_pooled(_error_ratio, 4, "two_level", 4 * 512, local_world_size=2, bits_intra=8, bits_inter=4)
    smooth = run_pooled(_error_ratio, 4, "two_level", 4 * 512, local_world_size=2, bits_intra=8, bits_inter=4,
                       hadamard_block=16)
    assert sum(r for _, r in smooth) < sum(r for _, r in plain)


def _mean_over_seeds(rank, world, mode, trials, **grads):
    total = None
    for seed in range(trials):
        comm = QuantizedReduceScatter(_config(mode, seed=seed, **grads), build_topology(), 0)
        out = _reduce_scatter(comm, _grad(rank, world * 64)).double()
        total = out if total is None else total + out
    exact = _exact(world, rank, world * 64, dist.ReduceOp.AVG)
    err = (total / trials - exact).abs()
    return err.max().item(), exact.abs().max().item()


@pytest.mark.parametrize("mode,grads", [
    ("one_level", dict(bits=2, symmetric=False)),
    ("two_level", dict(bits_intra=4, bits_inter=2, hadamard_block=16, pipeline_slices=2)),
])
def test_stochastic_reduce_scatter_is_unbiased_over_seeds(mode, grads):
    trials = 200
    for err, peak in run_pooled(_mean_over_seeds, 4, mode, trials, local_world_size=2, **grads):
        # one draw errs by up to a few grid steps (~peak / 2 for 2 bits); the mean of 200
        # unbiased draws must be ~14x closer, a biased quantizer stays at its bias
        assert err < peak / 2 / trials**0.5 * 6


def _meter(rank, world, cfg_name):
    from qsdp.comm.meter import METER

    cfg = qsdp.resolve_config(cfg_name)
    comm = QuantizedReduceScatter(cfg, build_topology(), 0)
    METER.snapshot(reset=True)
    _reduce_scatter(comm, _grad(rank, world * 128 * 64))
    return METER.snapshot()["grads"]


def test_sdp4bit_gradient_bits_per_element_from_the_meter():
    for stats in run_pooled(_meter, 4, "sdp4bit", local_world_size=2):
        assert stats["intra"]["bits_per_element"] == pytest.approx(8.25)
        assert stats["inter"]["bits_per_element"] == pytest.approx(4.25)


def _bad_op(rank, world):
    comm = QuantizedReduceScatter(_config(), build_topology(), 0)
    try:
        _reduce_scatter(comm, _grad(rank, world * 8), op=dist.ReduceOp.MAX)
    except RuntimeError as e:
        return str(e)
    return ""


def test_an_unsupported_reduce_op_is_refused_before_any_data_moves():
    for msg in run_pooled(_bad_op, 2):
        assert "ReduceOp.SUM and ReduceOp.AVG" in msg


def test_pipeline_slices_are_whole_codec_units_and_never_below_the_minimum():
    from qsdp.comm.reduce_scatter import pipeline_slices_bounds
    from qsdp.comm.wire import RowCodec

    codec = RowCodec(bits=8, group_size=128, hadamard_block=32)
    bounds = pipeline_slices_bounds(128 * 100, codec, 8, min_slice=1)
    assert len(bounds) == 8 and bounds[0][0] == 0 and bounds[-1][1] == 128 * 100
    assert all(a % 128 == 0 for a, _ in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    assert len(pipeline_slices_bounds(128 * 100, codec, 8, min_slice=4096)) == 3
    assert pipeline_slices_bounds(128 * 10, codec, 8, min_slice=1 << 20) == [(0, 1280)]


def _two_level_allocations(rank, world, slices):
    cfg = _config("two_level", bits_intra=8, bits_inter=4, hadamard_block=32, pipeline_slices=slices)
    comm = QuantizedReduceScatter(cfg, build_topology(), 0)
    grad = _grad(rank, world * 4096)
    out = torch.empty(4096)
    with Allocations(grad, out) as seen:
        comm(output_tensor=out, input_tensor=grad, group=dist.group.WORLD, op=dist.ReduceOp.AVG)
    return seen.largest(torch.float32, torch.float64), grad.numel() * grad.element_size()


def test_two_level_reduce_scatter_makes_no_copy_of_the_whole_gradient():
    # 4 slices: each slice's destination-major copy (and its Hadamard transform) is a quarter of
    # the gradient; a copy of the whole gradient would be as large as the input.
    for largest, whole in run_pooled(_two_level_allocations, 4, 4, local_world_size=2):
        assert 0 < largest <= whole // 4


def _auto_and_eight(rank, world, shard, min_slice):
    from qsdp.comm.meter import METER

    results = []
    for slices in ("auto", 8):
        cfg = qsdp.resolve_config("sdp4bit", {"grads.pipeline_slices": slices, "grads.pipeline_min_slice": min_slice})
        comm = QuantizedReduceScatter(cfg, build_topology(), 3)
        METER.snapshot(reset=True)
        out = _reduce_scatter(comm, _grad(rank, world * shard))
        results.append((out, METER.snapshot()["grads"]))
    (auto, auto_bytes), (eight, eight_bytes) = results
    return torch.equal(auto, eight), auto_bytes == eight_bytes, auto_bytes["total"]["bytes"] > 0


@pytest.mark.parametrize("shard,min_slice", [
    (8 * 4096, 1),  # 8 slices of whole groups
    (3000, 256),  # 8 slices, the last one padded
    (2000, 512),  # the minimum leaves 4 slices, the last one padded
    (1 << 16, 16384),  # sdp4bit's own minimum: 4 slices
    (100, 16384),  # one padded slice
])
def test_auto_on_gloo_gives_the_bits_and_bytes_of_eight_slices(shard, min_slice):
    for same_output, same_bytes, sent in run_pooled(_auto_and_eight, 4, shard, min_slice, local_world_size=2):
        assert same_output and same_bytes and sent


def _all_to_alls(rank, world, slices):
    from qsdp.comm import reduce_scatter

    counted = []
    real = reduce_scatter.all_to_all  # the process group's own all-to-all (qsdp.comm.collectives)

    def counting(output, input_tensor, group, async_op=False):  # the real collective still runs
        counted.append(group)
        return real(output, input_tensor, group, async_op)

    cfg = qsdp.resolve_config("sdp4bit", {"grads.pipeline_slices": slices, "grads.pipeline_min_slice": 1})
    topo = build_topology()
    comm = QuantizedReduceScatter(cfg, topo, 0)
    reduce_scatter.all_to_all = counting
    try:
        _reduce_scatter(comm, _grad(rank, world * 8 * 1024))
    finally:
        reduce_scatter.all_to_all = real
    return [g is topo.intra_group for g in counted], [g is topo.inter_group for g in counted]


@pytest.mark.parametrize("slices,per_hop", [("auto", 1), (8, 8)])
def test_auto_on_gloo_sends_one_all_to_all_per_hop_and_a_slice_count_one_per_slice(slices, per_hop):
    for intra, inter in run_pooled(_all_to_alls, 4, slices, local_world_size=2):
        assert len(intra) == 2 * per_hop and sum(intra) == per_hop and sum(inter) == per_hop


def test_auto_pipelines_the_exchanges_only_where_the_host_does_not_move_the_bytes():
    import math

    from qsdp.comm.reduce_scatter import exchange_min_bytes, pipelines_exchanges

    assert pipelines_exchanges("cuda", "nccl")
    assert not pipelines_exchanges("cpu", "gloo")
    assert not pipelines_exchanges("cuda", "gloo")  # CUDA tensors staged through the host
    assert pipelines_exchanges("cuda", "cpu:gloo,cuda:nccl") and not pipelines_exchanges("cpu", "cpu:gloo,cuda:nccl")
    auto = qsdp.resolve_config("sdp4bit", {"grads.pipeline_min_bytes": 5000}).grads
    assert exchange_min_bytes(auto, host_moves_bytes=False) == 5000
    assert exchange_min_bytes(auto, host_moves_bytes=True) == math.inf  # one exchange per hop
    eight = qsdp.resolve_config("sdp4bit", {"grads.pipeline_slices": 8}).grads
    assert exchange_min_bytes(eight, host_moves_bytes=True) == exchange_min_bytes(eight, False) == 0


def test_an_exchange_carries_consecutive_slices_until_they_reach_the_minimum_bytes():
    import math

    from qsdp.comm.reduce_scatter import exchange_groups

    assert exchange_groups([10, 10, 10], 0) == [range(0, 1), range(1, 2), range(2, 3)]  # one slice each
    assert exchange_groups([10, 10, 10], math.inf) == [range(0, 3)]  # all in one
    assert exchange_groups([10] * 8, 25) == [range(0, 3), range(3, 8)]  # the short tail joins the last
    assert exchange_groups([10] * 8, 20) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert exchange_groups([10] * 8, 1000) == [range(0, 8)]  # a small shard: one exchange
    assert exchange_groups([10, 10, 10, 4], 10) == [range(0, 1), range(1, 2), range(2, 4)]


def _grouped_by_bytes(rank, world, min_bytes):
    """sdp4bit's auto slices on gloo as if an engine moved the bytes (``pipelines_exchanges``
    answers yes), against 8 slices: outputs, bytes and this rank's all-to-alls per hop."""
    import qsdp.comm.reduce_scatter as rs
    from qsdp.comm.meter import METER

    rs.pipelines_exchanges = lambda device_type, backend: True
    real, calls = rs.all_to_all, []  # the process group's own all-to-all (qsdp.comm.collectives)

    def counting(output, input_tensor, group, async_op=False):  # the real collective still runs
        calls.append(group)
        return real(output, input_tensor, group, async_op)

    results = []
    for slices in ("auto", 8):
        cfg = qsdp.resolve_config("sdp4bit", {"grads.pipeline_slices": slices, "grads.pipeline_min_slice": 1,
                                              "grads.pipeline_min_bytes": min_bytes})
        topo = build_topology()
        comm = QuantizedReduceScatter(cfg, topo, 3)
        METER.snapshot(reset=True)
        calls.clear()
        rs.all_to_all = counting
        try:
            out = _reduce_scatter(comm, _grad(rank, world * 8 * 4096))
        finally:
            rs.all_to_all = real
        results.append((out, METER.snapshot()["grads"], sum(g is topo.inter_group for g in calls)))
    (auto, auto_bytes, auto_calls), (eight, eight_bytes, eight_calls) = results
    return torch.equal(auto, eight), auto_bytes == eight_bytes, auto_calls, eight_calls


# A shard of 8 x 4096 elements on 2 x 2 ranks, 8 slices of 4096: each adds 2 rows of 4096 4-bit
# codes and 32 fp32 scales (2 x 2176 bytes) to hop 2's buffer, less than hop 1's 4 rows of 8 bits.
@pytest.mark.parametrize("min_bytes,exchanges", [(1, 8), (3 * 4352, 2), (8 * 4352, 1), (1 << 30, 1)])
def test_auto_groups_the_slices_by_bytes_with_the_bits_and_bytes_of_eight_slices(min_bytes, exchanges):
    for same_output, same_bytes, auto_calls, eight_calls in run_pooled(_grouped_by_bytes, 4, min_bytes,
                                                                       local_world_size=2):
        assert same_output and same_bytes
        assert (auto_calls, eight_calls) == (exchanges, 8)


@pytest.mark.parametrize("bits", [None, 8])
def test_encoding_into_columns_of_a_wider_buffer_writes_the_same_bytes(bits):
    from qsdp.comm.wire import RowCodec

    codec = RowCodec(bits=bits, group_size=16, hadamard_block=8 if bits else 0)
    hop2 = RowCodec(bits=4 if bits else None, group_size=16, hadamard_block=8 if bits else 0)
    x = _grad(0, 4 * 40).view(4, 40)
    alone = codec.encode(x, seed=5)
    wide = torch.full((4, alone.shape[1] + 12), 7, dtype=torch.uint8)
    assert codec.encode(x, seed=5, out=wide[:, 8:8 + alone.shape[1]]) is not None
    assert torch.equal(wide[:, 8:8 + alone.shape[1]], alone) and (wide[:, :8] == 7).all() and (wide[:, -4:] == 7).all()
    summed = codec.decode_sum_encode(alone, 40, sources=2, codec=hop2, seed=6)
    wide2 = torch.full((2, summed.shape[1] + 4), 7, dtype=torch.uint8)
    codec.decode_sum_encode(wide[:, 8:8 + alone.shape[1]], 40, sources=2, codec=hop2, seed=6,
                            out=wide2[:, 4:])
    assert torch.equal(wide2[:, 4:], summed) and (wide2[:, :4] == 7).all()


def test_the_torch_reference_dispatches_no_more_operators_for_more_rounding_slices():
    # sdp4bit's 8 slices on gloo travel in one exchange per hop; the CPU path (torch reference)
    # takes each codec step of that exchange in one operator sequence for all of them.
    from qsdp.bench.census import Case, run_case

    cases = [Case("sdp4bit", "reduce_scatter", shard=4096, slices=k, calls=1) for k in (1, 2, 8)]
    for case in cases:  # the process's cached constants made first: the counts are a steady step's
        run_case(case)
    rows = [run_case(case)[0] for case in cases]
    assert [(row["slices"], row["fused"], row["collectives"]) for row in rows] == [(k, False, 2) for k in (1, 2, 8)]
    one, two, eight = (row["torch"] for row in rows)
    # Slices taken as rows of one call cost a fixed operator or two over a single slice (the
    # rows' seeds); more slices cost none (one call per slice made 282 and 1097 here).
    assert eight <= two <= one + 2, (one, two, eight)


def test_a_runs_slices_taken_together_give_the_bytes_of_one_call_per_slice():
    from qsdp.codecs.rng import fold_seed
    from qsdp.comm.wire import RowCodec, SliceRun

    hop1 = RowCodec(bits=8, group_size=16, hadamard_block=8)
    hop2 = RowCodec(bits=4, group_size=16, hadamard_block=8)
    run = SliceRun(first=1, count=5, per=32, end=6 * 32 - 16)  # 4 equal slices and a shorter last one
    x = _grad(0, 4 * run.end).view(4, run.end)
    order = torch.tensor([2, 0, 3, 1])
    send = torch.empty(4, run.nbytes(hop1), dtype=torch.uint8)
    hop1.encode_slices(x, run, prefix=9, out=send, order=order)
    mid = torch.empty(2, run.nbytes(hop2), dtype=torch.uint8)
    hop1.decode_sum_encode_slices(send, run, sources=2, codec=hop2, prefix=10, out=mid)
    total = torch.full((run.end,), 7.0)
    hop2.decode_sum_slices(mid, run, total)
    for k, (a, b), (c0, c1), (e0, e1) in zip(range(1, 6), run.bounds(), run.columns(hop1), run.columns(hop2)):
        alone = hop1.encode(x[order, a:b], seed=fold_seed(9, k))
        assert torch.equal(send[:, c0:c1], alone), k
        summed = hop1.decode_sum_encode(alone, b - a, sources=2, codec=hop2, seed=fold_seed(10, k))
        assert torch.equal(mid[:, e0:e1], summed), k
        assert torch.equal(total[a:b], hop2.decode_sum(summed, b - a, finish=True)), k
    assert (total[:run.start] == 7).all()
