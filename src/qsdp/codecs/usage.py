"""Which codec implementation ran in this process: the fused Triton kernels or the torch
reference. Kept apart from :mod:`qsdp.codecs.dispatch` because both the reference and the kernels
record here, and the dispatch imports the kernels."""

from __future__ import annotations

import functools
from typing import Callable

# The implementations that ran a codec step in this process since the last reset.
_RAN: set[str] = set()


def record_run(implementation: str) -> None:
    """Note that a codec step (quantize or dequantize) ran on ``implementation``: ``"triton"``
    (the fused kernels) or ``"torch"`` (the reference)."""
    _RAN.add(implementation)


def recorder(implementation: str) -> Callable[[], None]:
    """:func:`record_run` of ``implementation`` as a callable of no arguments that runs no Python
    frame (a steady launch calls it every time)."""
    return functools.partial(_RAN.add, implementation)


def implementations_run(*, reset: bool = False) -> str:
    """The codec implementations that ran in this process since the last reset: ``"none"``
    (nothing was quantized or dequantized), ``"triton"``, ``"torch"``, or ``"torch+triton"``
    when both did (a scheme the kernels do not cover falls back to the reference)."""
    ran = "+".join(sorted(_RAN)) or "none"
    if reset:
        _RAN.clear()
    return ran
