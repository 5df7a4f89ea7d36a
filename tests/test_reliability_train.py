"""Reliability of the training job: non-finite gradients, crash and restart, stalled peers.

Faults are injected with the loop's test-only environment variables (see
:mod:`qsdp.train.loop`): ``QSDP_TEST_NAN_AT``, ``QSDP_TEST_KILL_AT`` and ``QSDP_TEST_STALL_AT``.
Most runs call ``train_worker`` in a forked gloo world (``run_pooled``); the crash, the stall and
the ``raise`` mode also go through the real command line (``qsdp train --nproc 2``: the elastic
launcher and its spawned workers), since what they test is the launcher's behaviour.
"""

from __future__ import annotations

import math
import os
import time

import pytest

from distributed import run_pooled, run_world
import qsdp.train.launcher as launcher
from qsdp.train.checkpoint import CHECKPOINT_DIR, LATEST_FILE, latest_checkpoint
from qsdp.train.loop import TrainArgs, lr_at, train_worker
from qsdp.train.metrics import METRICS_FILE, read_metrics, read_summary

TIMING = {"step_time_s", "tokens_per_s"}  # the only fields of a record that may differ between runs


@pytest.fixture(autouse=True)
def _env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qsdp-cache"))
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "QSDP_TEST_NAN_AT", "QSDP_TEST_KILL_AT", "QSDP_TEST_STALL_AT"):
        monkeypatch.delenv(var, raising=False)


def _args(out, corpus, **kw) -> TrainArgs:
    base = dict(out=str(out), data=corpus, model="tiny", steps=6, batch_size=4, seq_len=32,
                lr=3e-3, warmup=2, eval_every=0, eval_batches=2, ckpt_every=0, progress=False)
    return TrainArgs(**{**base, **kw})


def _worker(rank, world, args):
    return train_worker(args)


def train(args, world=2, lws=None, patched=False):
    """``patched``: ranks forked at the call (run_world), which see the test's monkeypatches."""
    run = run_world if patched else run_pooled
    return run(_worker, world, args, local_world_size=lws, timeout=90)


def _records(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run_dir)]


# A resumed attempt's first gather agrees on the weight-difference replicas after its load (one
# tiny control all-reduce); the uninterrupted run carried that agreement in the step's gradient
# check, which the meter does not count. Every other byte is the same.
CONTROL = {"wire_bytes_control_intra", "wire_bytes_control_inter", "wire_bytes_control_total"}


def _resumed_records(run_dir):
    """The records with the control bytes taken out of the totals."""
    out = []
    for r in _records(run_dir):
        if "wire_bytes_total" in r:
            r = {**{k: v for k, v in r.items() if k not in CONTROL},
                 "wire_bytes_total": r["wire_bytes_total"] - r["wire_bytes_control_total"]}
        out.append(r)
    return out


# ---------------------------------------------------------------------------------------------
# Non-finite gradients


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset,world,lws", [
    ("sdp4bit", 2, None),
    pytest.param("fsdp", 2, None, marks=pytest.mark.slow),  # plain reduce-scatter
    pytest.param("sdp4bit", 4, 2, marks=pytest.mark.slow),  # 2 nodes x 2 ranks: both gradient hops
])
def test_a_nan_gradient_skips_the_step_and_training_continues(tmp_path, corpus, monkeypatch, preset, world, lws):
    """NaN in rank 1's gradient at step 3: the step is skipped on every rank, weights and
    optimizer state equal those after step 2 bit for bit, the skip is counted, and training
    continues (resumed, to check the count survives a checkpoint) with finite losses."""
    monkeypatch.setenv("QSDP_TEST_NAN_AT", "3:1")
    # verify_replicas_every=1: every weight-difference gather compares the replicas across ranks.
    common = dict(preset=preset, local_world_size=lws, decay_steps=6,
                  overrides={"verify_replicas_every": 1})
    before, run = tmp_path / "two_steps", tmp_path / "run"
    ref = train(_args(before, corpus, steps=2, **common), world, lws)[0]
    got = train(_args(run, corpus, steps=3, **common), world, lws)
    assert len({s["final_weights_sha256"] for s in got}) == 1
    assert got[0]["final_weights_sha256"] == ref["final_weights_sha256"]  # weights unchanged
    assert got[0]["final_optimizer_sha256"] == ref["final_optimizer_sha256"]  # AdamW state unchanged
    assert got[0]["nonfinite_skipped"] == read_summary(run)["nonfinite_skipped"] == 1
    recs = [r for r in read_metrics(run) if "loss" in r]
    assert [r["nonfinite_skipped"] for r in recs] == [0, 0, 1]
    assert recs[2]["grad_norm"] is None and all(r["grad_norm"] > 0 for r in recs[:2])
    assert _records(before)[:2] == [{**r, "nonfinite_skipped": 0} for r in _records(run)[:2]]

    train(_args(run, corpus, steps=6, resume=True, **common), world, lws)  # NaN hook: step 3 only
    recs = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r["nonfinite_skipped"] for r in recs] == [0, 0, 1, 1, 1, 1]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] is not None for r in recs[3:])
    assert recs[-1]["loss"] < recs[2]["loss"]
    # The schedule is a function of the step number: a skipped step does not shift it.
    assert [r["lr"] for r in recs] == [lr_at(s - 1, _args(run, corpus, **common)) for s in range(1, 7)]
    assert read_summary(run)["nonfinite_skipped"] == 1


