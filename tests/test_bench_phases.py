"""`qsdp bench phases`: a step's host time split by phase, from the profiler of real ranks."""

import json

import pytest

from qsdp.bench.phases import PHASES
from qsdp.cli import main

pytestmark = pytest.mark.timeout(240)


def test_phases_split_each_presets_step_and_compare_it_with_the_baseline(tmp_path, capsys):
    rc = main(["bench", "phases", "--presets", "fsdp", "qsdp", "--nproc", "2", "--ranks-per-node", "1",
               "--steps", "1", "--warmup", "1", "--json", "--save", str(tmp_path / "phases.json")])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "phases.json").read_text())["presets"].keys() == {"fsdp", "qsdp"}
    for row in result["presets"].values():
        assert list(row["phases_s"]) == list(PHASES)
        assert sum(row["phases_s"].values()) == pytest.approx(row["step_s"])
        # Both presets gather weights and reduce gradients through FSDP2's labelled regions.
        assert row["phases_s"]["weights_gather"] > 0 and row["phases_s"]["grads_reduce"] > 0
    qsdp = result["presets"]["qsdp"]
    assert sum(qsdp["extra_vs_baseline_s"].values()) == pytest.approx(
        qsdp["step_s"] - result["presets"]["fsdp"]["step_s"])
    assert result["presets"]["fsdp"]["step_ratio_vs_baseline"] == 1.0


def test_phases_refuse_an_unknown_preset_before_launching(capsys):
    assert main(["bench", "phases", "--presets", "fsdp", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
