"""One rank of a ``D x M`` world trained in one process: FSDP2 with qsdp's own comm objects.

A rank's step is FSDP2's (gathers before forward and again before backward, copies into and out
of the gathered buffers, the reduce-scatters in fp32, on FSDP2's own streams) and qsdp's comm
objects, attached by :func:`qsdp.quantize_comms` as a training job attaches them
(:class:`~qsdp.comm.reduce_scatter.QuantizedReduceScatter`,
:class:`~qsdp.comm.all_gather.QuantizedAllGather`, :class:`~qsdp.comm.all_gather.DifferenceAllGather`
and the fsdp preset's plain ones). Only the peers are missing: the process group is the launch
census's one-process backend (:class:`qsdp.bench.census.CensusGroup`), whose collectives deliver
this rank's own send buffer as every peer's. The bytes differ from a real world's, the work of
the rank does not, and the collective itself is one device copy, far shorter than a transfer.

:func:`one_process_world` makes that world (``torch.distributed``'s default group, on the CPU or
on one CUDA device); :func:`ranged_comms` names each call of a comm object in the profiler
(``qsdp.comm.<class>``), and the emulated wire inside it is named ``qsdp.wire``, so a profile
tells qsdp's work (:mod:`qsdp.bench.codec_share`) from the collectives' and from the model's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..comm.rank_alone import CompletedWork
from .census import CensusGroup

__all__ = ["BACKEND", "COMM_RANGE", "WIRE_RANGE", "StepGroup", "one_process_world", "in_one_process_world", "ranged_comms"]

BACKEND = "qsdp-one-rank"
COMM_RANGE = "qsdp.comm"
WIRE_RANGE = "qsdp.wire"


class StepGroup(CensusGroup):
    """The census's group with what FSDP2 and :func:`qsdp.quantize_comms` ask of a group
    besides the collectives the comm objects make: a name (a device mesh is made from the group),
    the list all-gather of ``all_gather_object`` (the config's agreement) and a broadcast. While
    :attr:`ranged` is set, each collective runs inside a :data:`WIRE_RANGE` profiler range."""

    ranged = False

    @property
    def group_name(self) -> str:
        return dist.distributed_c10d._world.pg_names[self]

    @contextlib.contextmanager
    def _wire(self, name: str, *sent: torch.Tensor) -> Iterator[None]:
        with super()._wire(name, *sent):
            if StepGroup.ranged:
                with record_function(WIRE_RANGE):
                    yield
            else:
                yield

    def allgather(self, output_lists, inputs, opts=None):
        with self._wire("all_gather", inputs[0]):
            for outputs, sent in zip(output_lists, inputs):
                for out in outputs:
                    out.copy_(sent)
        return CompletedWork([out for outputs in output_lists for out in outputs])

    def broadcast(self, tensors, opts=None):
        return CompletedWork(tensors)

    def getBackendName(self) -> str:
        return BACKEND


def _make_group(store, rank, size, timeout) -> StepGroup:
    return StepGroup(rank, size)


@contextlib.contextmanager
def one_process_world(nodes: int, ranks_per_node: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """This process as rank ``rank`` of a world of ``nodes * ranks_per_node`` on the
    :class:`StepGroup` backend (CPU or CUDA tensors), the default process group until the
    context ends. The nodes are not the group's: :func:`qsdp.quantize_comms` is told them with
    ``local_world_size=ranks_per_node``."""
    if dist.is_initialized():
        raise RuntimeError("the one-process world needs a process without a default process group")
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _make_group, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=nodes * ranks_per_node)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def in_one_process_world() -> bool:
    """Whether the default process group is a :func:`one_process_world`'s."""
    return dist.is_initialized() and isinstance(dist.group.WORLD, StepGroup)


class _Ranged:
    """A comm object as FSDP2 calls it (``allocate``, then the call), each call inside a
    ``qsdp.comm.<class>`` profiler range; everything else is the comm's own."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.range = f"{COMM_RANGE}.{type(comm).__name__}"

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.comm.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with record_function(self.range):
            return self.comm(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)


@contextlib.contextmanager
def ranged_comms(handle: Any) -> Iterator[None]:
    """Within it, FSDP2 calls each comm object of ``handle`` (what :func:`qsdp.quantize_comms`
    returned) inside a ``qsdp.comm.<class>`` range and each collective of the world inside a
    :data:`WIRE_RANGE` range; the comm objects are FSDP2's again after."""
    for module, ag, rs in zip(handle.modules, handle.all_gathers, handle.reduce_scatters):
        module.set_custom_all_gather(_Ranged(ag))
        module.set_custom_reduce_scatter(_Ranged(rs))
    StepGroup.ranged = True
    try:
        yield
    finally:
        StepGroup.ranged = False
        for module, ag, rs in zip(handle.modules, handle.all_gathers, handle.reduce_scatters):
            module.set_custom_all_gather(ag)
            module.set_custom_reduce_scatter(rs)
