"""The torch collectives qsdp calls.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; torch 2.11 may lack the new names. One place
picks whichever exists (:func:`all_gather_flat`, :func:`reduce_scatter_flat`: FSDP2's own calls).

A quantized collective's steady call goes to the process group itself (:func:`all_to_all`,
:func:`all_gather`, :func:`all_reduce`): ``torch.distributed``'s Python wrappers check, log and
build options on every call (about 8 us of host time each on a CPU host, beside 4 us for the
group's own call), for arguments a plan checked once: contiguous tensors of one dtype on a group
this rank is in. The same collective runs, with the same options.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def all_gather_flat(output: torch.Tensor, input_tensor: torch.Tensor, group) -> None:
    """Every rank's ``input_tensor`` concatenated into ``output`` (rank order)."""
    fn = getattr(dist, "all_gather_single", None)
    if fn is not None:
        fn(output, input_tensor, group=group)
    else:
        dist.all_gather_into_tensor(output, input_tensor, group=group)


def reduce_scatter_flat(output: torch.Tensor, input_tensor: torch.Tensor, op, group) -> None:
    """Chunk ``r`` of ``input_tensor`` reduced over ranks into rank ``r``'s ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None)
    if fn is not None:
        fn(output=output, input=input_tensor, op=op, group=group)
    else:
        dist.reduce_scatter_tensor(output, input_tensor, op=op, group=group)


def _name(*names: str) -> str:
    """The first of ``names`` a process group has: the method torch.distributed calls."""
    for name in names:
        if hasattr(dist.ProcessGroup, name):
            return name
    raise ImportError(f"torch.distributed.ProcessGroup has none of {names}")


_ALL_TO_ALL = _name("all_to_all_single", "alltoall_base")
_ALL_GATHER = _name("all_gather_single", "_allgather_base")
_ALL_GATHER_COALESCED = _name("allgather_into_tensor_coalesced")
_ALLREDUCE = _name("allreduce")
# The method of each group class (a Python subclass may override it), looked up once a class:
# on the class, not the instance, whose lookup costs more.
_METHODS: dict[tuple[type, str], Any] = {}


def _method(group, name: str):
    key = (type(group), name)
    fn = _METHODS.get(key)
    if fn is None:
        fn = _METHODS[key] = getattr(type(group), name)
    return fn


def _options(cls, async_op: bool, **fields):
    opts = cls()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = async_op
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


# What torch.distributed builds for every call, built once (the group copies what it reads).
_A2A_OPTS = (_options(c10d.AllToAllOptions, False), _options(c10d.AllToAllOptions, True))
_AG_OPTS = (_options(c10d.AllgatherOptions, False), _options(c10d.AllgatherOptions, True))
_AR_OPTS: dict[Any, Any] = {}  # by reduce op (a ReduceOp.RedOpType), made at its first use


def all_to_all(output: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
    """``dist.all_to_all_single(output, input_tensor, group=group, async_op=async_op)`` (equal
    splits), called on the group itself; the work handle where ``async_op``."""
    work = _method(group, _ALL_TO_ALL)(group, output, input_tensor, [], [], _A2A_OPTS[async_op])
    if async_op:
        return work
    work.wait()
    return None


def all_gather(output: torch.Tensor, input_tensor: torch.Tensor, group) -> None:
    """:func:`all_gather_flat`, called on the group itself."""
    _method(group, _ALL_GATHER)(group, output, input_tensor, _AG_OPTS[False]).wait()


def backend_of(backend: str, device_type: str) -> str:
    """The backend (lower case) a group of ``backend`` (``dist.get_backend``) runs for tensors
    on ``device_type``: ``"cpu:gloo,cuda:nccl"`` names one per device."""
    name = backend.lower()
    for part in name.split(","):
        dev, sep, value = part.partition(":")
        if sep and dev.strip() == device_type:
            name = value
    return name.strip()


def gathers_grouped(group, device_type: str) -> bool:
    """Whether :func:`all_gather_coalesced` on ``group`` gathers tensors on ``device_type``
    straight into its outputs: on NCCL (one NCCL group), and on a process group written in
    Python that implements it itself; not on gloo, which runs a grouped gather through flat copies
    of its inputs and outputs, and of CPU tensors only, nor on a backend that may lack it (MPI)."""
    if backend_of(str(dist.get_backend(group)), device_type) == "nccl":
        return True
    return getattr(type(group), _ALL_GATHER_COALESCED) is not getattr(dist.ProcessGroup, _ALL_GATHER_COALESCED)


def all_gather_coalesced(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group) -> None:
    """Each of ``inputs`` gathered from every rank into the output of the same index (as
    :func:`all_gather`), in one grouped collective: one NCCL group, one call of the group."""
    _method(group, _ALL_GATHER_COALESCED)(group, outputs, inputs, _AG_OPTS[False]).wait()


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """``dist.all_reduce(tensor, op=op, group=group)`` (``op`` one of ``ReduceOp``'s values, not a
    premultiplied sum), called on the group itself."""
    opts = _AR_OPTS.get(op)
    if opts is None:
        opts = _AR_OPTS[op] = _options(c10d.AllreduceOptions, False, reduceOp=op)
    _method(group, _ALLREDUCE)(group, [tensor], opts).wait()
