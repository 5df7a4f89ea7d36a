"""One run at a time in a run directory: a second ``qsdp train`` given the ``--out`` of a live
run is refused in one line naming the holder's host and pid, on every rank; a lock its holder
left behind (the process is gone) is taken over."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket

import pytest

from distributed import run_world
from qsdp.cli import main
from qsdp.train.args import TrainError
from qsdp.train.runlock import LOCK_FILE, acquire, holder_refusal

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _shell(outside_torchrun):
    pass


def _hold(out, taken, done, release_at_end):
    """A process that takes the lock of ``out``, says so, and waits (or dies holding it)."""
    from qsdp.train.runlock import release

    acquire(out)
    taken.set()
    if release_at_end:
        done.wait(60)
        release(out)
    os._exit(0)


def _holder(out, release_at_end=True):
    ctx = mp.get_context("fork")
    taken, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(str(out), taken, done, release_at_end))
    proc.start()
    assert taken.wait(30)
    return proc, done


def test_a_run_into_a_directory_a_live_run_holds_is_refused_naming_its_host_and_pid(tmp_path, tiny_corpus, capsys):
    out = tmp_path / "run"
    out.mkdir()
    proc, done = _holder(out)
    try:
        rc = main(["train", "--data", tiny_corpus, "--out", str(out), "--steps", "2", "--no-progress"])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    finally:
        done.set()
        proc.join(30)
    assert rc == 2 and len(lines) == 1, lines
    assert f"is in use by another qsdp train run (pid {proc.pid} on host {socket.gethostname()!r}" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == []  # the holder gave it back; nothing else was written


def test_a_lock_whose_holder_is_gone_is_taken_over(tmp_path):
    proc, _ = _holder(tmp_path, release_at_end=False)  # dies holding it, as a crashed run
    proc.join(30)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == proc.pid
    assert holder_refusal(tmp_path) is None
    acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def _lock_on_every_rank(rank, world, out):
    from qsdp.train.loop import _lock_run_directory

    try:
        _lock_run_directory(out, rank)
    except TrainError as e:
        return str(e)
    return None


def test_every_rank_refuses_together_when_rank_0_finds_the_directory_held(tmp_path):
    proc, done = _holder(tmp_path)
    try:
        messages = run_world(_lock_on_every_rank, 2, str(tmp_path), timeout=60)
    finally:
        done.set()
        proc.join(30)
    assert all(m is not None and f"pid {proc.pid}" in m for m in messages)
