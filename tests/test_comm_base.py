"""The comms' shared interface: FSDP2's comm classes, found in torch and implemented by every
qsdp all-gather and reduce-scatter; the meter helper; one stats format for meter and metrics."""

from __future__ import annotations

import inspect

import pytest

from qsdp.comm.all_gather import DifferenceAllGather, PlainAllGather, QuantizedAllGather
from qsdp.comm.base import AllGather, CommBase, ReduceScatter
from qsdp.comm.hsdp import HsdpReduceScatter
from qsdp.comm.meter import ByteMeter
from qsdp.comm.reduce_scatter import PlainReduceScatter, QuantizedReduceScatter
from qsdp.comm.topology import Topology
from qsdp.config import resolve_config
from qsdp.train.metrics import WireTotals

FSDP_API = "torch.distributed.fsdp._fully_shard._fsdp_api"


def test_the_wrapped_interface_is_fsdp2s_own():
    assert (AllGather.__module__, AllGather.__name__) == (FSDP_API, "AllGather")
    assert (ReduceScatter.__module__, ReduceScatter.__name__) == (FSDP_API, "ReduceScatter")


@pytest.mark.parametrize("cls", [PlainAllGather, QuantizedAllGather, DifferenceAllGather])
def test_every_weight_gather_is_a_complete_fsdp2_all_gather(cls):
    assert issubclass(cls, AllGather) and not issubclass(cls, ReduceScatter)
    assert not inspect.isabstract(cls)


@pytest.mark.parametrize("cls", [PlainReduceScatter, QuantizedReduceScatter, HsdpReduceScatter])
def test_every_gradient_reduce_scatter_is_a_complete_fsdp2_reduce_scatter(cls):
    assert issubclass(cls, ReduceScatter) and not issubclass(cls, AllGather)
    assert not inspect.isabstract(cls)


def _comm(nodes: int, ranks_per_node: int) -> CommBase:
    # A topology needs no process group for its arithmetic: the meter only reads the counts.
    topology = Topology.contiguous(nodes, ranks_per_node)
    comm = CommBase(resolve_config("sdp4bit"), topology, comm_id=0)
    comm.bind_meter(ByteMeter())
    return comm


def test_meter_counts_one_buffer_once_per_peer_inside_and_between_nodes():
    comm = _comm(nodes=3, ranks_per_node=2)  # 1 peer in the node, 4 in other nodes
    comm.meter("weights", nbytes=10, elements=5)
    stats = comm.byte_meter.snapshot()["weights"]
    assert (stats["intra"]["bytes"], stats["intra"]["elements"]) == (10, 5)
    assert (stats["inter"]["bytes"], stats["inter"]["elements"]) == (40, 20)
    assert stats["total"]["bits_per_element"] == 16.0


def test_meter_sends_to_the_peers_given_instead_of_the_whole_topology():
    comm = _comm(nodes=3, ranks_per_node=2)
    comm.meter("grads", nbytes=8, elements=16, peers=(0, 2))
    stats = comm.byte_meter.snapshot()["grads"]
    assert stats["intra"]["bytes"] == 0
    assert (stats["inter"]["bytes"], stats["inter"]["elements"]) == (16, 32)


def test_a_child_meter_passes_every_record_to_its_parent_and_resets_alone():
    parent = ByteMeter()
    child = ByteMeter(parent=parent)
    child.record("grads", "inter", 100, 50)
    parent.record("weights", "intra", 7, 7)  # another handle's traffic: not the child's
    assert child.snapshot(reset=True)["grads"]["inter"]["bytes"] == 100
    assert child.snapshot()["grads"]["inter"]["bytes"] == 0
    seen = parent.snapshot()
    assert (seen["grads"]["inter"]["bytes"], seen["weights"]["intra"]["bytes"]) == (100, 7)
    assert child.snapshot()["weights"]["intra"]["bytes"] == 0


def test_training_totals_use_the_meters_format():
    meter = ByteMeter()
    meter.record("weights", "inter", 300, 600)
    meter.record("grads", "intra", 64, 16)
    meter.record("control", "inter", 8, 0)
    snapshot = meter.snapshot()
    assert WireTotals(snapshot).as_dict() == snapshot
