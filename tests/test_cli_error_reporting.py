"""An error reaches the user's terminal whichever rank raised it, and a traceback is never lost:
it goes where the run's output goes (its --out), and onto the terminal when no file can hold it."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys

import pytest

import qsdp.cli as cli
from qsdp.cli import main
from qsdp.launch import free_port
from qsdp.train.launcher import root_cause

pytestmark = pytest.mark.timeout(120)

def _job(argv):
    """What `qsdp presets` runs here: join the job's process group (as `qsdp train` does), leave
    it, and then rank 1 alone fails on a bad input."""
    import torch.distributed as dist

    from qsdp.train.args import TrainArgs, TrainError
    from qsdp.train.runtime import init_process_group

    init_process_group(TrainArgs(device="cpu", backend="gloo", timeout_s=60))
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 1:
        raise TrainError("a file only rank 1 cannot read")
    return 0


def _rank(env, stderr_path):
    """One rank as torchrun starts it (its own process, environment and stderr), forked from
    the test process, which has imported torch already: `qsdp presets` ends it with its exit code."""
    import qsdp.preset_table

    os.environ.update(env)
    with open(stderr_path, "w") as err:
        os.dup2(err.fileno(), 2)
    sys.stderr = os.fdopen(2, "w", closefd=False)
    qsdp.preset_table.main = _job
    code = main(["presets"])
    sys.stderr.flush()
    os._exit(code)


def test_a_user_error_on_a_rank_other_than_local_rank_0_reaches_the_terminal_with_its_rank(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    paths = [tmp_path / f"rank{r}.err" for r in range(2)]
    procs = [multiprocessing.get_context("fork").Process(
        target=_rank, args=({**env, "RANK": str(r), "LOCAL_RANK": str(r)}, str(paths[r]))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.join()
    ended = [(p.exitcode, path.read_text()) for p, path in zip(procs, paths)]
    errors = [line for _, err in ended for line in err.splitlines() if line.startswith("qsdp: error:")]
    assert [code for code, _ in ended] == [0, 2]
    assert errors == ["qsdp: error: rank 1: a file only rank 1 cannot read"]


def _broken(argv):
    raise ZeroDivisionError("a bug no check foresaw")


def test_a_traceback_no_file_can_hold_reaches_the_terminal(tmp_path, capsys, monkeypatch):
    import tempfile

    import qsdp.preset_table

    monkeypatch.setattr(qsdp.preset_table, "main", _broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))  # mkstemp fails: no such directory
    assert main(["presets"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "qsdp: error: unexpected ZeroDivisionError: a bug no check foresaw"
    assert "Traceback (most recent call last)" in err and "in _broken" in err


def test_a_train_traceback_goes_into_its_out(tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug no check foresaw")

    monkeypatch.setattr(cli, "run_training", broken)
    out = tmp_path / "run"
    out.mkdir()
    assert main(["train", "--out", str(out)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"qsdp: error: unexpected ZeroDivisionError: a bug no check foresaw (traceback: {out / 'error.txt'})"]
    assert "in broken" in (out / "error.txt").read_text()


def test_a_worker_traceback_no_file_can_hold_reaches_the_terminal(tmp_path, capsys, monkeypatch):
    """The run directory cannot take error.txt (it is gone): the launcher's report carries the
    root cause's traceback, and the command prints it under its one line."""
    record = {"rank": 1, "time": 1.0, "type": "ZeroDivisionError", "message": "division by zero", "user": False,
              "secondary": False, "attempt": 0, "traceback": "Traceback ... ZeroDivisionError: division by zero\n"}
    (tmp_path / "rank1.attempt0.json").write_text(json.dumps(record))
    failure = root_cause(tmp_path, {}, str(tmp_path / "gone"))

    def fails(*args, **kwargs):
        raise failure

    monkeypatch.setattr(cli, "run_training", fails)
    assert main(["train", "--out", str(tmp_path / "gone")]) == 1
    assert capsys.readouterr().err.splitlines() == ["qsdp: error: rank 1: ZeroDivisionError: division by zero",
                                                    "Traceback ... ZeroDivisionError: division by zero"]
