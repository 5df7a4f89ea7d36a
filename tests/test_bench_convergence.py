"""`qsdp bench convergence`, quick variant: same schema as the full run."""

import json
import os

import pytest

from qsdp.cli import main

pytestmark = pytest.mark.timeout(240)


def test_convergence_quick_run_prints_the_table_one_json(tmp_path, capsys):
    rc = main(["bench", "convergence", "--variants", "fsdp", "qwd4", "--steps", "2", "--nproc", "2",
               "--local-world-size", "1", "--out", str(tmp_path / "runs"), "--json",
               "--save", str(tmp_path / "conv.json")])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "conv.json").read_text())
    assert printed["presets"].keys() == saved["presets"].keys() == {"fsdp", "qwd4"}
    for r in printed["presets"].values():
        assert r["final_val_loss"] > 0 and "rel_gap_vs_fsdp" in r
    assert printed["presets"]["fsdp"]["rel_gap_vs_fsdp"] == 0.0
    assert [os.path.basename(p) for p in printed["plots"]] == ["loss_vs_step.png", "loss_vs_bytes.png"]
    assert all(os.path.isfile(p) for p in printed["plots"])
    assert saved["meta"]["torch"]


def test_convergence_refuses_an_unknown_variant_before_training(tmp_path, capsys):
    rc = main(["bench", "convergence", "--variants", "fsdp", "qw3", "--out", str(tmp_path / "runs")])
    assert rc == 2
    assert "unknown preset 'qw3'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