@pytest.mark.timeout(120)
def test_raise_mode_is_one_line_from_the_real_cli(tmp_path, corpus, monkeypatch, capsys):
    from qsdp.cli import main

    monkeypatch.setenv("QSDP_TEST_NAN_AT", "3:1")
    out = tmp_path / "run"
    argv = ["train", "--preset", "sdp4bit", "--nproc", "2", "--batch-size", "4", "--seq-len", "32",
            "--data", corpus, "--out", str(out), "--steps", "4", "--eval-every", "0",
            "--ckpt-every", "2", "--eval-batches", "2", "--no-progress", "--on-nonfinite", "raise"]
    assert main(argv) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("qsdp: error: rank ")
    assert ("NonFiniteGradientError: non-finite gradient (NaN/Inf) at step 3 (--on-nonfinite raise); "
            "the weights were not updated at step 3, the last checkpoint is step_00000002") in lines[0]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert latest_checkpoint(out).name == "step_00000002"


# ---------------------------------------------------------------------------------------------
# Crash and restart


def _restarted(rank, world, args):
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # what the elastic agent sets on a restart
    return train_worker(args)


def _save_then_die(original, step):
    def save(state, checkpoint_id, **kw):
        original(state, checkpoint_id=checkpoint_id, **kw)
        import torch.distributed as dist

        if f"step_{step:08d}" in str(checkpoint_id) and dist.get_rank() == 1:
            os.kill(os.getpid(), 9)  # SIGKILL with its shards written, before the rename
    return save


@pytest.mark.timeout(150)
def test_a_restarted_attempt_resumes_from_the_last_good_checkpoint_or_starts_afresh(
        tmp_path, corpus, monkeypatch):
    """What a restarted worker group does, here without the agent: a forked world in which
    rank 1 is SIGKILLed, then a world with TORCHELASTIC_RESTART_COUNT=1 in the same directory.

    - killed in step 2, before the first checkpoint: the restart starts again from step 1,
      dropping the dead attempt's records;
    - killed inside the save of step 4 (its shards on disk, the directory not yet renamed):
      `latest` stays on step 2, the restart resumes from it and writes step 4 again.

    Both end as the uninterrupted run, bit for bit. (A real restart by the agent: below.)"""
    import qsdp.train.checkpoint as ckpt

    ref, fresh, mid_save = tmp_path / "ref", tmp_path / "fresh", tmp_path / "mid_save"
    args = lambda d: _args(d, corpus, preset="sdp4bit", ckpt_every=2, keep_checkpoints=0, eval_every=3)
    train(args(ref))

    monkeypatch.setenv("QSDP_TEST_KILL_AT", "2:1")
    with pytest.raises(RuntimeError):
        train(args(fresh))
    monkeypatch.delenv("QSDP_TEST_KILL_AT")
    assert [r["step"] for r in read_metrics(fresh)] == [1] and latest_checkpoint(fresh) is None
    with open(fresh / METRICS_FILE, "a") as f:
        f.write('{"step": 2, "lo')  # a line cut short by the crash
    assert run_pooled(_restarted, 2, args(fresh), timeout=90)[0]["start_step"] == 0

    original = ckpt.dcp.save
    monkeypatch.setattr(ckpt.dcp, "save", _save_then_die(original, 4))  # forked workers inherit it
    with pytest.raises(RuntimeError):
        train(args(mid_save), patched=True)
    monkeypatch.setattr(ckpt.dcp, "save", original)
    root = mid_save / CHECKPOINT_DIR
    assert (root / LATEST_FILE).read_text().strip() == "step_00000002"
    assert (root / "step_00000004.tmp").is_dir() and not (root / "step_00000004").exists()
    assert run_pooled(_restarted, 2, args(mid_save), timeout=90)[0]["start_step"] == 2
    assert sorted(p.name for p in root.iterdir()) == [LATEST_FILE, "step_00000002", "step_00000004",
                                                      "step_00000006"]

    for out in (fresh, mid_save):
        assert read_summary(out)["restarts"] == 1
        assert _resumed_records(out) == _resumed_records(ref)
        for key in ("final_weights_sha256", "final_optimizer_sha256", "final_val_loss"):
            assert read_summary(out)[key] == read_summary(ref)[key], key


