"""``qsdp bench codec-share`` on the CPU: one rank's codec work played in one process, the
profile arithmetic, and the measurement of a tiny GPT."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qsdp.bench import codec_share
from qsdp.bench.codec_share import STEP_RANGE, ShareSpec, Span, profile_times
from qsdp.bench.one_rank import RankGather, RankReduceScatter, gather_kind
from qsdp.check import emulate
from qsdp.cli import BENCHMARKS
from qsdp.config import resolve_config

D, M = 2, 2
WORLD = D * M


def _nearest(preset: str):
    """The preset with nearest rounding everywhere: with every rank holding the same data, the
    peers' rows are then exactly this rank's, whatever their seeds."""
    return resolve_config(preset, {"grads.rounding": "nearest", "weights.rounding": "nearest"})


def _grads(s: int) -> torch.Tensor:
    return torch.randn(WORLD, s, generator=torch.Generator().manual_seed(s))


@pytest.mark.parametrize("preset", ["sdp4bit", "zeropp"])
def test_two_level_reduce_scatter_of_one_rank_equals_the_checks_emulation(preset):
    cfg, x, rank = _nearest(preset), _grads(5000), 3
    expected = emulate.reduce_scatter(x.expand(WORLD, WORLD, -1), cfg, M, comm_id=1, call=1)[rank]
    assert torch.equal(RankReduceScatter(cfg, D, M, rank, comm_id=1)(x), expected)


@pytest.mark.parametrize("slices, exchanges", [("auto", 1), (4, 4)])
def test_one_ranks_two_level_reduce_scatter_encodes_once_per_exchange_as_the_comm_does(slices, exchanges):
    # "auto" rounds in 8 slices that travel in one exchange where the host moves the bytes (CPU
    # tensors); a slice count sends each slice alone. Each exchange is one encode call for all
    # its slices, as in QuantizedReduceScatter, not one per rounding slice.
    cfg = resolve_config("sdp4bit", {"grads.pipeline_slices": slices, "grads.pipeline_min_slice": 1})
    reduce = RankReduceScatter(cfg, D, M, 0, comm_id=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        reduce(_grads(8192))
    names = Counter(e.name for e in prof.events())
    assert names["qsdp.codec.hadamard_quantize"] == exchanges
    assert names["qsdp.codec.dequantize_requantize"] == exchanges


def test_one_level_reduce_scatter_of_one_rank_equals_the_checks_emulation():
    cfg, x, rank = _nearest("qsdp"), _grads(3000), 2
    expected = emulate.reduce_scatter(x.expand(WORLD, WORLD, -1), cfg, M, comm_id=2, call=1)[rank]
    assert torch.equal(RankReduceScatter(cfg, D, M, rank, comm_id=2)(x), expected)


def test_plain_reduce_scatter_of_one_rank_averages_its_row():
    x = _grads(100)
    out = RankReduceScatter(resolve_config("fsdp"), D, M, 1, comm_id=0)(x)
    assert torch.allclose(out, x[1])


def test_direct_gather_of_one_rank_equals_the_checks_emulation():
    cfg, n = _nearest("zeropp"), 6000
    shard = torch.randn(n).to(torch.bfloat16)
    out = torch.empty(WORLD * n, dtype=torch.bfloat16)
    RankGather(cfg, D, M, 1, comm_id=3, shard=shard)(shard, out, changed=True)
    expected = emulate.direct_gather(shard.repeat(WORLD, 1), cfg, comm_id=3, version=1)
    assert torch.equal(out.view(WORLD, n), expected)


@pytest.mark.parametrize("replica", ["full", "node"])
def test_difference_gather_of_one_rank_equals_the_checks_emulation(replica):
    cfg = resolve_config(_nearest("sdp4bit"), {"weights.replica": replica})
    n, rank = 6000, 2
    first = torch.randn(n).to(torch.bfloat16)
    new = (first.float() + 0.01 * torch.randn(n)).to(torch.bfloat16)
    gather = RankGather(cfg, D, M, rank, comm_id=4, shard=first)
    assert gather.kind == replica
    out = torch.empty(WORLD * n, dtype=torch.bfloat16)
    gather(new, out, changed=True)
    expected = first.repeat(WORLD, 1)
    emulate.difference_gather(new.repeat(WORLD, 1), expected, cfg, comm_id=4, version=1)
    assert torch.equal(out.view(WORLD, n), expected)


def test_an_unchanged_difference_gather_sends_nothing_and_fills_from_the_replica():
    cfg, n = resolve_config("sdp4bit"), 4096
    first = torch.randn(n).to(torch.bfloat16)
    gather = RankGather(cfg, D, M, 0, comm_id=5, shard=first)
    out = torch.empty(WORLD * n, dtype=torch.bfloat16)
    gather(first + 1, out, changed=False)
    assert gather.version == 0 and torch.equal(out.view(WORLD, n), first.repeat(WORLD, 1))


def test_a_gather_travels_as_the_preset_and_layout_say():
    assert gather_kind(resolve_config("fsdp"), 2, 2, 4096) == "plain"
    assert gather_kind(resolve_config("qsdp"), 2, 2, 4096) == "direct"
    assert gather_kind(resolve_config("sdp4bit"), 2, 2, 4096) == "node"
    node = resolve_config("sdp4bit", {"weights.replica": "node"})
    assert gather_kind(node, 1, 4, 4096) == "plain"  # node replicas on one node: the node gathers exactly
    assert gather_kind(resolve_config("sdp4bit", {"weights.replica": "full"}), 2, 2, 4096) == "full"


# --------------------------------------------------------------------------- the profile


def _work(name: str, start: float, end: float) -> Span:
    return Span(name, on_gpu=True, annotation=False, start_us=start, end_us=end)


def _range(name: str, start: float, end: float, on_gpu: bool) -> Span:
    return Span(name, on_gpu=on_gpu, annotation=True, start_us=start, end_us=end)


def test_on_the_gpu_qsdp_time_is_the_work_inside_the_codec_ranges_gpu_side_spans():
    events = [
        _range("qsdp.codec.quantize", 10, 20, on_gpu=True), _work("_quantize_kernel", 11, 14),
        _range("qsdp.codec.dequantize_accumulate", 30, 40, on_gpu=True), _work("_dequantize_kernel", 30, 33),
        _work("elementwise_kernel", 34, 40),
        _work("ampere_bf16_gemm", 50, 90),  # the model's, outside every codec span
        _range("qsdp.codec.quantize", 0, 100, on_gpu=False),  # a host-side range: not GPU time
        _range(STEP_RANGE, 0, 100, on_gpu=True),
    ]
    t = profile_times(events, gpu=True)
    assert t["step_us"] == 3 + 3 + 6 + 40
    assert t["by_step"] == {"quantize": 3, "dequantize_accumulate": 9}
    assert (t["qsdp_us"], t["triton_us"], t["gpu_ranges"]) == (12, 6, 2)


def test_a_kernel_that_outlasts_a_codec_span_is_not_qsdps():
    events = [_range("qsdp.codec.quantize", 10, 20, on_gpu=True), _work("gemm", 15, 25)]
    assert profile_times(events, gpu=True)["qsdp_us"] == 0


def test_on_the_cpu_qsdp_time_is_the_host_time_of_the_codec_ranges_over_the_steps():
    events = [_range(STEP_RANGE, 0, 100, on_gpu=False), _range("qsdp.codec.quantize", 10, 30, on_gpu=False),
              _range("qsdp.codec.quantize", 40, 45, on_gpu=False), _range("aten::mm", 50, 60, on_gpu=False),
              _range(STEP_RANGE, 100, 150, on_gpu=False)]
    t = profile_times(events, gpu=False)
    assert (t["step_us"], t["qsdp_us"], t["by_step"]) == (150, 25, {"quantize": 25})


# --------------------------------------------------------------------------- the measurement

TINY = ShareSpec(model="tiny", nodes=D, ranks_per_node=M, batch_size=2, seq_len=32, param_dtype="float32",
                 warmup=1, steps=1, device="cpu")


def test_sdp4bits_codec_steps_take_a_share_of_a_cpu_step():
    row = codec_share.measure(TINY, "sdp4bit")
    assert 0 < row["share"] < 1 and row["qsdp_ms"] < row["step_ms"]
    assert set(row["by_step_ms"]) == {"hadamard_quantize", "dequantize_requantize", "dequantize_accumulate",
                                      "weight_difference_quantize", "replica_update", "replica_fill"}
    assert row["codec_kernels"] == "torch"


class _Dispatched(TorchDispatchMode):
    """The aten ops dispatched while it is on, by name (real tensors, real kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


# A tensor made from host data (torch.tensor of a list): on a GPU a blocking host-to-device copy.
HOST_COPY = "aten.lift_fresh.default"


def test_a_steady_step_makes_no_host_copy_the_real_path_does_not():
    # The comm objects build their exchange index once; one rank's step must not build one per call.
    state = codec_share.OneRankStep(TINY, "sdp4bit")
    state.step()
    with _Dispatched() as seen:
        state.step()
    assert seen.ops[HOST_COPY] == 0


def test_the_wall_time_over_the_profiled_step_is_reported_per_preset():
    row = codec_share.measure(TINY, "zeropp")
    assert row["wall_over_step"] == pytest.approx(row["wall_step_ms"] / row["step_ms"])
    table = codec_share.format_table({**dataclasses.asdict(TINY), "n_params": row["n_params"], "time": "host time",
                                      "presets": {"zeropp": row}})
    assert "wall/step" in table and f"{row['wall_over_step']:.2f}x" in table


def test_a_preset_that_quantizes_nothing_has_no_share():
    row = codec_share.measure(TINY, "fsdp")
    assert row["share"] == 0 and row["by_step_ms"] == {} and row["step_ms"] > 0
    assert row["codec_kernels"] == "none"


def test_a_spec_names_its_first_bad_field():
    with pytest.raises(ValueError, match="rank=4"):
        ShareSpec(nodes=2, ranks_per_node=2, rank=4).validate()
    with pytest.raises(ValueError, match="warmup"):
        ShareSpec(warmup=0).validate()


def test_the_command_is_a_benchmark_of_the_cli(capsys):
    assert BENCHMARKS["codec-share"] == "qsdp.bench.codec_share"
    with pytest.raises(SystemExit) as e:
        codec_share.main(["--device", "cpu", "--rank", "9"])
    assert e.value.code == 2 and "rank=9" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_the_gpu_the_triton_kernels_lie_inside_the_codec_ranges():
    pytest.importorskip("triton", reason="triton is not installed")
    spec = dataclasses.replace(TINY, device="cuda", param_dtype="bfloat16", warmup=2, steps=2)
    row = codec_share.measure(spec, "sdp4bit")
    assert row["codec_kernels"] == "triton" and row["gpu_codec_ranges"] > 0
    assert 0 < row["triton_ms"] <= row["qsdp_ms"] < row["step_ms"]
