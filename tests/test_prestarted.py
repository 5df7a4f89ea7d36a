"""The queue of pytest subprocesses run ahead (tests/prestarted.py): a test gets its own command's
result, whoever ran it, and a command past its deadline is killed with everything it started."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from prestarted import Command, Queue

pytestmark = pytest.mark.timeout(60)


def _python(code: str) -> Command:
    return Command.of([sys.executable, "-c", code], dict(os.environ), os.getcwd())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def test_a_queued_command_gives_its_test_the_status_and_output_of_the_run_ahead():
    queue = Queue()
    command = _python("import sys; print('ahead'); sys.exit(3)")
    queue.start({"t": command})
    try:
        assert queue.result("t", command, timeout=30) == (3, "ahead\n")
    finally:
        queue.stop()


def test_a_command_other_than_the_queued_one_runs_in_the_test_itself():
    queue = Queue()
    queue.start({"t": _python("print('queued')")})
    try:
        assert queue.result("t", _python("print('asked')"), timeout=30) == (0, "asked\n")
    finally:
        queue.stop()


def test_a_command_asked_in_another_environment_runs_in_the_test_itself():
    """Same argv and folder, one variable different (a cache the test set after the queue was
    built): the test runs what it asked for, in its environment."""
    queue = Queue()
    code = "import os; print(os.environ.get('QSDP_CACHE_DIR'))"
    queue.start({"t": Command.of([sys.executable, "-c", code], {**os.environ, "QSDP_CACHE_DIR": "queued"}, os.getcwd())})
    try:
        asked = Command.of([sys.executable, "-c", code], {**os.environ, "QSDP_CACHE_DIR": "asked"}, os.getcwd())
        assert queue.result("t", asked, timeout=30) == (0, "asked\n")
    finally:
        queue.stop()


def test_a_command_run_here_past_its_deadline_is_killed_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    command = _python(
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        Queue().result("not queued", command, timeout=3)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)