@pytest.mark.timeout(240)
def test_a_killed_worker_restarts_the_group_which_resumes_bit_identically(tmp_path, corpus, monkeypatch):
    """`qsdp train --nproc 2 --max-restarts 1`: rank 1 SIGKILLs itself in step 6 (after the
    checkpoint of step 4 and the record of step 5); the elastic agent restarts both workers,
    they resume from step 4 (the record of step 5 is dropped and written again), and the run
    ends with the metrics and final state of an uninterrupted run, bit for bit."""
    from qsdp.cli import _parser, _train_args, main

    common = ["--preset", "sdp4bit", "--batch-size", "4", "--seq-len", "32", "--data", corpus,
              "--steps", "7", "--ckpt-every", "4", "--eval-every", "3", "--eval-batches", "2",
              "--no-progress"]
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    train(_train_args(_parser().parse_args(["train", *common, "--out", str(ref)])))  # same TrainArgs
    # The command's workers on one thread each, like the reference's ranks: the same arithmetic
    # on any machine. (Not through OMP_NUM_THREADS: a changed environment spawns the workers.)
    monkeypatch.setattr(launcher, "worker_threads", lambda nproc: 1)
    monkeypatch.setenv("QSDP_TEST_KILL_AT", "6:1")
    t0 = time.monotonic()
    assert main(["train", *common, "--out", str(crash), "--nproc", "2", "--max-restarts", "1"]) == 0
    elapsed = time.monotonic() - t0
    a, b = read_summary(ref), read_summary(crash)
    assert b["restarts"] == 1 and b["start_step"] == 4, (b["restarts"], b["start_step"], elapsed)
    assert _resumed_records(crash) == _resumed_records(ref)  # losses, lr, grad norms, bytes, val losses
    for key in ("final_weights_sha256", "final_optimizer_sha256", "final_train_loss",
                "final_val_loss", "nonfinite_skipped"):
        assert b[key] == a[key], key
    data_bytes = [s["wire_bytes_total"] - s["wire"]["control"]["total"]["bytes"] for s in (a, b)]
    assert data_bytes[0] == data_bytes[1]
    root = crash / CHECKPOINT_DIR
    assert (root / LATEST_FILE).read_text().strip() == "step_00000007"
    assert not list(root.glob("*.tmp"))


