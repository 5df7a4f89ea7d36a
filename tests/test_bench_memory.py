"""``qsdp bench memory``: the comm state each preset keeps per rank, and the benchmark's output."""

from __future__ import annotations

import json

import pytest
import torch

import qsdp
from distributed import run_pooled
import fsdp_models as fm
from qsdp.bench import memory

pytestmark = pytest.mark.timeout(240)


def _state_after_training(rank, world, preset, overrides):
    model = fm.build(width=64, depth=2)
    handle = qsdp.quantize_comms(model, preset, overrides=overrides)
    fm.train(model, 3, rank)
    full_model = sum(p.numel() * p.element_size() for p in model.parameters())
    return memory.persistent_bytes(handle), full_model, len(handle.all_gathers)


@pytest.mark.parametrize("preset,overrides,share", [
    ("fsdp", {}, 0.0),
    ("qsdp", {}, 0.0),  # no copy of the shard is kept to notice changes
    ("zeropp", {}, 0.0),
    ("sdp4bit", {}, 0.5),  # node replicas: full model / M on 2 nodes x 2 ranks
    ("sdp4bit", {"weights.replica": "full"}, 1.0),
])
def test_persistent_comm_state_per_rank_is_at_most_the_replica_share_of_the_model(preset, overrides, share):
    for state, full_model, groups in run_pooled(_state_after_training, 4, preset, overrides, local_world_size=2):
        slack = 4096 * groups  # FSDP2's padding of each group to whole shards, and 1-byte flags
        assert share * full_model <= state <= share * full_model + slack


def test_bench_memory_json_per_case_and_rank(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert memory.main(["--cases", "fsdp", "sdp4bit", "--layers", "1", "--width", "64",
                        "--json", "--save", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == data
    assert data["meta"]["command"].startswith("qsdp bench memory") and data["meta"]["torch"] == torch.__version__
    fsdp, sdp = data["cases"]["fsdp"], data["cases"]["sdp4bit"]
    assert len(fsdp["per_rank"]) == len(sdp["per_rank"]) == 4
    assert fsdp["max_persistent_comm_bytes"] < 64  # a 1-byte non-finite flag per group
    assert 0 < sdp["max_persistent_comm_bytes"] < data["model_bytes"]
    assert all(r["step_peak_bytes"] > 0 for r in fsdp["per_rank"] + sdp["per_rank"])


def test_an_unknown_case_is_refused_before_launching():
    with pytest.raises(SystemExit):
        memory.main(["--cases", "nope"])
