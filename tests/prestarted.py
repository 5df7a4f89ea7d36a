"""Pytest subprocesses run ahead of the tests they belong to, one at a time, at the lowest CPU
priority, while the run goes on.

Some tests run a part of the suite in another process and mode (Triton's CPU interpreter, which
must be chosen before triton is imported): a pytest subprocess that is mostly single-threaded
Python. Started only when its test comes, it adds its whole time to the run. Run ahead under
``nice 19``, it takes only the CPU time the other tests leave idle (forked ranks waiting on each
other, processes starting), and by the time its test comes it is done or under way. Its test
still owns it: the test waits for it under the test's own deadline (a hang fails that test,
which kills it), and asserts on its exit status and output as before. A command the queue has
not reached when its test comes is run by the test itself, at normal priority.

A test opts in with ``@pytest.mark.prestart(spec)``: ``spec(**params)`` (the test's
parametrization) returns the :class:`Command` it will run, or ``None`` where the test would not
run it (skipped in this mode). Besides the pytest subprocesses, commands that start a fresh
interpreter to see it fail or stand without a package (:meth:`Command.python`) run ahead too:
each spends seconds importing torch, in a process of its own. tests/conftest.py queues the commands of the selected tests once
collection is done (one runner process, ``python prestarted.py QUEUE_DIR``, without threads in
the test process) and stops the runner at the end of the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["Command", "Queue", "PRESTARTED"]


@dataclasses.dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # the whole environment, as pairs
    cwd: str

    @classmethod
    def of(cls, argv: list[str], env: dict[str, str], cwd: str) -> Command:
        return cls(tuple(argv), tuple(sorted(env.items())), cwd)

    @classmethod
    def pytest(cls, test_file: str, *args: str, set_env: dict[str, str], drop_env: tuple[str, ...] = ()) -> Command:
        """``python -m pytest -q [args] test_file`` run from the file's folder, in this run's
        environment plus ``set_env``, less ``drop_env`` and what belongs to this run alone (the
        current test's name, a disabled Triton). ``QSDP_TEST_SUBPROCESS`` tells its session not
        to start the workers' fork server (tests/conftest.py): its tests fork their own ranks."""
        return cls.python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning", *args,
                          test_file, cwd=os.path.dirname(test_file), set_env={**set_env, "QSDP_TEST_SUBPROCESS": "1"},
                          drop_env=("QSDP_DISABLE_TRITON", *drop_env))

    @classmethod
    def python(cls, *args: str, cwd: str, set_env: dict[str, str] | None = None,
               drop_env: tuple[str, ...] = ()) -> Command:
        """``python ARGS`` run from ``cwd``, in this run's environment plus ``set_env``, less
        ``drop_env`` and the current test's name."""
        dropped = {"PYTEST_CURRENT_TEST", *drop_env}
        env = {k: v for k, v in os.environ.items() if k not in dropped} | (set_env or {})
        return cls.of([sys.executable, *args], env, cwd)


def _claim(folder: Path, index: int) -> bool:
    """Whether this process is the first to claim command ``index`` (the runner or its test)."""
    try:
        os.close(os.open(folder / f"{index}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _stop_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class Queue:
    """The commands run ahead, by key (a test's node id), and the runner process running them."""

    def __init__(self) -> None:
        self._folder: Path | None = None
        self._index: dict[str, tuple[int, Command]] = {}
        self._runner: subprocess.Popen | None = None

    def start(self, commands: dict[str, Command]) -> None:
        """Queue ``commands`` (key -> command) and start the runner."""
        if not commands or self._runner is not None:
            return
        self._folder = Path(tempfile.mkdtemp(prefix="qsdp-prestart-"))
        specs = []
        for i, (key, command) in enumerate(commands.items()):
            self._index[key] = (i, command)
            specs.append({"argv": list(command.argv), "env": dict(command.env), "cwd": command.cwd})
        (self._folder / "queue.json").write_text(json.dumps(specs), encoding="utf-8")
        self._runner = subprocess.Popen([sys.executable, __file__, str(self._folder)], start_new_session=True,
                                        preexec_fn=lambda: os.nice(19), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def result(self, key: str, command: Command, timeout: float) -> tuple[int, str]:
        """Exit status and output of ``command`` for ``key``: from the runner when it took the
        same command (argv, folder and the whole environment: a test that set a variable after
        the queue was built runs its command here, as it asked), else run here now. On
        ``timeout`` seconds of waiting the command's process group is killed and
        ``subprocess.TimeoutExpired`` raised."""
        queued = self._index.pop(key, None)
        if queued is None or queued[1] != command or _claim(self._folder, queued[0]):
            return _run_here(command, timeout)
        return self._await(queued[0], command, timeout)

    def _await(self, index: int, command: Command, timeout: float) -> tuple[int, str]:
        rc_file, pid_file = self._folder / f"{index}.rc", self._folder / f"{index}.pid"
        deadline, raised = time.monotonic() + timeout, False
        while not rc_file.exists():
            if not raised and pid_file.exists():
                with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                    # awaited now: ahead of whatever else runs (lowering nice needs root)
                    os.setpriority(os.PRIO_PGRP, int(pid_file.read_text()), 0)
                    raised = True
            if time.monotonic() > deadline:
                with contextlib.suppress(ValueError, FileNotFoundError):
                    _stop_group(int(pid_file.read_text()))
                raise subprocess.TimeoutExpired(list(command.argv), timeout)
            time.sleep(0.1)
        output = (self._folder / f"{index}.log").read_text(encoding="utf-8", errors="replace")
        return int(rc_file.read_text()), output

    def stop(self) -> None:
        """Stop the runner and whatever command it runs."""
        if self._runner is None:
            return
        for pid_file in self._folder.glob("*.pid"):
            with contextlib.suppress(ValueError, FileNotFoundError):
                _stop_group(int(pid_file.read_text()))
        _stop_group(self._runner.pid)
        self._runner.wait()
        self._runner = None


def _run_here(command: Command, timeout: float) -> tuple[int, str]:
    """Run ``command`` now, in its own process group: on ``timeout`` the whole group is killed (a
    pytest subprocess's own children with it) and ``subprocess.TimeoutExpired`` raised."""
    with subprocess.Popen(command.argv, env=dict(command.env), cwd=command.cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                          start_new_session=True) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc.pid)
            proc.communicate()
            raise
    return proc.returncode, output


def _run_queue(folder: Path) -> None:
    """The runner: each queued command not claimed by its test yet, in order, in its own process
    group (so that its test can raise its priority or kill it)."""
    for i, spec in enumerate(json.loads((folder / "queue.json").read_text(encoding="utf-8"))):
        if not _claim(folder, i):
            continue
        with open(folder / f"{i}.log", "wb") as log:
            proc = subprocess.Popen(spec["argv"], env=spec["env"], cwd=spec["cwd"], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            (folder / f"{i}.pid").write_text(str(proc.pid))
            rc = proc.wait()
        tmp = folder / f"{i}.rc.tmp"
        tmp.write_text(str(rc))
        tmp.replace(folder / f"{i}.rc")


PRESTARTED = Queue()

if __name__ == "__main__":
    _run_queue(Path(sys.argv[1]))
