"""``make gpu-report STAGES=next`` without a GPU: what each stage measures and its hash (from the
files, no git), a result valid until those files change, the newest valid result per stage
across the folders of several runs, the stages due in priority order within a budget."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks import gpu_report
from benchmarks.gpu_report import STAGES, Command, Context, Stage
from benchmarks.stage_validity import (Fingerprint, Measures, fingerprint, measured_files, plan, read_results,
                                       stage_state)

ROOT = Path(__file__).resolve().parent.parent
EARLIER = ROOT / "benchmarks" / "results" / "gpu" / "h100-0ddf04a"  # committed before hashes were kept
PY = sys.executable
ENV = {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234"}
STAGE_FILES = {s.name: s.files for s in STAGES}


def _tree(root: Path) -> Path:
    """A small repository: ``pkg.bench`` imports ``pkg.core`` (which imports ``pkg.util`` inside
    a function), ``pkg.other`` is imported by nothing; a test imports a helper beside it."""
    files = {
        "src/pkg/__init__.py": "from .other import thing\n",
        "src/pkg/bench.py": "import json\nfrom .core import step\nimport pkg.core\n",
        "src/pkg/core.py": "def step():\n    from pkg.util import helper\n    return helper()\n",
        "src/pkg/util.py": "def helper():\n    return 1\n",
        "src/pkg/other.py": "thing = 2\n",
        "tests/test_x.py": "import helper_mod\nimport pkg.util\n",
        "tests/helper_mod.py": "X = 1\n",
        "tests/unrelated.py": "Y = 1\n",
        "data/a.txt": "a\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# --------------------------------------------------------------------------- what a stage measures


def test_a_module_is_measured_with_every_module_it_imports_and_no_other(tmp_path):
    root = _tree(tmp_path)
    assert measured_files(Measures(modules=("pkg.bench",)), root) == [
        "src/pkg/bench.py", "src/pkg/core.py", "src/pkg/util.py"]


def test_a_package_init_counts_where_it_is_imported_itself(tmp_path):
    root = _tree(tmp_path)
    (root / "src/pkg/bench.py").write_text("from . import core\n")  # the submodule only
    assert measured_files(Measures(modules=("pkg.bench",)), root) == [
        "src/pkg/bench.py", "src/pkg/core.py", "src/pkg/util.py"]
    (root / "src/pkg/bench.py").write_text("from pkg import thing\n")  # a name the package defines
    assert measured_files(Measures(modules=("pkg.bench",)), root) == [
        "src/pkg/__init__.py", "src/pkg/bench.py", "src/pkg/other.py"]


def test_file_patterns_are_measured_and_a_test_files_helpers_beside_it_followed(tmp_path):
    root = _tree(tmp_path)
    (root / "tests/__pycache__").mkdir()
    (root / "tests/__pycache__/test_x.cpython-312.pyc").write_bytes(b"\0")
    measures = Measures(files=("tests/**/test_*.py",), more=lambda r: ["data/a.txt"])
    assert measured_files(measures, root) == ["data/a.txt", "src/pkg/util.py", "tests/helper_mod.py", "tests/test_x.py"]


def test_a_misspelt_module_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="module pkg.benhc is not in"):
        measured_files(Measures(modules=("pkg.benhc",)), _tree(tmp_path))


def test_the_hash_changes_when_a_measured_file_changes_and_not_when_another_does(tmp_path):
    root = _tree(tmp_path)
    measures = Measures(modules=("pkg.bench",))
    before = fingerprint(measures, root, "cmd")
    (root / "src/pkg/other.py").write_text("thing = 3\n")
    (root / "tests/unrelated.py").write_text("Y = 2\n")
    assert fingerprint(measures, root, "cmd") == before
    (root / "src/pkg/util.py").write_text("def helper():\n    return 2\n")
    after = fingerprint(measures, root, "cmd")
    assert after.source_hash != before.source_hash
    assert {p for p in after.files if after.files[p] != before.files[p]} == {"src/pkg/util.py"}


def test_the_hash_changes_with_the_stages_commands(tmp_path):
    root = _tree(tmp_path)
    measures = Measures(modules=("pkg.bench",))
    one, two = fingerprint(measures, root, "--sizes 1M"), fingerprint(measures, root, "--sizes 2M")
    assert one.source_hash != two.source_hash and one.files == two.files


def test_a_copy_of_the_tree_without_git_hashes_the_same(tmp_path):
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    kernels = next(s for s in STAGES if s.name == "kernels")
    assert not (tmp_path / ".git").exists()
    assert gpu_report.stage_fingerprint(kernels, tmp_path) == gpu_report.stage_fingerprint(kernels, ROOT)


def test_each_stage_measures_the_code_it_runs_and_not_the_rest():
    measured = {s.name: set(measured_files(s.measures, ROOT)) for s in STAGES}
    kernels = {"src/qsdp/bench/kernels.py", "src/qsdp/codecs/triton_kernels.py", "src/qsdp/codecs/quantize.py"}
    assert kernels <= measured["kernels"] and "src/qsdp/fsdp.py" not in measured["kernels"]
    assert {"src/qsdp/bench/codec_share.py", "src/qsdp/bench/one_rank.py", "src/qsdp/codecs/triton_kernels.py",
            "src/qsdp/train/model.py"} <= measured["codec-share"]
    step = {"src/qsdp/bench/workload.py", "src/qsdp/fsdp.py", "src/qsdp/comm/reduce_scatter.py"}
    assert step <= measured["gloo-step"]
    assert {"tests/test_triton_kernels.py", "tests/conftest.py", "tests/distributed.py",
            "src/qsdp/bench/gpu_smoke.py"} <= measured["test-gpu"]
    trains = {"examples/fsdp2_two_lines.py", "src/qsdp/train/sample.txt", "src/qsdp/bench/gpu_smoke.py",
              "src/qsdp/train/loop.py"}
    assert trains <= measured["train-gpu"] and trains - {"examples/fsdp2_two_lines.py"} <= measured["train-gpu-4bit"]
    assert "tests/test_config.py" not in measured["test-gpu"]  # declares no gpu test
    sweep = {"src/qsdp/bench/cluster.py", "src/qsdp/perfmodel/step.py", "src/qsdp/bench/workload.py"}
    assert sweep <= measured["cluster"]
    for name, files in measured.items():
        assert not any(f.endswith(("soak.py", "convergence.py", "faults.py")) and "bench" in f for f in files), name


# --------------------------------------------------------------------------- results and their state


def _now(hash_: str = "h1", files: dict[str, str] | None = None, commands: str = "c1") -> Fingerprint:
    return Fingerprint(hash_, files if files is not None else {"src/a.py": "1"}, commands)


def _report(folder: Path, *records: dict, device: str = "NVIDIA H100 80GB HBM3") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    stages = [{"name": "kernels", "status": "passed", "commit": folder.name.split("-")[-1], "finished": "",
               "source_hash": "h1", "source_files": {"src/a.py": "1"}, "commands_hash": "c1", **r} for r in records]
    (folder / "report.json").write_text(json.dumps({"environment": {"device": device}, "date": "2026-11-27",
                                                    "stages": stages}))


def test_a_stage_without_any_result_is_missing(tmp_path):
    state = stage_state("kernels", _now(), read_results([tmp_path / "gpu"], STAGE_FILES))
    assert (state.state, state.due, state.reason) == ("missing", True, "missing: no result")


def test_a_run_of_this_code_that_did_not_pass_leaves_the_stage_missing_and_says_how_it_ended(tmp_path):
    _report(tmp_path / "h100-aaaaaaa", {"status": "passed", "finished": "2026-11-27T10:00:00Z", "source_hash": "h0"})
    _report(tmp_path / "h100-bbbbbbb", {"status": "over_budget", "finished": "2026-11-28T10:00:00Z",
                                        "reason": "stopped after its budget of 390 s"})
    results = read_results([tmp_path], STAGE_FILES)
    assert stage_state("kernels", _now("h0"), results).state == "valid"  # a later failure of other code
    state = stage_state("kernels", _now(), results)
    assert state.state == "missing" and state.reason == (
        "missing: no passed result of this code (the last run, h100-bbbbbbb/ (commit bbbbbbb, NVIDIA H100 80GB HBM3, "
        "2026-11-28T10:00:00Z): over budget: stopped after its budget of 390 s)")


def test_a_result_is_valid_while_its_hash_is_the_trees(tmp_path):
    _report(tmp_path / "h100-aaaaaaa", {"finished": "2026-11-27T10:00:00Z"})
    state = stage_state("kernels", _now(), read_results([tmp_path], STAGE_FILES))
    assert (state.state, state.due, state.result.folder.name) == ("valid", False, "h100-aaaaaaa")
    assert state.reason == ("valid at commit aaaaaaa: h100-aaaaaaa/ (commit aaaaaaa, NVIDIA H100 80GB HBM3, "
                            "2026-11-27T10:00:00Z)")


def test_a_result_is_stale_once_a_measured_file_changed_and_the_files_are_named(tmp_path):
    _report(tmp_path / "h100-aaaaaaa", {"finished": "2026-11-27T10:00:00Z"})
    now = _now("h2", {"src/a.py": "2", "src/new.py": "3"})
    state = stage_state("kernels", now, read_results([tmp_path], STAGE_FILES))
    assert state.state == "stale" and state.due
    assert state.reason.startswith("stale since h100-aaaaaaa/ (commit aaaaaaa")
    assert state.reason.endswith("files changed: src/a.py, src/new.py")


def test_a_result_is_stale_once_the_stages_commands_changed(tmp_path):
    _report(tmp_path / "h100-aaaaaaa", {"finished": "2026-11-27T10:00:00Z"})
    state = stage_state("kernels", _now("h2", commands="c2"), read_results([tmp_path], STAGE_FILES))
    assert state.state == "stale" and state.reason.endswith("its commands changed")


def test_a_result_recorded_without_a_hash_is_stale_and_says_so(tmp_path):
    _report(tmp_path / "h100-aaaaaaa", {"finished": "2026-11-27T10:00:00Z", "source_hash": None})
    state = stage_state("kernels", _now(), read_results([tmp_path], STAGE_FILES))
    assert state.state == "stale" and state.reason.endswith("recorded no source hash (an earlier format)")


def test_the_committed_folder_without_a_report_is_stale_for_the_stages_it_holds(tmp_path):
    shutil.copytree(EARLIER, tmp_path / EARLIER.name)
    results = read_results([tmp_path], STAGE_FILES)
    assert sorted(r.stage for r in results) == ["kernels", "test-gpu", "train-gpu", "train-gpu-4bit"]
    state = stage_state("kernels", _now(), results)
    assert state.reason == ("stale: h100-0ddf04a/ (commit 0ddf04a, h100, 2026-11-25) recorded no source hash "
                            "(no report.json: an earlier format)")
    assert stage_state("codec-share", _now(), results).state == "missing"


def test_the_newest_valid_result_is_chosen_across_the_folders_of_several_runs(tmp_path):
    _report(tmp_path / "h100-aaaaaaa", {"finished": "2026-11-27T10:00:00Z"},
            {"name": "codec-share", "finished": "2026-11-27T10:05:00Z"})
    _report(tmp_path / "h200-bbbbbbb", {"finished": "2026-11-28T09:00:00Z"}, device="NVIDIA H200")
    _report(tmp_path / "h100-ccccccc", {"finished": "2026-11-29T09:00:00Z", "source_hash": "h0"})  # older code
    results = read_results([tmp_path], STAGE_FILES)
    assert stage_state("kernels", _now(), results).result.folder.name == "h200-bbbbbbb"
    assert stage_state("codec-share", _now(), results).result.folder.name == "h100-aaaaaaa"


def test_a_folder_seen_through_two_directories_counts_once(tmp_path):
    _report(tmp_path / "h100-aaaaaaa", {"finished": "2026-11-27T10:00:00Z"})
    assert len(read_results([tmp_path, tmp_path / ".." / tmp_path.name, tmp_path / "absent"], STAGE_FILES)) == 1


# --------------------------------------------------------------------------- the plan


def test_the_plan_takes_stages_in_order_while_they_fit_and_a_shorter_later_one_may_go():
    stages = [("codec-share", 255), ("kernels", 405), ("test-gpu", 415), ("gloo-step", 255), ("cluster", 375)]
    assert plan(stages, None) == (["codec-share", "kernels", "test-gpu", "gloo-step", "cluster"], [])
    assert plan(stages, 540) == (["codec-share", "gloo-step"], ["kernels", "test-gpu", "cluster"])
    assert plan(stages, 420) == (["codec-share"], ["kernels", "test-gpu", "gloo-step", "cluster"])
    assert plan(stages, 100) == ([], ["codec-share", "kernels", "test-gpu", "gloo-step", "cluster"])


def _stage(name: str, budget: float) -> Stage:
    """A stage measuring ``pkg.bench`` of :func:`_tree` that writes ``<name>.json``."""
    def commands(ctx: Context) -> list[Command]:
        return [Command((PY, "-c", f"open({str(ctx.folder / (name + '.json'))!r}, 'w').write('{{}}')"))]
    return Stage(name, budget, name, commands, files=(f"{name}.json",), summary=lambda folder: f"{name} done",
                 measures=Measures(modules=("pkg.bench",)))


def test_a_stage_that_does_not_fit_the_time_left_waits_and_a_later_one_still_runs(tmp_path, capsys):
    root = _tree(tmp_path / "tree")
    stages = [_stage("long", 60), _stage("short", 5)]
    ctx = Context(tmp_path / "h100-abc1234", root=root, commit="abc1234")
    ctx.folder.mkdir()
    done = gpu_report.run_stages(stages, ctx, ENV, "test", cwd=root, deadline=time.monotonic() + 40)
    assert [r.name for r in done] == ["short"]
    out = capsys.readouterr().out
    assert "short          starts: budget 5 s" in out and "long           waits: needs 75 s" in out


def test_a_run_records_its_commit_and_hash_and_is_valid_until_a_measured_file_changes(tmp_path):
    root = _tree(tmp_path / "tree")
    stage = _stage("bench", 30)
    ctx = Context(tmp_path / "gpu" / "h100-abc1234", root=root, commit="abc1234")
    ctx.folder.mkdir(parents=True)
    (record,) = gpu_report.run_stages([stage], ctx, ENV, "test", cwd=root)
    assert (record.status, record.commit, len(record.finished)) == ("passed", "abc1234", len("2026-11-27T10:00:00Z"))
    assert record.source_files == fingerprint(stage.measures, root, "").files
    files = {"bench": ("bench.json",)}
    now = gpu_report.stage_fingerprint(stage, root)
    assert stage_state("bench", now, read_results([tmp_path / "gpu"], files)).state == "valid"
    (root / "src/pkg/core.py").write_text("def step():\n    return 0\n")
    state = stage_state("bench", gpu_report.stage_fingerprint(stage, root), read_results([tmp_path / "gpu"], files))
    assert state.state == "stale" and "files changed: src/pkg/core.py" in state.reason
    assert "| `bench` | 30 |" in (ctx.folder / "README.md").read_text() and record.source_hash in (
        ctx.folder / "README.md").read_text()


# --------------------------------------------------------------------------- the command


def _valid_report(results: Path, names: set[str]) -> None:
    """A folder whose records hold the tree's hash for ``names``, as a run on a GPU leaves it."""
    records = []
    for s in STAGES:
        if s.name in names:
            fp = gpu_report.stage_fingerprint(s)
            records.append(asdict(gpu_report.StageRecord(
                s.name, s.budget_s, "passed", 10.0, commit="abc1234", finished="2026-11-27T10:00:00Z",
                source_hash=fp.source_hash, source_files=fp.files, commands_hash=fp.commands_hash)))
    (results / "h100-abc1234").mkdir(parents=True)
    (results / "h100-abc1234" / "report.json").write_text(json.dumps({"environment": ENV, "stages": records}))


