"""`python -m benchmarks.convergence`, quick variant: paired seeds, intervals and verdicts, same schema as the
full run."""

import json
import os

import pytest
import torch

from benchmarks import convergence as convergence_module
from benchmarks._cli import run_script
from benchmarks.convergence import MergeError, check_targets, merge, qsdp_halves
from prestarted import PRESTARTED, Command

pytestmark = pytest.mark.timeout(300)


def convergence(argv: list[str]) -> int:
    """The script as ``python -m benchmarks.convergence ARGS`` runs it: its exit code."""
    return run_script(convergence_module.main, convergence_module.PROGRAM, argv)


@pytest.mark.slow  # the evidence script, not the package: a whole sweep in miniature
def test_convergence_quick_run_pairs_every_variant_with_the_baseline_per_seed(tmp_path, capsys):
    rc = convergence(["--variants", "fsdp", "qwd4", "--seeds", "2", "--steps", "2",
                      "--nproc", "2", "--local-world-size", "1", "--param-dtype", "float32",
                      "--out", str(tmp_path / "runs"), "--json", "--save", str(tmp_path / "conv.json")])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "conv.json").read_text())
    assert printed["presets"].keys() == saved["presets"].keys() == {"fsdp", "qwd4"}
    assert printed["seeds"] == [0, 1] and printed["tokens"] == 2 * printed["tokens_per_step"]
    assert printed["data"] == "chitchat-dataset (embedded)" and printed["n_params"] > 0
    assert printed["device"] == "cpu" and saved["meta"]["device"] == "cpu (gloo)"
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
    assert all(os.path.isfile(p) and os.path.dirname(p) == str(tmp_path / "runs" / "seed0")
               for p in printed["plots"])
    assert saved["meta"]["torch"] and saved["setting"] == "tiny"


@pytest.mark.slow  # 15 s of training runs
def test_a_finished_run_is_reused_only_with_the_same_arguments(tmp_path, capsys):
    common = ["--variants", "fsdp", "--seeds", "1", "--nproc", "2",
              "--local-world-size", "1", "--param-dtype", "float32", "--out", str(tmp_path / "runs"), "--reuse"]
    assert convergence([*common, "--steps", "2"]) == 0
    summary = tmp_path / "runs" / "seed0" / "fsdp" / "summary.json"
    first = summary.stat().st_mtime_ns
    capsys.readouterr()
    assert convergence([*common, "--steps", "2"]) == 0
    assert "finished before, reused" in capsys.readouterr().err and summary.stat().st_mtime_ns == first
    assert convergence([*common, "--steps", "3"]) == 0
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


def test_a_missed_target_says_whether_the_interval_refutes_it_or_is_too_wide():
    t = check_targets({"sdp4bit": _gap(0.001, -0.002, 0.004), "qsdp": _gap(0.003, 0.002, 0.004),
                       "qw4": _gap(0.0, -0.01, 0.0), "qwd4": _gap(0.02, 0.01, 0.03)})
    assert t["sdp4bit_within_0.3%"]["reading"] == "interval contains the bound: neither shown nor refuted"
    assert t["qsdp_within_0.1%"]["reading"] == "whole interval above the bound"
    assert t["qw4_worse_than_qwd4"]["reading"] == "qw4 better, intervals apart"
    assert all(v["met"] is False for v in t.values())


def test_one_seed_decides_no_target():
    t = check_targets({"qsdp": _gap(0.0, None, None), "qw4": _gap(0.05, None, None), "qwd4": _gap(0.0, None, None)})
    assert t["qsdp_within_0.1%"]["met"] is None and t["qw4_worse_than_qwd4"]["met"] is None
    assert t["qsdp_within_0.1%"]["reading"] == "one seed: no interval"


def test_qsdp_halves_name_the_half_with_the_larger_gap():
    halves = qsdp_halves({"qsdp-w8": _gap(0.0002, 0, 0), "qsdp-g8": _gap(-0.004, 0, 0)})
    assert halves["larger"] == "grads" and halves["weights_only_mean_gap"] == 0.0002
    assert qsdp_halves({"qsdp-w8": _gap(0.0, 0, 0)}) is None


def test_convergence_refuses_an_unknown_variant_before_training(tmp_path, capsys):
    rc = convergence(["--variants", "fsdp", "qw3", "--out", str(tmp_path / "runs")])
    assert rc == 2
    assert "unknown preset 'qw3'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_convergence_refuses_variants_without_the_baseline(tmp_path, capsys):
    rc = convergence(["--variants", "qsdp", "--out", str(tmp_path / "runs")])
    assert rc == 2 and "must include the baseline 'fsdp'" in capsys.readouterr().err


