"""Run a user's script as ``torchrun --nproc-per-node N script.py ARGS`` runs it, without a fresh
interpreter a worker.

torchrun is torch's elastic agent launching N workers, each a new Python that imports torch
before the script's first line (about 3.5 s of a core each here). ``run_script`` asks the same
agent (``qsdp.launch.launch_local``, the c10d rendezvous, the elastic environment: ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, ``TORCHELASTIC_RUN_ID``) for workers
forked from the run's preloaded server, and each runs the script as ``__main__`` with its
arguments in ``sys.argv`` and one CPU thread, as torchrun's ``OMP_NUM_THREADS=1`` gives it. What
is left out is torchrun's own command line, which one test per script family still runs for real
(tests/test_examples.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys

from qsdp.launch import launch_local


def _run_as_main(path: str, argv: list[str], cwd: str) -> str:
    """In a worker: ``path`` run as ``__main__`` from ``cwd``; returns what it printed."""
    import torch

    os.chdir(cwd)
    sys.argv = [path, *argv]
    torch.set_num_threads(1)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise RuntimeError(f"{path} exited with {done.code}; it printed:\n{printed.getvalue()}") from done
    return printed.getvalue()


def run_script(nproc: int, path: str, *argv: str, cwd: str | None = None) -> str:
    """What ``torchrun --nproc-per-node nproc path argv`` (run from ``cwd``) prints on stdout,
    rank by rank. A worker's failure raises torch's ``ChildFailedError`` naming its rank and
    exception."""
    cwd = os.path.abspath(cwd or os.getcwd())
    printed = launch_local(_run_as_main, nproc, os.path.abspath(os.path.join(cwd, path)), list(argv), cwd)
    return "".join(printed[rank] for rank in sorted(printed))