def test_a_dry_run_of_next_lists_each_stages_state_and_the_due_ones_in_priority_order(tmp_path, capsys):
    shutil.copytree(EARLIER, tmp_path / EARLIER.name)
    _valid_report(tmp_path, {"kernels"})
    assert gpu_report.main(["--dry-run", "--next", "--results", str(tmp_path), "--out", str(tmp_path / "out"),
                            "--commit", "abc1234"]) == 0
    out = capsys.readouterr().out
    assert "  kernels        valid    valid at commit abc1234: h100-abc1234/" in out
    assert ("  test-gpu       stale    stale: h100-0ddf04a/ (commit 0ddf04a, h100, 2026-11-25) recorded no source "
            "hash") in out
    assert "  codec-share    missing  missing: no result" in out
    runs = [ln.split()[1] for ln in out.splitlines() if ln.startswith("  run  ")]
    assert runs == ["test-gpu", "codec-share", "train-gpu", "train-gpu-4bit", "gloo-step", "cluster"]
    assert "  run  codec-share     120 s  missing: no result" in out
    assert "total budget 1215 s (20.2 min) for 6 stage(s)" in out
    assert not (tmp_path / "out").exists()


def test_a_dry_run_with_a_budget_says_which_stages_wait(tmp_path, capsys):
    assert gpu_report.main(["--dry-run", "--next", "--budget", "540", "--results", str(tmp_path),
                            "--out", str(tmp_path), "--commit", "abc1234"]) == 0
    out = capsys.readouterr().out
    assert [ln.split()[:2] for ln in out.splitlines() if ln.startswith(("  run  ", "  wait "))] == [
        ["run", "test-gpu"], ["run", "codec-share"], ["wait", "kernels"], ["wait", "train-gpu"],
        ["wait", "train-gpu-4bit"], ["wait", "gloo-step"], ["wait", "cluster"]]
    assert "plan (within 540 s; a stage may take its budget and 15 s to stop)" in out
    assert "(starts only if the stages before it leave 255 s)" in out


