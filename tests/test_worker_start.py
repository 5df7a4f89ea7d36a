"""Local launches fork their workers from a server that imported torch and qsdp once
(qsdp.worker_start), and a forked worker sees what a spawned one would: the launcher's
environment and its stdout and stderr at the launch."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import sys

import pytest

from qsdp.launch import launch_local
from qsdp.worker_start import start_method

pytestmark = pytest.mark.timeout(180)


def _whoami(tag: str) -> tuple[int, str | None]:
    print(f"out {tag} rank {os.environ['RANK']}", flush=True)
    print(f"err {tag} rank {os.environ['RANK']}", file=sys.stderr, flush=True)
    return os.getppid(), os.environ.get("QSDP_PROBE")


def _server_pid() -> int:
    return multiprocessing.forkserver._forkserver._forkserver_pid  # noqa: SLF001


def test_workers_of_every_launch_are_forked_from_one_server():
    assert start_method() == "forkserver"
    first = launch_local(_whoami, 2, "a")
    second = launch_local(_whoami, 2, "b")
    parents = {ppid for ppid, _ in [*first.values(), *second.values()]}
    assert parents == {_server_pid()} and os.getpid() not in parents


def test_a_launch_after_the_environment_changed_spawns_workers_that_see_the_change(monkeypatch):
    monkeypatch.setenv("QSDP_PROBE", "changed")
    assert start_method() == "spawn"
    results = launch_local(_whoami, 2, "c")
    assert {value for _, value in results.values()} == {"changed"}
    assert {ppid for ppid, _ in results.values()} != {_server_pid()}


def test_forked_workers_write_where_the_launcher_writes_at_the_launch(capfd):
    assert start_method() == "forkserver"
    launch_local(_whoami, 2, "d")
    out, err = capfd.readouterr()
    assert sorted(line for line in out.splitlines() if line.startswith("out d")) == ["out d rank 0", "out d rank 1"]
    assert sorted(line for line in err.splitlines() if line.startswith("err d")) == ["err d rank 0", "err d rank 1"]


def test_spawn_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.setenv("QSDP_WORKER_START", "spawn")
    assert start_method() == "spawn"


def _node_and_kill(_tag: str) -> tuple[int, str | None, str | None]:
    return os.getppid(), os.environ.get("QSDP_NODE"), os.environ.get("QSDP_TEST_KILL_AT")


def test_qsdps_own_run_time_variables_reach_forked_workers_set_or_unset(monkeypatch):
    monkeypatch.setenv("QSDP_NODE", "node-b")
    monkeypatch.delenv("QSDP_TEST_KILL_AT", raising=False)
    assert start_method() == "forkserver"
    results = launch_local(_node_and_kill, 2, "e")
    assert set(results.values()) == {(_server_pid(), "node-b", None)}


def test_qsdp_train_forks_its_workers_each_on_its_share_of_the_cores(tmp_path, corpus, caplog):
    """The launcher gives each worker its threads inside the worker: set in the launcher's
    environment, they would make every `qsdp train --nproc` spawn its workers."""
    import json

    from qsdp.cli import main

    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
    with caplog.at_level("INFO", logger="qsdp.worker_start"):
        assert main(["train", "--preset", "fsdp", "--nproc", "2", "--batch-size", "2", "--seq-len", "16",
                     "--data", corpus, "--out", str(tmp_path), "--steps", "1", "--eval-every", "0",
                     "--eval-batches", "1", "--no-progress"]) == 0
    assert not [r.message for r in caplog.records if "spawning workers" in r.message]
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    assert f", {threads} threads/rank)" in summary["device"]
    assert "OMP_NUM_THREADS" not in os.environ or os.environ["OMP_NUM_THREADS"] == threads


def _imported_at_start() -> list[str]:
    return [name for name in ("torch.distributed.fsdp", "torch._dynamo", "qsdp.train.launcher") if name in sys.modules]


def test_a_forked_worker_starts_with_what_fsdp2s_first_fully_shard_imports():
    # torch._dynamo alone took about 1 s of a core a worker, at its first fully_shard.
    assert start_method() == "forkserver"
    results = launch_local(_imported_at_start, 2)
    assert list(results.values()) == [["torch.distributed.fsdp", "torch._dynamo", "qsdp.train.launcher"]] * 2
