"""`qsdp bench convergence`, quick variant: paired seeds, intervals and verdicts, same schema as the
full run."""

import json
import os

import pytest

from qsdp.bench.convergence import check_targets, qsdp_halves
from qsdp.cli import main

pytestmark = pytest.mark.timeout(300)


def test_convergence_quick_run_pairs_every_variant_with_the_baseline_per_seed(tmp_path, capsys):
    rc = main(["bench", "convergence", "--variants", "fsdp", "qwd4", "--seeds", "2", "--steps", "2",
               "--nproc", "2", "--local-world-size", "1", "--param-dtype", "float32",
               "--out", str(tmp_path / "runs"), "--json", "--save", str(tmp_path / "conv.json")])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "conv.json").read_text())
    assert printed["presets"].keys() == saved["presets"].keys() == {"fsdp", "qwd4"}
    assert printed["seeds"] == [0, 1] and printed["tokens"] == 2 * printed["tokens_per_step"]
    assert printed["data"] == "chitchat-dataset (embedded)" and printed["n_params"] > 0
    for v, r in printed["presets"].items():
        assert [run["seed"] for run in r["runs"]] == [0, 1]
        assert all(os.path.isfile(tmp_path / "runs" / f"seed{s}" / v / "summary.json") for s in (0, 1))
        gap = r["rel_gap_vs_fsdp"]
        assert gap["per_seed"] == pytest.approx(
            [run["final_val_loss"] / base["final_val_loss"] - 1
             for run, base in zip(r["runs"], printed["presets"]["fsdp"]["runs"])])
        assert gap["ci_low"] <= gap["mean"] <= gap["ci_high"]
    assert printed["presets"]["fsdp"]["rel_gap_vs_fsdp"]["per_seed"] == [0.0, 0.0]
    assert [os.path.basename(p) for p in printed["plots"]] == ["loss_vs_step.png", "loss_vs_bytes.png"]
    assert all(os.path.isfile(p) for p in printed["plots"])
    assert saved["meta"]["torch"] and saved["setting"] == "tiny"


def test_a_finished_run_is_reused_only_with_the_same_arguments(tmp_path, capsys):
    common = ["bench", "convergence", "--variants", "fsdp", "--seeds", "1", "--nproc", "2",
              "--local-world-size", "1", "--param-dtype", "float32", "--out", str(tmp_path / "runs"), "--reuse"]
    assert main([*common, "--steps", "2"]) == 0
    summary = tmp_path / "runs" / "seed0" / "fsdp" / "summary.json"
    first = summary.stat().st_mtime_ns
    capsys.readouterr()
    assert main([*common, "--steps", "2"]) == 0
    assert "finished before, reused" in capsys.readouterr().err and summary.stat().st_mtime_ns == first
    assert main([*common, "--steps", "3"]) == 0
    assert summary.stat().st_mtime_ns != first


def _gap(mean, lo, hi):
    return {"rel_gap_vs_fsdp": {"mean": mean, "ci_low": lo, "ci_high": hi}}


def test_targets_are_judged_on_the_interval_not_the_mean():
    presets = {"sdp4bit": _gap(0.001, -0.002, 0.004), "qsdp": _gap(0.0005, 0.0, 0.0009),
               "qw4": _gap(0.05, 0.03, 0.07), "qwd4": _gap(0.01, 0.0, 0.031)}
    t = check_targets(presets)
    assert t["sdp4bit_within_0.3%"]["met"] is False  # mean inside, upper end outside
    assert t["qsdp_within_0.1%"]["met"] is True
    assert t["qw4_worse_than_qwd4"]["met"] is False  # the intervals overlap


def test_one_seed_meets_no_target():
    assert check_targets({"qsdp": _gap(0.0, None, None)})["qsdp_within_0.1%"]["met"] is False


def test_qsdp_halves_name_the_half_with_the_larger_gap():
    halves = qsdp_halves({"qsdp-w8": _gap(0.0002, 0, 0), "qsdp-g8": _gap(-0.004, 0, 0)})
    assert halves["larger"] == "grads" and halves["weights_only_mean_gap"] == 0.0002
    assert qsdp_halves({"qsdp-w8": _gap(0.0, 0, 0)}) is None


def test_convergence_refuses_an_unknown_variant_before_training(tmp_path, capsys):
    rc = main(["bench", "convergence", "--variants", "fsdp", "qw3", "--out", str(tmp_path / "runs")])
    assert rc == 2
    assert "unknown preset 'qw3'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_convergence_refuses_variants_without_the_baseline(tmp_path, capsys):
    rc = main(["bench", "convergence", "--variants", "qsdp", "--out", str(tmp_path / "runs")])
    assert rc == 2 and "must include the baseline 'fsdp'" in capsys.readouterr().err
