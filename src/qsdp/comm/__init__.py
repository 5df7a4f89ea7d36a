"""Quantized collectives with FSDP2's custom comm interface (their base classes in
:mod:`qsdp.comm.base`), the topology and the byte meter."""

from .all_gather import DifferenceAllGather, PlainAllGather, QuantizedAllGather
from .base import CommBase, GradReduceScatter, WeightAllGather
from .meter import METER, ByteMeter, comm_stats
from .reduce_scatter import PlainReduceScatter, QuantizedReduceScatter
from .topology import Topology, build_topology
from .wire import RowCodec

__all__ = [
    "CommBase", "WeightAllGather", "GradReduceScatter",
    "PlainAllGather", "QuantizedAllGather", "DifferenceAllGather",
    "PlainReduceScatter", "QuantizedReduceScatter",
    "Topology", "build_topology", "RowCodec", "METER", "ByteMeter", "comm_stats",
]
