"""The host's floor of one collective call: its time with every kernel launch a no-op, and its
Python function calls, beside FSDP2's own collective of the same size.

On a GPU a collective's wall time is at least what the host spends issuing it: the comm
object's Python, its torch operators and Triton's launch wrappers. That much can be measured on
CPU (:mod:`qsdp.bench.census`'s emulated world, whose collectives only copy): the codecs take
the fused path (``QSDP_TRITON_ON_CPU=1 TRITON_INTERPRET=1``) and every Triton kernel object of
:mod:`qsdp.codecs.triton_kernels` is replaced by one whose launch does nothing
(:func:`launches_do_nothing`), so qsdp's launch wrappers run and the kernels do not: what the
host does on a GPU, less the driver's launch itself. The emulated collectives likewise move no
bytes while a floor is timed (:func:`collectives_move_nothing`): a GPU host only enqueues a
collective, whatever its size, so each is its process-group call alone, for qsdp's collectives
and FSDP2's alike (the emulated all-reduce never moved any). These replacements are the
measurement's method, not a model of the kernels: their outputs are left as allocated.

* ``host_us``: microseconds a call, the minimum over ``repeats`` runs of ``calls`` calls (the
  minimum: a loaded machine only ever adds time), after two warm-up calls; one torch thread,
  denormals flushed (the kernels' untouched outputs hold arbitrary bits, whose slow denormal
  arithmetic no GPU would do);
* ``fsdp2_us``: the same for FSDP2's own collective of the same group, size and dtype
  (``reduce_scatter_tensor``; ``all_gather_into_tensor`` in place after the copy of the shard
  into the gathered buffer, as FSDP2 gathers and as the qsdp gather's call is timed, with the
  optimizer's step between two where the qsdp gathers are a training step's; or across HSDP
  replicas ``all_reduce`` of a copy), measured in the same run, interleaved run by run;
* ``py_calls``: Python function calls one steady call makes (``sys.setprofile``'s ``call``
  events: qsdp's and torch's Python alike), ``qsdp_calls`` those of qsdp's own functions. They
  do not depend on the machine: the tests hold them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterator

import torch

__all__ = ["collectives_move_nothing", "launches_do_nothing", "min_us", "python_calls", "REPEATS", "CALLS"]

REPEATS = 5
CALLS = 25


class _IdleKernel:
    """A Triton kernel whose launch (``kernel[grid](*args, **kwargs)``) does nothing."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.__name__ = getattr(kernel, "__name__", type(kernel).__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return _idle

    def run(self, *args: Any, **kwargs: Any) -> None:
        return None


def _idle(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def launches_do_nothing() -> Iterator[list[str]]:
    """Within it, every Triton kernel of :mod:`qsdp.codecs.triton_kernels` launches nothing
    (yields their names); restored after."""
    from triton.runtime.jit import KernelInterface

    from ..codecs import triton_kernels as tk

    saved = {name: k for name, k in vars(tk).items() if isinstance(k, KernelInterface)}
    try:
        for name, kernel in saved.items():
            setattr(tk, name, _IdleKernel(kernel))
        yield sorted(saved)
    finally:
        for name, kernel in saved.items():
            setattr(tk, name, kernel)


@contextlib.contextmanager
def collectives_move_nothing(group_class: type) -> Iterator[None]:
    """Within it, the emulated collectives of ``group_class`` (a process group class with a
    ``moves_data`` attribute, :class:`qsdp.bench.census.CensusGroup`) copy no bytes: each is its
    call alone, as every launch is (see the module doc); restored after."""
    saved = group_class.moves_data
    group_class.moves_data = False
    try:
        yield
    finally:
        group_class.moves_data = saved


@contextlib.contextmanager
def quiet_cpu() -> Iterator[None]:
    """One torch thread, denormals flushed (see the module doc); restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def min_us(fns: dict[str, Callable[[], Any]], repeats: int = REPEATS, calls: int = CALLS) -> dict[str, float]:
    """Microseconds a call of each of ``fns``: the minimum over ``repeats`` runs of ``calls``
    calls, the functions' runs interleaved (run ``k`` of each before run ``k + 1`` of any)."""
    for fn in fns.values():
        fn()
        fn()
    best = {name: float("inf") for name in fns}
    clock = time.perf_counter
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (clock() - t0) / calls)
    return {name: s * 1e6 for name, s in best.items()}


def python_calls(fn: Callable[[], Any]) -> tuple[int, int]:
    """(Python function calls, those of qsdp's own functions) one call of ``fn`` makes."""
    total = ours = 0
    qsdp_dir = __file__.rsplit("/bench/", 1)[0] + "/"

    def profile(frame, event, arg):
        nonlocal total, ours
        if event == "call":
            total += 1
            if frame.f_code.co_filename.startswith(qsdp_dir):
                ours += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    # the profiler sees fn's own frame (and nothing of setprofile's return)
    return total - 1, ours - int(fn.__code__.co_filename.startswith(qsdp_dir))