def test_max_restarts_is_validated(tmp_path, corpus, capsys):
    from qsdp.cli import main

    rc = main(["train", "--data", corpus, "--out", str(tmp_path), "--max-restarts", "-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--max-restarts must be a non-negative integer" in err[0]
    rc = main(["train", "--data", corpus, "--out", str(tmp_path), "--on-nonfinite", "ignore"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--on-nonfinite" in err[0]
    rc = main(["train", "--data", corpus, "--out", str(tmp_path), "--timeout", "inf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "timeout must be a positive number" in err[0]
    assert not (tmp_path / METRICS_FILE).exists()


# ---------------------------------------------------------------------------------------------
# A peer that stops answering


@pytest.mark.timeout(150)
def test_a_stalled_peer_ends_the_run_within_the_timeout_naming_it(tmp_path, corpus, monkeypatch, capsys):
    """Rank 1 sleeps 120 s before step 3; with --timeout 4 the launcher's progress guard ends the
    run (exit 1) about 4 s later, long before the sleeper wakes, with one line naming rank 1 (the
    sleeper, not rank 0, whose collective waited for it) and the stacks of both in --out."""
    from qsdp.cli import main

    timeout = 4
    monkeypatch.setenv("QSDP_TEST_STALL_AT", "3:1:120")
    out = tmp_path / "run"
    argv = ["train", "--preset", "sdp4bit", "--nproc", "2", "--batch-size", "4", "--seq-len", "32",
            "--data", corpus, "--out", str(out), "--steps", "6", "--eval-every", "0",
            "--eval-batches", "2", "--no-progress", "--timeout", str(timeout)]
    assert main(argv) == 1
    ended = time.time()
    last_step_logged = os.path.getmtime(out / METRICS_FILE)  # step 2, just before the stall
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("qsdp:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("qsdp: error: rank 1 (pid "), lines[0]
    assert "at 'step 3', in stall" in lines[0] and "rank 0 waited for it at 'step 3'" in lines[0]
    assert (out / "stack-rank0.txt").exists() and (out / "stack-rank1.txt").exists()
    # The timeout, the guard's grace and the workers' shutdown; nowhere near the 120 s stall.
    assert ended - last_step_logged < timeout + 20, ended - last_step_logged


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints and runs that train nothing


@pytest.mark.timeout(150)
def test_a_run_whose_every_step_since_the_resume_was_skipped_fails(tmp_path, corpus, monkeypatch):
    """Resumed at step 2 for one more step whose gradient is NaN: nothing was trained, so the
    run fails naming that (not "done"), and the summary is not replaced."""
    run = tmp_path / "run"
    train(_args(run, corpus, preset="sdp4bit", steps=2, decay_steps=3))
    monkeypatch.setenv("QSDP_TEST_NAN_AT", "3:1")
    with pytest.raises(RuntimeError, match=r"NonFiniteGradientError: every step since the resume from step 2 "
                                           r"\(steps 3-3\) had non-finite gradients \(NaN/Inf\) and was skipped: "
                                           r"nothing was trained; the last checkpoint is step_00000003"):
        train(_args(run, corpus, preset="sdp4bit", steps=3, decay_steps=3, resume=True))
    assert read_summary(run)["steps"] == 2


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_damaged_checkpoint_is_not_retried_and_resume_from_continues_from_the_previous(
        tmp_path, corpus, capsys):
    """`latest` (step 2) damaged: `--resume --max-restarts 2` ends with one line naming the file
    and step 1 (exit 2); `--resume-from step_00000001` continues from it and makes it latest."""
    from qsdp.cli import main

    run = tmp_path / "run"
    train(_args(run, corpus, preset="fsdp", steps=2, ckpt_every=1, keep_checkpoints=0))
    _flip_last_byte(run / CHECKPOINT_DIR / "step_00000002" / "__1_0.distcp")
    common = ["train", "--preset", "fsdp", "--nproc", "2", "--batch-size", "4", "--seq-len", "32", "--data", corpus,
              "--out", str(run), "--steps", "3", "--lr", "3e-3", "--warmup", "2", "--eval-every", "0",
              "--eval-batches", "2", "--ckpt-every", "0", "--no-progress"]
    assert main([*common, "--resume", "--max-restarts", "2"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == [f"qsdp: error: checkpoint {run / CHECKPOINT_DIR / 'step_00000002'} is damaged: __1_0.distcp "
                     "does not match its digest (xxh3-128-64k) written at save; the previous complete checkpoint is "
                     "step_00000001 (qsdp train: --resume-from step_00000001)"]
    assert main([*common, "--resume-from", "step_00000001"]) == 0
    assert read_summary(run)["start_step"] == 1 and read_summary(run)["restarts"] == 0
    assert latest_checkpoint(run).name == "step_00000003"


def test_a_restarted_worker_ends_at_once_after_an_error_no_restart_can_change(tmp_path, monkeypatch):
    """What `--max-restarts` restarts: after a rank's user error (a bad input, an unusable
    checkpoint) the restarted worker returns before touching anything; after a crash it runs."""
    import json

    from qsdp.train.launcher import _worker_entry, final_error

    record = {"rank": 0, "attempt": 0, "time": 0.0, "type": "CheckpointError", "message": "damaged",
              "user": True, "secondary": False, "traceback": ""}
    (tmp_path / "rank0.attempt0.json").write_text(json.dumps(record))
    assert final_error(tmp_path)["message"] == "damaged"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _worker_entry(None, None, str(tmp_path)) is None  # no args, no plan: nothing else ran
    (tmp_path / "rank0.attempt0.json").write_text(json.dumps({**record, "user": False}))
    assert final_error(tmp_path) is None
