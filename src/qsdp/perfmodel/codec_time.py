"""Codec time: how long the quantize and dequantize kernels of a collective take.

The speeds are GB/s of the high-precision (fp32/bf16) tensor a kernel reads or writes: measured
by ``qsdp bench kernels --save FILE`` (read with :func:`load_kernels`), or, without a
measurement, the hardware's ``quant_hbm_fraction`` of its HBM bandwidth.
"""

from __future__ import annotations

import json
from typing import Mapping

from .collectives import Collective
from .hardware import Hardware

KERNEL_NAMES = ("quantize", "dequantize", "hadamard_quantize")


def load_kernels(path: str) -> dict[str, float]:
    """``{"kernels": {"<name>": {"gbps": ..}}}`` -> ``{name: GB/s}`` for the names this model
    uses (``quantize``, ``dequantize``, ``hadamard_quantize``); ``gbps`` is read as GB/s of the
    high-precision (fp32/bf16) tensor the kernel reads or writes."""
    with open(path) as f:
        data = json.load(f)
    kernels = data.get("kernels", data) if isinstance(data, dict) else None
    if not isinstance(kernels, dict):
        raise ValueError(f"{path}: expected {{\"kernels\": {{name: {{\"gbps\": ..}}}}}}")
    out = {}
    for name, entry in kernels.items():
        gbps = entry.get("gbps") if isinstance(entry, dict) else None
        if isinstance(gbps, (int, float)) and gbps > 0:
            out[name] = float(gbps)
    if "quantize" not in out and "dequantize" not in out:
        raise ValueError(f"{path}: no 'quantize' or 'dequantize' kernel with a positive 'gbps'")
    return out


def kernel_gbps(hw: Hardware, kernels: Mapping[str, float] | None, name: str) -> float:
    """GB/s of kernel ``name`` (one of :data:`KERNEL_NAMES`): the measured speed where given (a
    Hadamard quantize without its own falls back to ``quantize``), else ``hw.quant_gbps``."""
    k = kernels or {}
    if name == "hadamard_quantize":
        return k.get(name, k.get("quantize", hw.quant_gbps))
    return k.get(name, hw.quant_gbps)


def kernel_times(c: Collective, hw: Hardware, kernels: Mapping[str, float] | None) -> tuple[float, float]:
    """Seconds of (quantize, dequantize) of one rank for collective ``c``: its elements over the
    kernel speed, plus ``hw.codec_call_us`` for each of the two calls it makes."""
    q = kernel_gbps(hw, kernels, "hadamard_quantize" if c.hadamard else "quantize")
    dq = kernel_gbps(hw, kernels, "dequantize")
    call = hw.codec_call_us * 1e-6
    return (c.quantize * c.hp_bytes / (q * 1e9) + (call if c.quantize else 0.0),
            c.dequantize * c.hp_bytes / (dq * 1e9) + (call if c.dequantize else 0.0))
