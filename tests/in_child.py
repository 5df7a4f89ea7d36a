"""Run a test's body in a forked child of the pytest process.

A one-process world (``qsdp.bench.one_rank``: FSDP2 and the comm objects on an emulated world
inside one process) leaves state behind in the process it ran in: a world forked from that process
later (the pooled worlds of ``tests/distributed.py``) saved DCP checkpoints whose sharded
parameters all claimed offset 0. The benchmarks run it in a process of their own; their tests
run it in a child that ends with the test.
"""

from __future__ import annotations

import functools
import multiprocessing
import traceback
from typing import Any, Callable

import pytest

TIMEOUT_S = 200.0


def in_child(test: Callable[..., Any]) -> Callable[..., Any]:
    """``test`` (its fixtures as arguments, its result ignored) run in a forked child; a failure
    or an exception there fails the test with the child's traceback."""
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        ctx = multiprocessing.get_context("fork")
        errors = ctx.SimpleQueue()

        def body() -> None:
            try:
                test(*args, **kwargs)
                errors.put(None)
            except BaseException:  # noqa: BLE001 - every failure goes back to the test
                errors.put(traceback.format_exc())

        child = ctx.Process(target=body)
        child.start()
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
            pytest.fail(f"the test's child did not finish in {TIMEOUT_S:.0f} s")
        error = errors.get() if not errors.empty() else f"the test's child died (exit code {child.exitcode})"
        if error:
            pytest.fail(error, pytrace=False)

    return run
