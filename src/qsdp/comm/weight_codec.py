"""The wire codec of the quantized weight all-gathers: one place for the direct
(:mod:`qsdp.comm.all_gather`) and the weight-difference (:mod:`qsdp.comm.difference`) gathers,
and for the performance model that prices their bytes."""

from __future__ import annotations

from ..config import WeightComm
from .wire import RowCodec


def weight_codec(w: WeightComm) -> RowCodec:
    """The row codec of ``w``'s quantizer (bits, group size, symmetric, rounding)."""
    return RowCodec(bits=w.bits, group_size=w.group_size, symmetric=w.symmetric, rounding=w.rounding)
