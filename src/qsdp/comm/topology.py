"""Nodes and ranks: the intra-node and inter-node subgroups of a process group.

Ranks of the group are laid out node-major: group rank ``r`` is local rank ``r % M`` of node
``r // M`` (``M`` ranks per node, as torchrun numbers them). The intra-node group of a rank holds
the ``M`` ranks of its node; its inter-node group holds the ``D`` ranks, one per node, with the
same local rank.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ConfigError


def local_world_size_from_env(world_size: int) -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return world_size
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"LOCAL_WORLD_SIZE={value!r} is not an integer") from None


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The collective timeout ``group`` was created with (``None`` where this torch does not
    say). Subgroups must be given it explicitly: ``new_group`` and ``new_subgroups_*`` default
    to the backend's own timeout (30 minutes on gloo), not the one the default group was
    initialised with, so a stalled peer in a subgroup would hang for half an hour."""
    device = torch.device("cuda" if "nccl" in str(dist.get_backend(group)).lower() else "cpu")
    try:
        # Private: ProcessGroup exposes set_timeout but no getter. Read here alone, tested in
        # tests/test_reliability_comm.py.
        return group._get_backend(device).options._timeout  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None


@dataclass
class Topology:
    """Where this rank sits: ``world_size = nodes * ranks_per_node``."""

    group: dist.ProcessGroup
    world_size: int
    rank: int
    ranks_per_node: int
    intra_group: dist.ProcessGroup | None
    inter_group: dist.ProcessGroup | None

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def same_node(self, other_rank: int) -> bool:
        return other_rank // self.ranks_per_node == self.node

    def peers(self) -> tuple[int, int]:
        """How many other ranks of the group are in this node and in other nodes."""
        return self.ranks_per_node - 1, self.world_size - self.ranks_per_node


_CACHE: dict[tuple, Topology] = {}


def build_topology(group: dist.ProcessGroup | None = None, ranks_per_node: int | None = None) -> Topology:
    """The topology of ``group`` (default: the world). Collective: every rank of the world calls
    it in the same order (it creates subgroups), once per distinct (group, ranks_per_node)."""
    group = group or dist.group.WORLD
    world_size = dist.get_world_size(group)
    if ranks_per_node is None:
        ranks_per_node = local_world_size_from_env(world_size)
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ConfigError(
            f"local_world_size={ranks_per_node} must divide the world size {world_size} "
            "(ranks per node x nodes)"
        )
    global_ranks = dist.get_process_group_ranks(group)
    key = (tuple(global_ranks), ranks_per_node)
    if key in _CACHE:
        return _CACHE[key]
    m = ranks_per_node
    d = world_size // m
    intra = inter = None
    if m > 1 and d > 1:
        timeout = group_timeout(group)
        intra, _ = dist.new_subgroups_by_enumeration(
            [global_ranks[n * m : (n + 1) * m] for n in range(d)], timeout=timeout
        )
        inter, _ = dist.new_subgroups_by_enumeration(
            [[global_ranks[n * m + lr] for n in range(d)] for lr in range(m)], timeout=timeout
        )
    topo = Topology(group, world_size, dist.get_rank(group), m, intra, inter)
    _CACHE[key] = topo
    return topo
