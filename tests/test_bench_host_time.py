"""``qsdp bench host-time``: which collectives each preset measures, and the quick mode's result
(structure and sanity only: timings vary from machine to machine)."""

from __future__ import annotations

import json

import pytest
import torch

from qsdp.bench import host_time
from qsdp.cli import BENCHMARKS

pytestmark = pytest.mark.timeout(240)


def test_each_preset_measures_the_collectives_its_config_runs():
    assert host_time.collectives_of("fsdp", 2, 2) == ("gather", "reduce_scatter")
    assert host_time.collectives_of("qsdp", 2, 2)[:2] == ("direct_gather", "one_level_reduce_scatter")
    assert host_time.collectives_of("sdp4bit", 2, 2) == ("difference_update", "difference_fill",
                                                         "two_level_reduce_scatter", "hsdp_all_reduce")
    assert host_time.collectives_of("hsdp4", 2, 2) == ("hsdp_all_reduce",)
    # one node: a two-level reduce-scatter has a single hop, and no replicas to all-reduce across
    assert host_time.collectives_of("sdp4bit", 1, 4)[2:] == ("one_level_reduce_scatter",)


def test_a_tiny_shard_rounds_in_the_slices_of_a_large_group():
    from qsdp.comm.reduce_scatter import grad_codec, pipeline_slices_bounds

    g = host_time._config("sdp4bit").grads
    hop1 = grad_codec(g, g.bits_intra, torch.float32)
    assert len(pipeline_slices_bounds(host_time.NUMEL, hop1, g.rounding_slices, g.pipeline_min_slice)) == 8


def test_a_world_without_two_levels_is_refused_before_launching():
    with pytest.raises(SystemExit) as e:
        host_time.main(["--nodes", "1", "--quick"])
    assert e.value.code == 2


@pytest.mark.slow  # about a minute on 2 shared cores: 4 ranks start and import torch
def test_the_quick_mode_writes_every_collective_beside_fsdp2s(tmp_path, capsys):
    assert BENCHMARKS["host-time"] == "qsdp.bench.host_time"
    out = tmp_path / "host_time.json"
    assert host_time.main(["--presets", "fsdp", "sdp4bit", "--quick", "--json", "--save", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == data
    assert data["meta"]["command"].startswith("qsdp bench host-time") and data["meta"]["torch"] == torch.__version__
    assert set(data["presets"]) == {"fsdp", "sdp4bit"}
    assert tuple(data["presets"]["sdp4bit"]) == host_time.collectives_of("sdp4bit", 2, 2)
    for colls in data["presets"].values():
        for c in colls.values():
            assert c["qsdp_us"] > 0 and c["fsdp2_us"] > 0
            assert c["ratio"] == pytest.approx(c["qsdp_us"] / c["fsdp2_us"])
    # the quantized all-reduce's own two collectives, its floor, beside it
    alone = data["presets"]["sdp4bit"]["hsdp_all_reduce"]
    assert alone["exchanges_us"] > 0
    assert alone["exchanges_ratio"] == pytest.approx(alone["exchanges_us"] / alone["fsdp2_us"])
    assert "exchanges_us" not in data["presets"]["sdp4bit"]["two_level_reduce_scatter"]
    assert data["worst_ratio"] == max(c["ratio"] for p in data["presets"].values() for c in p.values())
