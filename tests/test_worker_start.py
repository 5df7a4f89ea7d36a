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


def _imported_at_start() -> list[str]:
    return [name for name in ("torch.distributed.fsdp", "torch._dynamo", "qsdp.train.launcher") if name in sys.modules]


def test_a_forked_worker_starts_with_what_fsdp2s_first_fully_shard_imports():
    # torch._dynamo alone took about 1 s of a core a worker, at its first fully_shard.
    assert start_method() == "forkserver"
    results = launch_local(_imported_at_start, 2)
    assert list(results.values()) == [["torch.distributed.fsdp", "torch._dynamo", "qsdp.train.launcher"]] * 2
