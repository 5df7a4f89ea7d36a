"""Nodes and ranks: where every rank of a process group really is, and its intra-node and
inter-node subgroups.

A rank's node comes from the machine, not from its position in the group:

1. ``local_world_size`` (the config's, or ``ranks_per_node`` here), when given, emulates nodes
   on one machine: global rank ``r`` is on node ``r // local_world_size``;
2. else the environment variable ``QSDP_NODE`` names this process's node (tests, emulated
   clusters, launchers whose hosts lie);
3. else the host name, split by torchrun's ``GROUP_RANK`` where it is set (each torchrun agent
   is one node, so two agents on one machine emulate two nodes).

The names are exchanged once per process with one ``all_gather_object`` over the world, so this
works under any launcher (torchrun with any ``--nnodes``, ``srun``, ``mpirun``) and any rank
order. Within a group of ``D`` nodes holding ``M`` of its ranks each, the intra-node group of a
rank holds the ``M`` ranks of its node, and its inter-node group the ``D`` ranks (one per node)
with the same local index. Every subgroup of every group is created by the same calls, in the
same order, on every rank of the world (``dist.new_group`` needs that).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from ..config import ConfigError

NODE_ENV = "QSDP_NODE"


def node_name() -> str:
    """This process's node, as the ranks of the world compare it (see the module doc)."""
    explicit = os.environ.get(NODE_ENV)
    if explicit:
        return explicit
    host = socket.gethostname()
    agent = os.environ.get("GROUP_RANK")
    return f"{host}/{agent}" if agent is not None and "TORCHELASTIC_RUN_ID" in os.environ else host


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
    """Where the ranks of ``group`` sit: ``world_size = nodes * ranks_per_node``.

    ``node_of[p]``: the node (0..nodes-1, numbered by first appearance) of group rank ``p``.
    ``intra_ranks[d]``: the group ranks on node ``d``, in the order of their intra-node group.
    ``inter_ranks[j]``: the group ranks with local index ``j`` (one per node), in the order of
    their inter-node group. ``intra_group``/``inter_group``: this rank's two subgroups (``None``
    where one node or one rank per node leaves a single level).
    """

    group: dist.ProcessGroup
    world_size: int
    rank: int
    node_of: tuple[int, ...]
    intra_ranks: tuple[tuple[int, ...], ...]
    inter_ranks: tuple[tuple[int, ...], ...]
    intra_group: dist.ProcessGroup | None = None
    inter_group: dist.ProcessGroup | None = None
    _index: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def nodes(self) -> int:
        return len(self.intra_ranks)

    @property
    def ranks_per_node(self) -> int:
        return len(self.intra_ranks[0])

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @property
    def local_rank(self) -> int:
        return self.intra_ranks[self.node].index(self.rank)

    @property
    def inter_position(self) -> int:
        """This rank's place among the ranks of its inter-node group (its row among theirs)."""
        return self.inter_ranks[self.local_rank].index(self.rank)

    @property
    def node_major(self) -> bool:
        """Whether group rank ``d * M + j`` is local index ``j`` of node ``d`` (torchrun's
        contiguous numbering over a 1-D group)."""
        m = self.ranks_per_node
        return all(self.inter_ranks[j] == tuple(d * m + j for d in range(self.nodes)) for j in range(m))

    @classmethod
    def contiguous(cls, nodes: int, ranks_per_node: int, rank: int = 0, group: dist.ProcessGroup | None = None
                   ) -> "Topology":
        """``nodes`` nodes of ``ranks_per_node`` consecutive ranks (torchrun's numbering over a
        1-D group), without subgroups: the layout's arithmetic alone, for models and tests."""
        m, d = ranks_per_node, nodes
        return cls(group, d * m, rank, tuple(r // m for r in range(d * m)),
                   tuple(tuple(n * m + j for j in range(m)) for n in range(d)),
                   tuple(tuple(n * m + j for n in range(d)) for j in range(m)))

    def same_node(self, other_rank: int) -> bool:
        return self.node_of[other_rank] == self.node

    def peers(self) -> tuple[int, int]:
        """How many other ranks of the group are in this node and in other nodes."""
        return self.ranks_per_node - 1, self.world_size - self.ranks_per_node

    def exchange_order(self) -> list[int]:
        """The group ranks in the order the two-level exchanges lay them out: local index
        major, then each local index's inter-node group order. Row ``k`` of a buffer in this
        order belongs to group rank ``exchange_order()[k]``; the block of local index ``j`` is
        what the intra-node peer ``j`` receives (the node-sharded replica rows it holds)."""
        return [p for ranks in self.inter_ranks for p in ranks]

    def exchange_index(self, device: torch.device) -> torch.Tensor:
        """:meth:`exchange_order` as an int64 index tensor on ``device`` (built once per device)."""
        key = str(device)
        if key not in self._index:
            self._index[key] = torch.tensor(self.exchange_order(), dtype=torch.int64, device=device)
        return self._index[key]


_CACHE: dict[tuple, Topology] = {}
_SUBGROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_NODES: dict[tuple, tuple[str, ...]] = {}  # every world rank's node name


def _world_key() -> tuple:
    return id(dist.group.WORLD), dist.get_world_size(), dist.get_rank()


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _node_indices(names: Sequence[str]) -> tuple[int, ...]:
    first: dict[str, int] = {}
    return tuple(first.setdefault(n, len(first)) for n in names)


def _layout(global_ranks: tuple[int, ...], world_nodes: tuple[str, ...], what: str
            ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """``(node_of, intra_ranks, inter_ranks)`` of the group of ``global_ranks`` (group rank
    order) given every world rank's node. Raises :class:`ConfigError` naming the nodes when they
    hold unequal numbers of the group's ranks."""
    node_of = _node_indices([world_nodes[g] for g in global_ranks])
    members: list[list[int]] = [[] for _ in range(max(node_of) + 1)]
    for p, d in enumerate(node_of):
        members[d].append(p)
    counts = [len(m) for m in members]
    if len(set(counts)) > 1:
        where = ", ".join(f"node {world_nodes[global_ranks[m[0]]]}: {len(m)}" for m in members)
        raise ConfigError(
            f"the {what} (global ranks {list(global_ranks)}) has unequal numbers of ranks per node ({where}); "
            "qsdp needs the same number on every node: launch the same number of ranks per node, or emulate "
            "nodes with overrides={'local_world_size': M}"
        )
    # new_group orders a subgroup by global rank: so do these lists, so a rank's place in a list is
    # its rank in the subgroup.
    by_global = lambda ps: tuple(sorted(ps, key=lambda p: global_ranks[p]))  # noqa: E731
    intra = tuple(by_global(m) for m in members)
    m = counts[0]
    inter = tuple(by_global([intra[d][j] for d in range(len(intra))]) for j in range(m))
    return node_of, intra, inter


def build_topologies(groups: Sequence[dist.ProcessGroup | None], local_world_size: int | None = None,
                     what: str = "FSDP group") -> list[Topology]:
    """The topology of each of ``groups`` (``None``: the world) on this rank.

    Collective over the world: every rank calls it, each with its own groups (a rank of a dp x tp
    mesh passes its own dp group); the ranks exchange their node names and groups once, and every
    rank creates the subgroups of every group in one order. ``local_world_size`` emulates nodes
    (see the module doc). Raises :class:`ConfigError` on every rank for a bad layout."""
    world = dist.get_world_size()
    mine = [_group_ranks(g) for g in groups]
    lws = local_world_size
    if lws is not None and (lws < 1 or world % lws):
        raise ConfigError(f"local_world_size={lws} must divide the world size {world} (ranks per node x nodes)")
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (None if lws else node_name(), mine))
    key = (*_world_key(), lws)
    if key not in _NODES:
        _NODES[key] = tuple(str(r // lws) for r in range(world)) if lws else tuple(e[0] for e in everyone)
    world_nodes = _NODES[key]
    every_group = sorted({ranks for _, theirs in everyone for ranks in theirs})
    layouts = {ranks: _layout(ranks, world_nodes, what) for ranks in every_group}
    timeout = group_timeout(dist.group.WORLD)
    for ranks in every_group:
        _, intra, inter = layouts[ranks]
        if len(intra) > 1 and len(inter) > 1:
            for sub in (*intra, *inter):
                subgroup = tuple(ranks[p] for p in sub)
                if subgroup not in _SUBGROUPS:  # the same on every rank: all made the same calls
                    _SUBGROUPS[subgroup] = dist.new_group(list(subgroup), timeout=timeout)
    out = []
    for group, ranks in zip(groups, mine):
        group = group or dist.group.WORLD
        cache_key = (*_world_key(), id(group), ranks, world_nodes)
        if cache_key not in _CACHE:
            node_of, intra, inter = layouts[ranks]
            topo = Topology(group, len(ranks), dist.get_rank(group), node_of, intra, inter)
            if topo.nodes > 1 and topo.ranks_per_node > 1:
                topo.intra_group = _SUBGROUPS[tuple(ranks[p] for p in intra[topo.node])]
                topo.inter_group = _SUBGROUPS[tuple(ranks[p] for p in inter[topo.local_rank])]
            _CACHE[cache_key] = topo
        out.append(_CACHE[cache_key])
    return out


def build_topology(group: dist.ProcessGroup | None = None, ranks_per_node: int | None = None) -> Topology:
    """The topology of ``group`` (default: the world); ``ranks_per_node`` emulates nodes of that
    many consecutive global ranks. Collective over the world (:func:`build_topologies`)."""
    return build_topologies([group], ranks_per_node)[0]
