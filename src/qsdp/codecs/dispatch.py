"""Which implementation of a codec step runs: the fused Triton kernels of
:mod:`qsdp.codecs.triton_kernels` for CUDA tensors when triton can be imported, the torch
reference otherwise (CPU tensors always; ``QSDP_DISABLE_TRITON=1`` forces it everywhere).

Both give the same bytes (the kernels are tested against the reference), so the choice is about
speed only. ``QSDP_TRITON_ON_CPU=1`` together with ``TRITON_INTERPRET=1`` (both read once, at
import) also sends CPU tensors to the kernels, run by Triton's interpreter: for tests only.

What did run is recorded per process in :mod:`qsdp.codecs.usage`, so a run reports the codecs
it used rather than the ones it would have chosen.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

_ON_CPU = os.environ.get("QSDP_TRITON_ON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"

# QSDP_DISABLE_TRITON is read at every codec step (tests and users may set it at any time):
# on POSIX from os.environ's own dict, which os.environ keeps current (os.environ.get costs
# three Python calls, and a collective asks several times a call).
_ENVIRON = getattr(os.environ, "_data", None)
if os.name == "posix" and isinstance(_ENVIRON, dict):

    def disabled() -> bool:
        """Whether ``QSDP_DISABLE_TRITON=1`` is set now."""
        return _ENVIRON.get(b"QSDP_DISABLE_TRITON") == b"1"
else:  # pragma: no cover - other platforms

    def disabled() -> bool:
        """Whether ``QSDP_DISABLE_TRITON=1`` is set now."""
        return os.environ.get("QSDP_DISABLE_TRITON") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the codec step on tensor ``t`` should run the fused Triton kernel."""
    if not (t.is_cuda or _ON_CPU):
        return False
    if disabled():
        return False
    return triton_available()


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether triton (and so :mod:`qsdp.codecs.triton_kernels`) can be imported."""
    try:
        from . import triton_kernels  # noqa: F401
    except ImportError:
        return False
    except Exception as e:  # a broken install: say so once, keep training on the reference
        warnings.warn(f"qsdp: triton is installed but failed to import ({e!r}); using the torch reference codecs")
        return False
    return True