def test_the_newest_valid_result_of_each_stage_is_found_and_none_for_a_stage_due(tmp_path):
    _valid_report(tmp_path, {"kernels", "gloo-step"})
    found = gpu_report.newest_valid([tmp_path])
    assert {name: r and r.folder.name for name, r in found.items()} == {
        "test-gpu": None, "codec-share": None, "kernels": "h100-abc1234", "train-gpu": None, "train-gpu-4bit": None,
        "gloo-step": "h100-abc1234", "cluster": None}
    assert gpu_report.newest_valid([tmp_path / "absent"]) == dict.fromkeys(s.name for s in STAGES)


def test_next_with_every_stage_valid_runs_nothing_and_needs_no_gpu(tmp_path, capsys):
    _valid_report(tmp_path, {s.name for s in STAGES})
    assert gpu_report.main(["--next", "--results", str(tmp_path), "--out", str(tmp_path), "--commit", "abc1234"]) == 0
    out = capsys.readouterr().out
    assert out.count(" valid    valid at commit abc1234") == 7 and "nothing to run" in out


def test_a_copy_without_git_names_its_folder_by_the_hash_of_what_the_stages_measure(tmp_path):
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    tag = gpu_report._unknown_commit_tag(tmp_path)
    assert tag.startswith("unknown-") and len(tag) == len("unknown-") + 8
    (tmp_path / "src/qsdp/codecs/triton_kernels.py").write_text("# changed\n")
    assert gpu_report._unknown_commit_tag(tmp_path) != tag


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_passes_next_the_budget_and_the_stages_to_the_report():
    def args(*extra: str) -> str:
        # --no-print-directory: under `make test` a nested make would print where it enters and leaves
        out = subprocess.run(["make", "--no-print-directory", "-n", "gpu-report", "DRY_RUN=1", *extra], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        (line,) = [ln for ln in out.splitlines() if "-m benchmarks.gpu_report" in ln]
        return line
    assert "--dry-run" in args() and "--next" not in args() and "--only" not in args()
    line = args("STAGES=next", "BUDGET=540")
    assert "--next" in line and "--budget 540" in line and "--only" not in line
    assert "--only kernels cluster" in args("STAGES=kernels cluster")
