"""A process group of one rank that launches nothing: where FSDP2's native HSDP all-reduce is
routed once qsdp's own all-reduce across the replicas has taken its place.

A group made with ``dist.new_group([rank])`` would do the same arithmetic (a sum over one rank),
but on NCCL it is a communicator of its own on every rank, built at its first use, and one
collective kernel per FSDP group per step on FSDP2's all-reduce stream. This group is torch's
own ``ProcessGroup`` subclassed in Python, with no backend: its all-reduce leaves the tensor as
it is and returns work that is already complete, so nothing is launched, synced or allocated.
It belongs to no world: it survives a destroyed and re-made default group.

Each FSDP group of a native HSDP model gets a group of its own, made with ``on_all_reduce``: a
host-side callback that tells qsdp FSDP2's all-reduce did come here (and not over the real
replicate group), so that the all-reduce hook that must follow it can be checked for.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


class CompletedWork(dist.Work):
    """Work that completed when it was made (there was nothing to do, or it was done at once)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(self._tensors)
        return done


class RankAloneGroup(dist.ProcessGroup):
    """Rank 0 of a group of size 1. Only ``allreduce`` is provided: FSDP2 all-reduces with SUM
    or AVG, each of which over one rank is the tensor itself. torch refuses any other
    collective on it (the group is not registered in any world), naming the group.

    ``on_all_reduce``: called (on the host, before the work is returned) at every all-reduce;
    what it raises reaches the caller of the all-reduce."""

    def __init__(self, on_all_reduce: Callable[[], None] | None = None) -> None:
        super().__init__(0, 1)
        self.on_all_reduce = on_all_reduce

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        if self.on_all_reduce is not None:
            self.on_all_reduce()
        return CompletedWork(tensors)

    def getBackendName(self) -> str:
        return "qsdp-rank-alone"

    def __repr__(self) -> str:
        return "RankAloneGroup(rank=0, size=1)"


RANK_ALONE = RankAloneGroup()
