"""Quantization codecs: pure tensor functions, no process groups.

``quantize`` / ``dequantize`` (group-wise uniform, symmetric or min-max; nearest, stochastic or
random-shift rounding), bit packing, the blockwise Walsh-Hadamard transform, and the
counter-based random numbers that make stochastic rounding reproducible on every rank.

The functions here are the torch reference; for CUDA tensors they (and the wire format of
:mod:`qsdp.comm.wire`) run fused Triton kernels instead (:mod:`qsdp.codecs.triton_kernels`,
chosen in :mod:`qsdp.codecs.dispatch`), which give the same bytes.
"""

from .hadamard import hadamard, hadamard_matrix, inverse_hadamard
from .pack import SUPPORTED_BITS, pack_codes, packed_nbytes, unpack_codes
from .quantize import (
    ROUNDINGS,
    QTensor,
    check_scheme,
    count_nonfinite,
    dequantize,
    quantize,
    wire_nbytes,
)

__all__ = [
    "QTensor", "quantize", "dequantize", "wire_nbytes", "check_scheme", "count_nonfinite",
    "hadamard", "inverse_hadamard", "hadamard_matrix",
    "pack_codes", "unpack_codes", "packed_nbytes", "SUPPORTED_BITS", "ROUNDINGS",
]
