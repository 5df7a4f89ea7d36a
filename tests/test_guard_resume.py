"""A guarded run killed mid-round resumes on the same trajectory, with its escalations.

Both runs go through the real command line (``qsdp train --nproc 2``, two emulated nodes of one
rank, or ``--hsdp --nproc 4``, the workers' thread count the machine's own); one rank of the
second SIGKILLs itself after a checkpoint taken between a guard round's optimizer step and its
weight measurement.
"""

from __future__ import annotations

import json

import pytest

from qsdp.cli import main
from qsdp.train.metrics import read_metrics, read_summary

pytestmark = pytest.mark.timeout(300)

TIMING = {"step_time_s", "tokens_per_s"}


@pytest.fixture(autouse=True)
def _env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qsdp-cache"))
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "QSDP_TEST_KILL_AT"):
        monkeypatch.delenv(var, raising=False)


def _records(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("wire_bytes_control")}
            for r in read_metrics(run_dir)]


def _killed_and_resumed(tmp_path, monkeypatch, args):
    """``qsdp train ARGS`` run through, and run again with rank 1 killed at step 5 (restarted
    once): the two run directories and their summaries."""
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    assert main([*args, "--out", str(ref)]) == 0
    monkeypatch.setenv("QSDP_TEST_KILL_AT", "5:1")
    assert main([*args, "--out", str(crash), "--max-restarts", "1"]) == 0
    a, b = read_summary(ref), read_summary(crash)
    assert b["restarts"] == 1 and b["start_step"] == 3
    assert b["guard"] == a["guard"]
    assert _records(crash) == _records(ref)  # losses, guard lines, bytes
    assert b["final_weights_sha256"] == a["final_weights_sha256"]
    return ref, a


def test_a_guarded_run_killed_mid_round_resumes_with_the_same_escalations(tmp_path, corpus, monkeypatch):
    # Rounds are armed after 1, 3, 5 optimizer steps and decided 2 steps later; the checkpoint of
    # step 3 falls inside the first (measured, not yet decided).
    common = ["train", "--preset", "qw4", "--guard-every", "2", "--nproc", "2", "--local-world-size", "1",
              "--batch-size", "4", "--seq-len", "32", "--data", corpus, "--steps", "8", "--ckpt-every", "3",
              "--eval-every", "4", "--eval-batches", "2", "--no-progress"]
    ref, a = _killed_and_resumed(tmp_path, monkeypatch, common)
    assert a["guard"]["escalations"], "the reference run escalated nothing: the test shows nothing"
    guard_lines = [r for r in read_metrics(ref) if "guard" in r]
    assert guard_lines and all(r["guard"]["part"] == "weights" for r in guard_lines)
    # Direct 4-bit weights became differences: the resumed run loaded their replicas.
    assert json.dumps(a["guard"]["rungs"]).count("4-bit difference") == len(a["guard"]["rungs"])


def test_an_hsdp_run_killed_mid_round_resumes_with_the_same_readings(tmp_path, corpus, monkeypatch):
    # FSDP2's native HSDP mesh (--hsdp), 2 nodes x 2: the rounds measure the all-reduce across
    # the replicas too; the checkpoint of step 3 falls inside the first round.
    common = ["train", "--preset", "hsdp4", "--hsdp", "--guard-every", "2", "--nproc", "4", "--local-world-size", "2",
              "--batch-size", "2", "--seq-len", "32", "--data", corpus, "--steps", "7", "--ckpt-every", "3",
              "--eval-every", "0", "--no-progress"]
    _, a = _killed_and_resumed(tmp_path, monkeypatch, common)
    assert [r["step"] for r in a["guard"]["readings"]] == [1, 3, 5]  # 5 decided by the final evaluation
    assert all(0 < q < 10 for r in a["guard"]["readings"] for q in r["q_sgd"])
