"""``qsdp bench codec-share`` on the CPU: one rank of an emulated world trained in one process by
FSDP2 with the comm objects ``quantize_comms`` attaches, the profile arithmetic, and the command."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from qsdp._fsdp2 import all_gather_comms
from qsdp.bench import codec_share
from qsdp.bench.codec_share import STEP_RANGE, OneRankStep, ShareSpec, Span, profile_times
from qsdp.bench.one_rank import WIRE_RANGE, one_process_world, ranged_comms
from qsdp.cli import BENCHMARKS
from qsdp.comm.all_gather import DifferenceAllGather
from qsdp.comm.reduce_scatter import QuantizedReduceScatter
from qsdp.train.model import make_gpt, transformer_blocks
from in_child import in_child

D, M = 2, 2
TINY = ShareSpec(model="tiny", nodes=D, ranks_per_node=M, batch_size=2, seq_len=32, param_dtype="float32",
                 warmup=1, steps=1, device="cpu")
GROUPS = len(transformer_blocks(make_gpt("tiny", 256, 32))) + 1  # one fully_shard a block, and the root


def _calls_on(objects: list, fn) -> Counter:
    """Calls of each of ``objects`` (by class name) while ``fn()`` runs: Python's profiler sees
    every frame of their classes' own ``__call__`` (under the wrappers the class adds) whose
    ``self`` is one of them."""
    codes = {id(o): inspect.unwrap(type(o).__call__).__code__ for o in objects}
    wanted = set(codes.values())
    seen: Counter = Counter()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in wanted:
            me = frame.f_locals.get("self")
            if me is not None and codes.get(id(me)) is frame.f_code:
                seen[type(me).__name__] += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return seen


# --------------------------------------------------------------------------- the step


@in_child
def test_a_step_calls_the_comm_objects_quantize_comms_attached_and_they_meter_the_presets_bits():
    with OneRankStep(TINY, "sdp4bit") as state:
        h = state.handle
        assert (h.topology.world_size, h.topology.nodes, h.topology.ranks_per_node) == (D * M, D, M)
        assert [type(c) for c in h.all_gathers] == [DifferenceAllGather] * GROUPS
        assert [type(c) for c in h.reduce_scatters] == [QuantizedReduceScatter] * GROUPS
        assert [c for m in h.modules for c in all_gather_comms(m)] == h.all_gathers  # what FSDP2 calls
        state.step()  # the first gathers send exact values
        h.comm_stats(reset=True)
        calls = _calls_on([*h.all_gathers, *h.reduce_scatters], state.step)
        stats = h.comm_stats(reset=True)
    # Each group gathered before forward and again before backward, and reduced once.
    assert calls == {"DifferenceAllGather": 2 * GROUPS, "QuantizedReduceScatter": GROUPS}
    grads, weights = stats["grads"], stats["weights"]
    assert 8 < grads["intra"]["bits_per_element"] < 9 and 4 < grads["inter"]["bits_per_element"] < 5
    assert 4 < weights["inter"]["bits_per_element"] < 5  # the weight differences between nodes
    assert weights["intra"]["bits_per_element"] == 32  # the node's exact gather, in the parameter dtype
    assert not dist.is_initialized()  # the world it made ended with it


@in_child
def test_the_profiles_comm_ranges_wrap_the_comm_objects_and_go_away_after():
    with OneRankStep(TINY, "qsdp") as state:
        h = state.handle
        with ranged_comms(h):
            wrapped = [c for m in h.modules for c in all_gather_comms(m)]
            assert all(w.comm is c for w, c in zip(wrapped, h.all_gathers))
            calls = _calls_on([*h.all_gathers, *h.reduce_scatters], state.step)
        assert [c for m in h.modules for c in all_gather_comms(m)] == h.all_gathers
    assert calls == {"QuantizedAllGather": 2 * GROUPS, "QuantizedReduceScatter": GROUPS}


@in_child
def test_a_world_is_one_per_process():
    with one_process_world(D, M):
        with pytest.raises(RuntimeError, match="without a default process group"):
            with one_process_world(D, M):
                pass
        with pytest.raises(RuntimeError, match="already there"):
            OneRankStep(dataclasses.replace(TINY, nodes=1, ranks_per_node=2), "fsdp")
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- the measurement


@in_child
def test_sdp4bits_comm_objects_take_a_share_of_a_cpu_step():
    row = codec_share.measure(TINY, "sdp4bit")
    assert 0 < row["share"] < 1 and row["qsdp_ms"] < row["step_ms"]
    assert row["comm_calls"] == {"DifferenceAllGather": 2 * GROUPS, "QuantizedReduceScatter": GROUPS}
    assert set(row["by_comm_ms"]) == {"DifferenceAllGather", "QuantizedReduceScatter"}
    assert row["wire_ms"] > 0  # the emulated collectives, left out of qsdp's time
    assert 8 < row["wire_bits"]["grads"]["intra"] < 9 and row["wire_bytes_per_step"] > 0
    assert row["codec_kernels"] == "torch"
    assert row["wall_over_step"] == pytest.approx(row["wall_step_ms"] / row["step_ms"])


@in_child
def test_the_command_measures_every_preset_against_fsdp_on_a_tiny_gpt_by_default_on_the_cpu(tmp_path):
    saved = tmp_path / "share.json"
    assert codec_share.main(["--device", "cpu", "--nodes", "2", "--ranks-per-node", "2", "--presets", "fsdp",
                             "zeropp", "--warmup", "1", "--steps", "1", "--save", str(saved)]) == 0
    result = json.loads(saved.read_text())
    assert (result["model"], result["batch_size"], result["seq_len"], result["param_dtype"]) == \
        ("tiny", 2, 64, "float32")
    fsdp, zeropp = result["presets"]["fsdp"], result["presets"]["zeropp"]
    assert fsdp["wall_vs_fsdp"] == 1
    assert zeropp["wall_vs_fsdp"] == pytest.approx(zeropp["wall_step_ms"] / fsdp["wall_step_ms"])
    assert fsdp["comm_calls"] == {"PlainAllGather": 2 * GROUPS, "PlainReduceScatter": GROUPS}
    assert fsdp["codec_kernels"] == "none" and fsdp["wire_bits"]["grads"]["total"] == 32
    assert zeropp["comm_calls"] == {"QuantizedAllGather": 2 * GROUPS, "QuantizedReduceScatter": GROUPS}
    table = codec_share.format_table(result)
    assert "vs fsdp" in table and f"{zeropp['wall_vs_fsdp']:.2f}x" in table and "QuantizedReduceScatter" in table


def test_a_spec_names_its_first_bad_field():
    with pytest.raises(ValueError, match="rank=4"):
        ShareSpec(nodes=2, ranks_per_node=2, rank=4).validate()
    with pytest.raises(ValueError, match="warmup"):
        ShareSpec(warmup=0).validate()
    with pytest.raises(ValueError, match="device"):
        ShareSpec(device="mps").validate()


def test_the_command_is_a_benchmark_of_the_cli(capsys):
    assert BENCHMARKS["codec-share"] == "qsdp.bench.codec_share"
    with pytest.raises(SystemExit) as e:
        codec_share.main(["--device", "cpu", "--rank", "9"])
    assert e.value.code == 2 and "rank=9" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_without_a_gpu_the_cuda_measurement_stops_naming_the_cpu_one(capsys):
    with pytest.raises(SystemExit) as e:
        codec_share.main(["--device", "cuda"])
    assert e.value.code == 2 and "use --device cpu" in capsys.readouterr().err


# --------------------------------------------------------------------------- the profile


def _host(name: str, start: float, end: float, kernels_us: float = 0.0, children=()) -> Span:
    return Span(name, on_gpu=False, start_us=start, end_us=end, kernels_us=kernels_us, children=list(children))


def _gpu(name: str, start: float, end: float, annotation: bool = False) -> Span:
    return Span(name, on_gpu=True, start_us=start, end_us=end, annotation=annotation)


def test_on_the_gpu_qsdp_time_is_what_the_comm_calls_launched_less_their_collectives():
    quantize = _host("aten::abs", 11, 12, kernels_us=3)
    wire = _host(WIRE_RANGE, 13, 14, children=[_host("aten::copy_", 13, 14, kernels_us=5)])
    rs = _host("qsdp.comm.QuantizedReduceScatter", 10, 20, kernels_us=4, children=[quantize, wire])  # 4: a Triton launch
    ag = _host("qsdp.comm.DifferenceAllGather", 30, 40, children=[_host("aten::add_", 31, 32, kernels_us=2)])
    gemm = _host("aten::mm", 50, 60, kernels_us=40)  # the model's, outside every comm call
    work = [_gpu("_quantize_kernel_0d1d", 100, 104), _gpu("abs_kernel", 104, 107), _gpu("copy", 107, 112),
            _gpu("add", 112, 114), _gpu("ampere_bf16_gemm", 90, 130)]  # another stream's gemm overlaps them all
    events = [rs, quantize, wire, *wire.children, ag, *ag.children, gemm, *work,
              _gpu("qsdp.comm.QuantizedReduceScatter", 100, 112, annotation=True), _host(STEP_RANGE, 0, 100)]
    t = profile_times(events, gpu=True, triton_kernels=["_quantize_kernel"])
    assert t["step_us"] == 4 + 3 + 5 + 2 + 40
    assert t["by_comm"] == {"QuantizedReduceScatter": 7, "DifferenceAllGather": 2}
    assert (t["qsdp_us"], t["wire_us"], t["triton_us"]) == (9, 5, 4)
    assert t["calls"] == {"QuantizedReduceScatter": 1, "DifferenceAllGather": 1}


def test_on_the_cpu_qsdp_time_is_the_comm_calls_host_time_less_their_collectives_over_the_steps():
    wire = _host(WIRE_RANGE, 15, 18)
    events = [_host(STEP_RANGE, 0, 100), _host("qsdp.comm.PlainAllGather", 10, 20, children=[wire]), wire,
              _host("qsdp.comm.PlainAllGather", 40, 45), _host("aten::mm", 50, 60), _host(STEP_RANGE, 100, 150)]
    t = profile_times(events, gpu=False)
    assert (t["step_us"], t["qsdp_us"], t["by_comm"], t["wire_us"]) == (150, 12, {"PlainAllGather": 12}, 3)
    assert t["calls"] == {"PlainAllGather": 2}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_the_gpu_the_triton_kernels_lie_inside_the_comm_calls():
    pytest.importorskip("triton", reason="triton is not installed")
    spec = dataclasses.replace(TINY, device="cuda", param_dtype="bfloat16", warmup=2, steps=2)
    row = codec_share.measure(spec, "sdp4bit")
    assert row["codec_kernels"] == "triton"
    assert row["comm_calls"] == {"DifferenceAllGather": 2 * GROUPS, "QuantizedReduceScatter": GROUPS}
    assert 0 < row["triton_ms"] <= row["qsdp_ms"] < row["step_ms"]
    assert row["wire_ms"] > 0
