"""Workers run with any number of intra-op threads, started as a user starts them.

GNU OpenMP deadlocks a child forked after its parent ran a parallel region. The local launcher
forks its workers from a server (qsdp.worker_start); a worker with two or more threads hung in
its first large operator (``fully_shard``'s ``new_zeros``) whenever the server had run one.
Every test here is a fresh process with the machine's own thread counts: the real ``qsdp``
command (this machine's cores shared by the workers, or ``OMP_NUM_THREADS=2``), nothing patched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qsdp.worker_start import PRELOAD

QSDP = str(Path(sys.executable).with_name("qsdp"))
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS", "QSDP_WORKER_START", "QSDP_TEST_KILL_AT", "PYTEST_CURRENT_TEST")


def _env(tmp_path_factory, **more: str) -> dict[str, str]:
    """A shell's environment: no torchrun variables, no thread count unless given, the session's cache."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["QSDP_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "qsdp-cache")
    return {**env, **more}


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``argv`` to its end; a hang fails the test (the process group is killed) instead of the run."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not end in {timeout:g} s\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _train(corpus: str, out: Path, *more: str) -> list[str]:
    return [QSDP, "train", "--no-progress", "--model", "tiny", "--batch-size", "2", "--seq-len", "32",
            "--eval-batches", "1", "--data", corpus, "--out", str(out), *more]


# A child forked after the imports runs a parallel fill with two threads; the parent waits for it.
_FORK_AFTER_IMPORTS = """
import importlib, os, sys, time
for name in sys.argv[1:]:
    importlib.import_module(name)
import torch
pid = os.fork()
if pid == 0:
    torch.set_num_threads(2)
    torch.zeros(4_000_000).fill_(1.0)
    os._exit(0)
deadline = time.monotonic() + float(os.environ.get("CHILD_DEADLINE_S", "60"))
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit("the forked child hung in its first parallel operator")
"""


@pytest.mark.timeout(120)
def test_a_child_forked_after_importing_the_servers_modules_runs_parallel_operators(tmp_path_factory, tmp_path):
    """The server's own imports (qsdp's among them) run no parallel region, even with the
    machine's threads: a process that imported them forks a child that runs two threads."""
    modules = [m for m in PRELOAD if m != "qsdp_fork_server"]
    result = _run([sys.executable, "-c", _FORK_AFTER_IMPORTS, *modules],
                  _env(tmp_path_factory, OMP_NUM_THREADS="2"), tmp_path, timeout=100)
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(120)
def test_the_fork_server_runs_its_imports_on_one_thread_whatever_they_compute(tmp_path_factory, tmp_path):
    """Imported first, qsdp_fork_server keeps the server out of parallel regions: a module that
    runs a large operator at import, preloaded after it, leaves the fork safe."""
    (tmp_path / "splits_at_import.py").write_text("import torch\ntorch.zeros(4_000_000).fill_(2.0)\n")
    env = _env(tmp_path_factory, OMP_NUM_THREADS="2", CHILD_DEADLINE_S="15",
               PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    unguarded = _run([sys.executable, "-c", _FORK_AFTER_IMPORTS, "splits_at_import"], env, tmp_path, timeout=100)
    guarded = _run([sys.executable, "-c", _FORK_AFTER_IMPORTS, "qsdp_fork_server", "splits_at_import"], env, tmp_path,
                   timeout=100)
    assert unguarded.returncode != 0 and "hung" in unguarded.stderr  # what the guard is for
    assert guarded.returncode == 0, guarded.stderr


# A module of the test's folder: a forked worker finds the function it runs by its module's name.
_THREADS_OF_FORKED_WORKERS = """
import json, torch

def threads():
    torch.zeros(4_000_000).fill_(1.0)  # a parallel region, in a worker forked from the server
    return torch.get_num_threads()

if __name__ == "__main__":
    from qsdp.launch import launch_local
    from qsdp.worker_start import start_method
    from threads_job import threads

    method = start_method()
    print(json.dumps({"method": method, "threads": sorted(launch_local(threads, 2).values())}))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("omp", ["1", "2", None])
def test_forked_workers_have_the_threads_a_spawned_worker_would_have(tmp_path_factory, tmp_path, omp):
    """``launch_local``'s forked workers run a parallel operator with OMP_NUM_THREADS's threads,
    or, unset, torch's default for this machine (what a fresh interpreter picks)."""
    (tmp_path / "threads_job.py").write_text(_THREADS_OF_FORKED_WORKERS)
    env = _env(tmp_path_factory, **({"OMP_NUM_THREADS": omp} if omp else {}),
               PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    default = _run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env, tmp_path)
    result = _run([sys.executable, str(tmp_path / "threads_job.py")], env, tmp_path, timeout=150)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["method"] == "forkserver"
    assert seen["threads"] == [int(default.stdout)] * 2


@pytest.mark.timeout(240)
def test_qsdp_train_with_one_worker_uses_the_machines_cores(tmp_path_factory, tmp_path, tiny_corpus):
    """`qsdp train --nproc 1`: one worker with every core's thread (two on a 2-core machine)."""
    result = _run(_train(tiny_corpus, tmp_path / "run", "--nproc", "1", "--steps", "3"), _env(tmp_path_factory),
                  tmp_path)
    assert result.returncode == 0, result.stderr
    assert "qsdp: done: 3 steps" in result.stderr + result.stdout


@pytest.mark.timeout(240)
def test_qsdp_train_with_two_threads_a_worker(tmp_path_factory, tmp_path, tiny_corpus):
    """`OMP_NUM_THREADS=2 qsdp train --nproc 2`."""
    result = _run(_train(tiny_corpus, tmp_path / "run", "--nproc", "2", "--steps", "3"),
                  _env(tmp_path_factory, OMP_NUM_THREADS="2"), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "qsdp: done: 3 steps" in result.stderr + result.stdout


@pytest.mark.timeout(300)
def test_a_killed_worker_with_two_threads_restarts_and_the_run_ends_done(tmp_path_factory, tmp_path, tiny_corpus):
    """`OMP_NUM_THREADS=2 qsdp train --nproc 2 --max-restarts 1`, rank 1 killed after step 3:
    the restarted workers (forked again from the same server) resume and finish."""
    out = tmp_path / "run"
    result = _run(_train(tiny_corpus, out, "--nproc", "2", "--steps", "5", "--ckpt-every", "2", "--max-restarts", "1"),
                  _env(tmp_path_factory, OMP_NUM_THREADS="2", QSDP_TEST_KILL_AT="3:1"), tmp_path, timeout=280)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["restarts"], summary["start_step"], summary["steps"]) == (1, 2, 5)


@pytest.mark.timeout(420)
def test_qsdp_demo_with_two_threads_a_worker(tmp_path_factory, tmp_path):
    """`OMP_NUM_THREADS=2 qsdp demo --steps 2`: the three presets' 4 workers each, to the table."""
    result = _run([QSDP, "demo", "--out", str(tmp_path / "demo"), "--steps", "2"],
                  _env(tmp_path_factory, OMP_NUM_THREADS="2"), tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr
    assert "sdp4bit" in result.stdout and "wall time" in result.stdout
