"""A steady launch of a Triton kernel through the compiled variant its first replay found.

``kernel[grid](*args, **kwargs)`` binds its arguments, works out their specialization and looks
the compiled variant up, in Python, at every launch: tens of microseconds of a GPU host's time,
more than a collective's small kernels take to run. A collective's plan launches one kernel with
the same integers, dtypes and constexprs again and again (:class:`~qsdp.codecs.triton_kernels.Launch`),
only its tensors and its rounding key new. So the compiled kernel its first replay returned (the
first launch of a plan's kept Launch after the call that derived it; a launch derived at every
call keeps none) can be launched directly: a :class:`Handle` holds that kernel's launcher for the
grid (``CompiledKernel[grid]``) and the constexpr values that follow the positional arguments,
and :func:`launched` launches it where the tensors are as Triton specialized them (every one on a
16-byte boundary, as then) and the current device is the same; anything else goes through
``kernel[grid]`` again, which compiles or finds the variant that fits.

Handles are made only where this Triton launches a compiled kernel as they do: its
``JITFunction.run`` hands the launcher every bound argument, constexprs included, and
``CompiledKernel[grid]`` takes the same (read from Triton's source once, :func:`supported`);
never under Triton's interpreter, nor with ``QSDP_TRITON_JIT_LAUNCH=1`` (every launch through
``kernel[grid]``: the comparison the GPU tests make).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, NamedTuple

import torch

_SUPPORTED: bool | None = None


def supported() -> bool:
    """Whether steady launches may go through handles here (see the module doc); read once."""
    global _SUPPORTED
    if _SUPPORTED is None:
        _SUPPORTED = _launches_like_triton()
    return _SUPPORTED


def _launches_like_triton() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("QSDP_TRITON_JIT_LAUNCH") == "1":
        return False
    try:
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction

        run = inspect.getsource(JITFunction.run)
        item = inspect.getsource(CompiledKernel.__getitem__)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return ("kernel.packed_metadata" in run and "*bound_args.values())" in run
            and "self.packed_metadata" in item and "*args)" in item)


class Handle(NamedTuple):
    """A compiled kernel's launcher for one grid (``launch(*args, *constants)``), the constexpr
    values after the positional arguments, the positions of the tensors among those and the
    CUDA device it was found on."""

    launch: Callable[..., Any]
    constants: tuple
    tensors: tuple[int, ...]
    device: int


def constants_after(kernel: Any, positional: int, kwargs: dict) -> tuple:
    """The values of ``kernel``'s parameters after its first ``positional`` ones, in its
    signature's order: those ``kwargs`` gives, else their defaults (what Triton binds)."""
    values = []
    for param in kernel.params[positional:]:
        if param.name in kwargs:
            values.append(kwargs[param.name])
        elif param.default is not inspect.Parameter.empty:
            values.append(param.default)
        else:
            raise TypeError(f"{getattr(kernel, '__name__', kernel)} needs its argument {param.name!r}")
    return tuple(values)


def found(compiled: Any, kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> Handle | None:
    """The handle of ``compiled``, what ``kernel[grid](*args, **kwargs)`` returned, for later
    launches with new tensors; ``None`` where none can serve (not :func:`supported`, no compiled
    kernel returned, a tensor not on a 16-byte boundary or not on CUDA)."""
    if compiled is None or not supported() or not hasattr(compiled, "packed_metadata"):
        return None
    tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    if any(not args[i].is_cuda or args[i].data_ptr() & 15 for i in tensors):
        return None
    return Handle(compiled[grid], constants_after(kernel, len(args), kwargs), tensors, torch.cuda.current_device())


def launched(handle: Handle, args: tuple) -> bool:
    """Launch ``handle`` with ``args`` (the positional arguments it was found with, new tensors and
    key) where they fit the variant it holds; whether it did."""
    if torch.cuda.current_device() != handle.device:
        return False
    for i in handle.tensors:
        if args[i].data_ptr() & 15:
            return False
    handle.launch(*args, *handle.constants)
    return True