def _part(seeds, losses, **setup):
    """A saved result of one sweep: variant -> final val loss per seed, in ``seeds`` order."""
    def record(seed, loss):
        return {"seed": seed, "final_val_loss": loss, "final_train_loss": loss, "wire_bytes_total": 1,
                "weights_bits_per_elt": 8.0, "weights_inter_bits_per_elt": 8.0, "grads_intra_bits_per_elt": 8.0,
                "grads_inter_bits_per_elt": 8.0, "wall_time_s": 10.0, "n_params": 100, "tokens_per_step": 64}
    base = {"setting": "small", "model": "small", "n_params": 100, "steps": 5, "tokens_per_step": 64,
            "param_dtype": "float32", "nodes": 2, "ranks_per_node": 2, "batch_size": 2, "seq_len": 64,
            "lr": 2e-3, "data": "chitchat-dataset (embedded)", "eval_batches": 32, **setup}
    return {**base, "seeds": list(seeds), "plots": [f"plot-seed{seeds[0]}.png"], "meta": {"device": "cpu (gloo)"},
            "presets": {v: {"runs": [record(s, x) for s, x in zip(seeds, xs)]} for v, xs in losses.items()}}


def test_merged_parts_pair_every_seed_as_one_sweep_would():
    later = _part([2], {"fsdp": [2.0], "qsdp": [2.02]})
    earlier = _part([0, 1], {"fsdp": [2.0, 3.0], "qsdp": [2.01, 3.0]})
    merged = merge({"b.json": later, "a.json": earlier})
    gap = merged["presets"]["qsdp"]["rel_gap_vs_fsdp"]
    assert merged["seeds"] == gap["seeds"] == [0, 1, 2]
    assert gap["per_seed"] == pytest.approx([0.005, 0.0, 0.01])
    assert gap["mean"] == pytest.approx(0.005) and gap["ci_low"] < gap["mean"] < gap["ci_high"]
    assert merged["wall_time_s"] == 60.0 and merged["tokens"] == 5 * 64
    assert merged["plots"] == ["plot-seed0.png"] and list(merged["meta"]["parts"]) == ["a.json", "b.json"]


def test_parts_of_different_comparisons_are_not_merged():
    with pytest.raises(MergeError, match=r"steps: 5 in a.json, 6 in b.json"):
        merge({"a.json": _part([0], {"fsdp": [2.0]}), "b.json": _part([1], {"fsdp": [2.0]}, steps=6)})
    with pytest.raises(MergeError, match="variants"):
        merge({"a.json": _part([0], {"fsdp": [2.0]}), "b.json": _part([1], {"fsdp": [2.0], "qsdp": [2.0]})})


def test_parts_sharing_some_variants_merge_those_named():
    wide = _part([0], {"fsdp": [2.0], "qw4": [2.1], "zeropp": [2.02]})
    more = _part([1], {"fsdp": [2.0], "zeropp": [2.04]})
    merged = merge({"a.json": wide, "b.json": more}, ["zeropp"])
    assert list(merged["presets"]) == ["fsdp", "zeropp"]
    assert merged["presets"]["zeropp"]["rel_gap_vs_fsdp"]["per_seed"] == pytest.approx([0.01, 0.02])
    with pytest.raises(MergeError, match="b.json holds no qw4"):
        merge({"a.json": wide, "b.json": more}, ["qw4"])


def test_parts_trained_on_different_devices_are_not_merged():
    # A result saved before the device was recorded counts as a CPU one.
    merged = merge({"a.json": _part([0], {"fsdp": [2.0]}), "b.json": _part([1], {"fsdp": [2.0]}, device="cpu")})
    assert merged["device"] == "cpu"
    with pytest.raises(MergeError, match=r"device: 'cpu' in a.json, 'cuda' in b.json"):
        merge({"a.json": _part([0], {"fsdp": [2.0]}), "b.json": _part([1], {"fsdp": [2.0]}, device="cuda")})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_convergence_on_cuda_without_a_gpu_stops_before_training(tmp_path, capsys):
    rc = convergence(["--device", "cuda", "--variants", "fsdp", "--seeds", "1", "--steps", "1",
                      "--out", str(tmp_path / "runs")])
    assert rc == 2 and "CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "seed0" / "fsdp" / "metrics.jsonl").exists()


