"""``make gpu-report`` without a GPU: its stages and budgets, the folder it writes, its README,
the budget of a stage enforced, the summaries read from real result files, and the pyroute2
wheel it may carry to a host without the package."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_report
from benchmarks.gpu_report import STAGES, TOTAL_BUDGET_S, Command, Context, Stage, StageRecord
from benchmarks.wheels import find_wheel, install_target, pack_installed

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "results" / "gpu" / "h100-0ddf04a"
H200 = ROOT / "benchmarks" / "results" / "gpu" / "h200-c14eb26"
PY = sys.executable
ENV = {"device": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "cuda": "13.0", "torch": "2.11.0+cu130",
       "triton": "3.6.0", "nccl": "2.27.7", "python": "3.12.3", "host_cpu": "Xeon, 16 cores", "commit": "0ddf04a"}


def test_the_stages_in_priority_order_are_the_tests_the_codec_share_the_kernels_the_training_the_gloo_step_and_the_sweep():
    assert [s.name for s in STAGES] == ["test-gpu", "codec-share", "kernels", "train-gpu", "train-gpu-4bit",
                                        "gloo-step", "cluster"]


def test_every_stage_stopped_at_worst_fits_five_minutes_and_all_of_them_twenty_five():
    assert gpu_report.MAX_STAGE_S == 300 and TOTAL_BUDGET_S == 1500
    assert all(gpu_report.stage_cost(s) == s.budget_s + gpu_report.KILL_GRACE_S <= 300 for s in STAGES)
    assert sum(gpu_report.stage_cost(s) for s in STAGES) <= TOTAL_BUDGET_S
    assert 2 * gpu_report.MAX_STAGE_S <= gpu_report.MAX_COMMAND_S == 600  # a 10-minute command runs two


def _option(command: Command, name: str) -> str:
    args = list(command.argv)
    return args[args.index(name) + 1]


def test_budgets_give_what_was_measured_on_the_h200_at_least_twice_its_time(tmp_path):
    measured = gpu_report.MEASURED_S
    assert measured == {"codec-share": 51.2, "gpu tests": 57.4, "kernels": 76.0}  # benchmarks/results/gpu/h200-*
    for stage in ("codec-share", "kernels"):
        assert next(s for s in STAGES if s.name == stage).budget_s >= 2 * measured[stage]
    (smoke,) = next(s for s in STAGES if s.name == "test-gpu").commands(Context(tmp_path))
    assert float(_option(smoke, "--stage-timeout")) >= 2 * measured["gpu tests"]


def test_the_smokes_training_is_split_over_two_stages_whose_runs_all_fit_their_budget(tmp_path):
    trained = []
    for stage in (s for s in STAGES if s.name.startswith("train-")):
        (smoke,) = stage.commands(Context(tmp_path))
        presets = list(smoke.argv[smoke.argv.index("--presets") + 1:])
        trained += presets
        part_s = float(_option(smoke, "--stage-timeout"))
        assert part_s * gpu_report.train_runs(stage.name) + gpu_report.SMOKE_START_S <= stage.budget_s + 1
    assert sorted(trained) == sorted(gpu_report.PRESETS)
    assert gpu_report.train_runs("train-gpu") == 4  # fsdp once, qsdp twice, the example
    assert gpu_report.train_runs("train-gpu-4bit") == 4


def test_the_kernels_stage_measures_four_sizes_against_compiled_torch(tmp_path):
    kernels = next(s for s in STAGES if s.name == "kernels")
    (command,) = kernels.commands(Context(tmp_path))
    assert command.argv[-4:] == ("1M", "16M", "64M", "256M") and "--no-compile" not in command.argv
    assert command.stdout_to == "kernels.json"


def test_the_sweep_runs_on_the_gpu_at_three_rates(tmp_path):
    (command,) = next(s for s in STAGES if s.name == "cluster").commands(Context(tmp_path))
    args = list(command.argv)
    assert args[args.index("--device") + 1] == "cuda"
    assert args[args.index("--rates") + 1:args.index("--rates") + 4] == ["20mbit", "1gbit", "unlimited"]


@pytest.mark.parametrize("name, slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
                                        ("Tesla T4", "t4")])
def test_the_folder_is_named_by_the_device_model_and_the_commit(name, slug, tmp_path):
    assert gpu_report.device_slug(name) == slug
    assert gpu_report.result_dir(tmp_path, name, "0ddf04a") == tmp_path / f"{slug}-0ddf04a"


def test_the_commit_is_gits_short_one_or_unknown_outside_a_checkout(tmp_path):
    sha = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    assert gpu_report.git_commit(ROOT).removesuffix("-dirty") == sha
    assert gpu_report.git_commit(tmp_path) == "unknown"


def test_the_readme_names_the_versions_the_command_the_date_and_each_stages_result(tmp_path):
    records = [StageRecord("kernels", 390, "passed", 250.0, summary="bit-exact: yes", files=["kernels.json"],
                           commit="abc1234", source_hash="0123456789abcdef"),
               StageRecord("cluster", 360, "skipped", reason="needs root")]
    text = gpu_report.write_readme(tmp_path, ENV, records, "make gpu-report", "2026-11-30").read_text()
    assert text.startswith("# NVIDIA H100 80GB HBM3, qsdp at commit 0ddf04a")
    for value in ("580.159.04", "13.0", "2.11.0+cu130", "3.6.0", "2.27.7", "3.12.3", "`make gpu-report`", "2026-11-30"):
        assert value in text
    assert "| `kernels` | 390 | 250 | passed | abc1234 | 0123456789abcdef | `kernels.json` | bit-exact: yes |" in text
    assert "| `cluster` | 360 | 0 | skipped | unknown | none |  | needs root |" in text


def _stage(name: str, code: str, budget: float) -> Stage:
    return Stage(name, budget, name, lambda ctx: [Command((PY, "-c", code))],
                 summary=lambda folder: f"{name} done")


def test_a_stage_past_its_budget_is_stopped_and_recorded_and_the_next_still_runs(tmp_path, capsys):
    stages = [_stage("slow", "import time; time.sleep(60)", budget=1.0), _stage("quick", "print('hi')", budget=60)]
    started = time.monotonic()
    slow, quick = gpu_report.run_stages(stages, Context(tmp_path), ENV, "test", cwd=tmp_path)
    assert time.monotonic() - started < 30
    assert (slow.status, slow.returncodes, slow.summary) == ("over_budget", [], "")
    assert "stopped after its budget of 1 s" in slow.output_tail
    assert (quick.status, quick.returncodes, quick.summary) == ("passed", [0], "quick done")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " | " not in ln]  # not the commands' lines
    assert lines[0].startswith("slow") and "starts: budget 1 s" in lines[0]
    assert lines[1].startswith("slow") and "over budget" in lines[1] and "quick done" in lines[3]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["status"] for s in report["stages"]] == ["over_budget", "passed"]
    assert "| `slow` | 1 |" in (tmp_path / "README.md").read_text()


def test_a_stage_prints_each_line_of_its_commands_as_it_comes_and_a_line_as_each_command_ends(tmp_path, capsys):
    talk = "import sys, time; print('part 1', flush=True); print('to stderr', file=sys.stderr, flush=True); time.sleep(60)"
    stages = [Stage("talks", 5, "", lambda ctx: [Command((PY, "-c", "print('a table')"), stdout_to="table.txt"),
                                                  Command((PY, "-c", talk))])]
    (record,) = gpu_report.run_stages(stages, Context(tmp_path), ENV, "test", cwd=tmp_path)
    assert record.status == "over_budget"  # the lines came while it ran, not after it
    lines = [ln.split(" after ")[0] for ln in capsys.readouterr().out.splitlines()]  # not the seconds taken
    assert lines[1:5] == ["talks          | command 1/2 exited with 0", "talks          | part 1",
                          "talks          | to stderr", "talks          | command 2/2 stopped"]
    assert (tmp_path / "table.txt").read_text() == "a table\n"  # a command's stdout into its file, not echoed
    assert "part 1" in record.output_tail


def test_a_command_that_fails_fails_its_stage_with_its_exit_status(tmp_path):
    record = gpu_report.run_stage(_stage("bad", "raise SystemExit(3)", budget=60), Context(tmp_path), cwd=tmp_path)
    assert (record.status, record.returncodes) == ("failed", [3]) and "exited with 3" in record.reason


def test_a_stage_whose_result_is_missing_fails(tmp_path):
    stage = Stage("kernels", 60, "", lambda ctx: [Command((PY, "-c", "pass"))], summary=gpu_report.summarize_kernels)
    record = gpu_report.run_stage(stage, Context(tmp_path), cwd=tmp_path)
    assert record.status == "failed" and "no result to summarize" in record.reason


def test_stages_run_later_are_added_to_the_folders_report(tmp_path):
    gpu_report.run_stages([_stage("first", "pass", 60)], Context(tmp_path), ENV, "one", cwd=tmp_path)
    gpu_report.run_stages([_stage("second", "pass", 60)], Context(tmp_path), ENV, "two", cwd=tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["first", "second"]


def test_a_dry_run_lists_the_stages_budgets_and_commands_and_runs_nothing(tmp_path, capsys):
    assert gpu_report.main(["--dry-run", "--out", str(tmp_path), "--commit", "abc1234"]) == 0
    out = capsys.readouterr().out
    for s in STAGES:
        assert f"  run  {s.name:<14} {s.budget_s:4.0f} s  " in out
    assert "qsdp.bench.gpu_smoke" in out and "bench kernels --json --sizes 1M 16M 64M 256M" in out
    assert "total budget 1395 s (23.2 min) for 7 stage(s); each stage at most 5 min" in out
    assert list(tmp_path.iterdir()) == []


def test_only_and_skip_pick_stages_in_their_order():
    assert [s.name for s in gpu_report.selected(["kernels", "test-gpu"], [])] == ["test-gpu", "kernels"]
    assert [s.name for s in gpu_report.selected(None, ["cluster"])][-1] == "gloo-step"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU host's answer")
def test_without_cuda_the_report_says_it_needs_a_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_report.main(["--commit", "abc1234"])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


# --------------------------------------------------------------------------- the summaries


def test_the_kernels_summary_reads_the_kernel_benchmarks_json(tmp_path):
    shutil.copy(MEASURED / "kernels-h100.json", tmp_path / "kernels.json")
    text = gpu_report.summarize_kernels(tmp_path)
    assert text == ("bit-exact: yes; 40%-99% of a copy; vs torch.compile min 0.70x (quantize at 64M); "
                    "below 1x: quantize")


def test_the_smoke_summary_counts_its_stages_and_quotes_pytests_count(tmp_path):
    smoke = json.loads((MEASURED / "gpu_smoke-train-example.json").read_text())
    log = (MEASURED / "pytest-gpu.log").read_text()
    smoke["stages"].insert(0, {"name": "gpu tests", "passed": False, "output_tail": log})
    (tmp_path / "test-gpu").mkdir()
    (tmp_path / "test-gpu" / "gpu_smoke.json").write_text(json.dumps(smoke))
    assert gpu_report.summarize_test_gpu(tmp_path) == ("8/10 smoke stages passed; pytest: 2 failed, 223 passed, "
                                                       "1 skipped, 1615 deselected in 29.12s")


def test_the_sweep_summary_gives_the_advisors_error_and_picks(tmp_path):
    shutil.copy(ROOT / "benchmarks" / "results" / "cluster_rates.json", tmp_path / "cluster-rates.json")
    assert gpu_report.summarize_cluster(tmp_path) == ("advisor: mean |error| 5.8% (goal <= 20%), "
                                                      "right pick at 5/5 rates")


def test_the_codec_share_summary_says_whether_sdp4bit_meets_its_goal(tmp_path):
    rows = {"fsdp": {"share": 0.0}, "sdp4bit": {"share": 0.021}}
    (tmp_path / "codec-share.json").write_text(json.dumps({"presets": rows}))
    assert gpu_report.summarize_codec_share(tmp_path) == ("qsdp's share of a step: fsdp 0.0%, sdp4bit 2.1% "
                                                          "(sdp4bit <= 3%: met)")


def test_the_codec_share_summary_gives_each_presets_wall_step_against_fsdps_and_the_goal(tmp_path):
    rows = {"fsdp": {"share": 0.0, "wall_step_ms": 40.0, "wall_vs_fsdp": 1.0},
            "qsdp": {"share": 0.01, "wall_step_ms": 42.0, "wall_vs_fsdp": 1.05},
            "sdp4bit": {"share": 0.04, "wall_step_ms": 48.0, "wall_vs_fsdp": 1.2}}
    (tmp_path / "codec-share.json").write_text(json.dumps({"presets": rows}))
    assert gpu_report.summarize_codec_share(tmp_path) == (
        "qsdp's share of a step: fsdp 0.0%, qsdp 1.0%, sdp4bit 4.0% (sdp4bit <= 3%: missed); "
        "wall step vs fsdp: qsdp 1.05x, sdp4bit 1.20x (every preset <= 1.10x: missed)")


def test_the_codec_share_summary_of_a_result_without_the_ratio_takes_it_from_the_wall_steps():
    # The H200's result at c14eb26 was written before the rows named the ratio.
    assert gpu_report.summarize_codec_share(H200).endswith(
        "wall step vs fsdp: qsdp 1.22x, sdp4bit 3.53x, zeropp 1.57x (every preset <= 1.10x: missed)")


def test_the_codec_share_stage_measures_the_comm_objects_fsdp2_calls():
    from benchmarks.stage_validity import measured_files

    stage = next(s for s in STAGES if s.name == "codec-share")
    assert {"src/qsdp/fsdp.py", "src/qsdp/comm/reduce_scatter.py", "src/qsdp/comm/difference.py",
            "src/qsdp/comm/all_gather.py", "src/qsdp/bench/census.py"} <= set(measured_files(stage.measures, ROOT))


# --------------------------------------------------------------------------- the sweep's package


def test_the_sweep_is_skipped_without_root_and_says_why(tmp_path):
    reason = gpu_report.cluster_blocker(Context(tmp_path), euid=1000)
    assert reason.startswith("needs root")


def test_pyroute2_travels_as_a_wheel_packed_here_and_installed_offline(tmp_path):
    wheel = pack_installed("pyroute2", tmp_path / "wheels")
    assert find_wheel(tmp_path / "wheels", "pyroute2") == wheel and wheel.name.endswith("-py3-none-any.whl")
    site = install_target(wheel, tmp_path / "site")
    found = subprocess.run([PY, "-c", "import pyroute2; print(pyroute2.__file__)"], capture_output=True, text=True,
                           env={"PYTHONPATH": str(site)}, check=True).stdout
    assert found.startswith(str(site))


def test_a_package_with_compiled_parts_is_not_packed(tmp_path):
    with pytest.raises(ValueError, match="not a pure-Python wheel"):
        pack_installed("torch", tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_environment_names_the_gpu_its_driver_and_nccl():
    env = gpu_report.environment()
    assert env["device"] == torch.cuda.get_device_name(0)
    assert env["driver"] and env["nccl"] and env["cuda"]


# --------------------------------------------------------------------------- the committed results


def _tree_at(commit: str, dest: Path) -> Path | None:
    """The source, tests and examples as they were at ``commit`` (None: no git history here)."""
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "src", "tests", "examples"], cwd=ROOT,
                             capture_output=True)
    if archive.returncode != 0:
        return None
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def test_the_h200_codec_share_is_the_newest_valid_result_of_the_code_it_measured(tmp_path):
    """The committed H200 record holds for the tree of commit c14eb26: it names the files it
    measured by their hashes, and a later change to one of them makes the stage due again."""
    tree = _tree_at("c14eb26", tmp_path)
    if tree is None:
        pytest.skip("commit c14eb26 is not in this copy's git history")
    found = gpu_report.newest_valid(root=tree)["codec-share"]
    assert found is not None and found.folder == H200
    assert (found.commit, found.status, found.device) == ("c14eb26", "passed", "NVIDIA H200")
    assert "sdp4bit 13.6%" in found.summary
    assert (H200 / "codec-share.json").is_file() and (H200 / "pytest-gpu.log").is_file()