def test_a_seed_in_two_parts_is_refused():
    with pytest.raises(MergeError, match="seed 1 is in both a.json and b.json"):
        merge({"a.json": _part([0, 1], {"fsdp": [2.0, 2.0]}), "b.json": _part([1], {"fsdp": [2.0]})})


def test_merge_from_the_command_line_saves_one_report(tmp_path, capsys):
    for name, seed in (("s0.json", 0), ("s1.json", 1)):
        (tmp_path / name).write_text(json.dumps(_part([seed], {"fsdp": [2.0], "sdp4bit": [2.0 + 0.01 * seed]})))
    rc = convergence(["--merge", str(tmp_path / "s0.json"), str(tmp_path / "s1.json"),
                      "--save", str(tmp_path / "all.json")])
    assert rc == 0
    saved = json.loads((tmp_path / "all.json").read_text())
    assert saved["seeds"] == [0, 1] and saved["meta"]["device"] == "cpu (gloo)"
    assert saved["meta"]["command"].startswith("python -m benchmarks.convergence --merge")
    assert "seeds [0, 1] (paired)" in capsys.readouterr().out


def test_merge_names_a_file_that_is_not_a_convergence_result(tmp_path, capsys):
    (tmp_path / "other.json").write_text("{}")
    (tmp_path / "s0.json").write_text(json.dumps(_part([0], {"fsdp": [2.0]})))
    rc = convergence(["--merge", str(tmp_path / "s0.json"), str(tmp_path / "other.json")])
    assert rc == 2
    assert "other.json is not a result of the convergence benchmark" in capsys.readouterr().err


@pytest.mark.slow  # 15 s of training runs
def test_parts_sharing_out_keep_their_plots_and_merge_redraws_the_lowest_seed(tmp_path, capsys):
    runs = str(tmp_path / "runs")
    for seed in (1, 0):  # the later seed first: its plots must not stand for seed 0's
        assert convergence(["--variants", "fsdp", "--seed", str(seed), "--seeds", "1",
                     "--steps", "2", "--nproc", "2", "--local-world-size", "1", "--param-dtype", "float32",
                     "--out", runs, "--no-progress", "--save", str(tmp_path / f"s{seed}.json")]) == 0
        part = json.loads((tmp_path / f"s{seed}.json").read_text())
        assert {os.path.dirname(p) for p in part["plots"]} == {os.path.join(runs, f"seed{seed}")}
    capsys.readouterr()
    assert convergence(["--merge", str(tmp_path / "s1.json"), str(tmp_path / "s0.json"),
                 "--out", runs, "--plots", str(tmp_path / "plots"), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert merged["plots"] == [str(tmp_path / "plots" / n) for n in ("loss_vs_step.png", "loss_vs_bytes.png")]
    assert all(os.path.isfile(p) for p in merged["plots"])


def test_merge_names_the_missing_runs_it_was_asked_to_plot(tmp_path, capsys):
    for name, seed in (("s0.json", 0), ("s1.json", 1)):
        (tmp_path / name).write_text(json.dumps(_part([seed], {"fsdp": [2.0], "qsdp": [2.0]})))
    rc = convergence(["--merge", str(tmp_path / "s0.json"), str(tmp_path / "s1.json"),
                      "--out", str(tmp_path / "runs"), "--plots", str(tmp_path / "plots")])
    assert rc == 2
    assert f"no runs of fsdp, qsdp in {tmp_path / 'runs' / 'seed0'}" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["convergence", "soak"])
def test_the_installed_command_names_the_script_that_replaced_it(name, capsys):
    from qsdp.cli import main

    assert main(["bench", name, "--help"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qsdp: error: qsdp bench {name} produces the repository's evidence")
    assert f"python -m benchmarks.{name}" in err


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _as_module(script: str, argv: list[str]) -> Command:
    return Command.python("-m", f"benchmarks.{script}", *argv, cwd=ROOT)


@pytest.mark.parametrize("script, argv, message", [
    ("convergence", ["--variants", "qsdp"], "must include the baseline 'fsdp'"),
    ("soak", ["--minutes", "0"], "--minutes must be a positive number"),
])
@pytest.mark.prestart(lambda script, argv, message: _as_module(script, argv))  # a fresh interpreter, run ahead
def test_each_script_runs_as_a_module_from_the_repository_root(script, argv, message, request):
    rc, printed = PRESTARTED.result(request.node.nodeid, _as_module(script, argv), timeout=120)
    assert rc == 2 and f"python -m benchmarks.{script}: error:" in printed and message in printed, printed
