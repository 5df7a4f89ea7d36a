"""Nodes and ranks: where every rank of a process group really is, and its intra-node and
inter-node subgroups.

A rank's node is the machine it runs on, whatever launched it:

1. ``local_world_size`` (the config's, or ``ranks_per_node`` here), when given, emulates nodes
   on one machine: global rank ``r`` is on node ``r // local_world_size``;
2. else the environment variable ``QSDP_NODE`` names this process's node (one machine emulating
   several nodes says so this way: each emulated node's agent sets its own name);
3. else Slurm's ``SLURMD_NODENAME`` (the name of the Slurm node the task runs on) where it is
   set. Not ``SLURM_NODEID``: it counts the nodes of one job step, so ranks started by separate
   ``srun`` steps on different machines would all say node 0;
4. else the host name. A name many machines share (:data:`SHARED_HOST_NAMES`: ``localhost``
   and the like, which containers from one image often carry) gets this machine's identity
   appended: the kernel's boot id (the same in every container of one machine, different on
   every machine), else ``/etc/machine-id``.

The number of torchrun agents per host does not matter (``srun --ntasks-per-node 8 torchrun
--nproc-per-node 1`` puts 8 ranks on one node). When every node came from the hosts and the
ranks per node found differ from what the launcher states (``LOCAL_WORLD_SIZE``,
``SLURM_NTASKS_PER_NODE``), rank 0 warns once, naming both. Where every node found holds one
rank while this process sees several CUDA devices and the launcher does not say otherwise (one
container a GPU, each with a host name of its own, looks like one node a GPU), rank 0 warns
once too.

Start-up: the ranks of a group exchange one fixed-size record each (:data:`RECORD_BYTES`: the
node name and the number of process groups the rank holds) with one all-gather over that group
alone; each rank derives the group's layout locally. Within a group of ``D`` nodes holding
``M`` of its ranks each, the intra-node group of a rank holds the ``M`` ranks of its node, and
its inter-node group the ``D`` ranks (one per node) with the same local index. A rank creates
only its own two subgroups, intra-node first, with ``new_group(use_local_synchronization=True)``,
so only their members take part (pipeline stages whose ranks hold different groups need no
world-wide step). Where the world is bound to a device (``init_process_group(device_id=...)``),
NCCL creates subgroups by splitting the world's communicator, which every rank must join: there
the ranks exchange their groups over the world and every rank creates every subgroup, as
before.

Subgroups belong to the world that created them: they are keyed by the world's process group
and counted per user (:func:`build_topologies` adds one, :func:`release` drops one and pools
the subgroups no user holds for the next topology of the same ranks); ``destroy_process_group()``
destroys them with the world, and the next world starts with none, so a process may destroy and
re-initialise its world any number of times.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import socket
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..config import ConfigError
from .collectives import all_gather_flat

NODE_ENV = "QSDP_NODE"
NAME_BYTES = 64  # a longer node name travels as its SHA-1 (host names are at most 64 bytes)
RECORD_BYTES = NAME_BYTES + 8  # the name, then one int64: process groups held * 2 + explicit
LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")
# Host names that say nothing about the machine: the loopback names, which a container image
# may keep as its host name on every machine it runs on.
SHARED_HOST_NAMES = frozenset({"", "localhost", "localhost.localdomain", "localhost4", "localhost6",
                               "ip6-localhost", "ip6-loopback"})
# What differs between machines, first found wins: the boot id is the kernel's (every container
# of one machine reads the same), machine-id is the installation's (an image may carry one).
MACHINE_ID_FILES = ("/proc/sys/kernel/random/boot_id", "/etc/machine-id", "/var/lib/dbus/machine-id")


def machine_id() -> str | None:
    """An identity of this machine that differs between machines (the first 12 hex digits of
    the first readable, non-empty file of :data:`MACHINE_ID_FILES`), or ``None``."""
    for path in MACHINE_ID_FILES:
        try:
            with open(path) as f:
                digits = re.sub(r"[^0-9a-f]", "", f.read().lower())
        except OSError:
            continue
        if digits:
            return digits[:12]
    return None


def node_name() -> str:
    """This process's node, as the ranks of a group compare it (see the module doc)."""
    explicit = os.environ.get(NODE_ENV)
    if explicit:
        return explicit
    slurm = os.environ.get("SLURMD_NODENAME")
    if slurm:
        return slurm
    host = socket.gethostname()
    if host.lower() in SHARED_HOST_NAMES:
        machine = machine_id()
        if machine is not None:
            return f"{host}@{machine}"
    return host


def stated_ranks_per_node() -> list[tuple[str, int]]:
    """What the launcher says the ranks per node are: ``(variable, value)`` for each of
    ``LOCAL_WORLD_SIZE`` (torchrun: the ranks of this agent) and ``SLURM_NTASKS_PER_NODE``
    that is set (Slurm's ``8(x2)`` form reads as 8)."""
    said = []
    for var in LAUNCHER_VARS:
        m = re.match(r"\d+", os.environ.get(var, ""))
        if m and int(m.group()) > 0:
            said.append((var, int(m.group())))
    return said


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The collective timeout ``group`` was created with (``None`` where this torch does not
    say). Subgroups must be given it explicitly: ``new_group`` and ``new_subgroups_*`` default
    to the backend's own timeout (30 minutes on gloo), not the one the default group was
    initialised with, so a stalled peer in a subgroup would hang for half an hour."""
    try:
        # Private: ProcessGroup exposes set_timeout but no getter. Read here alone, tested in
        # tests/test_reliability_comm.py.
        return group._get_backend(_device(group)).options._timeout  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None


def _device(group: dist.ProcessGroup) -> torch.device:
    return torch.device("cuda" if "nccl" in str(dist.get_backend(group)).lower() else "cpu")


@dataclass
class Topology:
    """Where the ranks of ``group`` sit: ``world_size = nodes * ranks_per_node``.

    ``node_of[p]``: the node (0..nodes-1, numbered by first appearance) of group rank ``p``.
    ``intra_ranks[d]``: the group ranks on node ``d``, in the order of their intra-node group.
    ``inter_ranks[j]``: the group ranks with local index ``j`` (one per node), in the order of
    their inter-node group. ``intra_group``/``inter_group``: this rank's two subgroups (``None``
    where one node or one rank per node leaves a single level, or where none were asked for).
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
    _users: int = field(default=0, repr=False)
    _key: Any = field(default=None, repr=False)
    _subgroup_keys: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

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
        contiguous numbering over a 1-D group): node ``d``'s subgroup is the ranks ``d * M ..
        d * M + M - 1`` in order, and local index ``j``'s the ranks ``j, M + j, ...``."""
        m, nodes = self.ranks_per_node, self.nodes
        return (all(self.intra_ranks[d] == tuple(d * m + j for j in range(m)) for d in range(nodes))
                and all(self.inter_ranks[j] == tuple(d * m + j for d in range(nodes)) for j in range(m)))

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
        here = len(self.intra_ranks[self.node])
        return here - 1, self.world_size - here

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


class _Record(NamedTuple):
    """What one rank told its group at start-up."""

    name: str
    held: int  # process groups it held
    explicit: bool  # its node was named (QSDP_NODE), not found


@dataclass
class _Subgroup:
    group: dist.ProcessGroup
    users: int = 0


class _WorldState:
    """What this process built in one world (one ``init_process_group``)."""

    def __init__(self, world: dist.ProcessGroup) -> None:
        # Held, not just its id: a later world's group can never be taken for this one.
        self.world = world
        self.subgroups: dict[tuple[int, ...], _Subgroup] = {}
        self.world_made: dict[tuple[int, ...], Any] = {}  # subgroups every rank created (bound worlds)
        self.topologies: dict[Any, Topology] = {}
        self.sent_bytes = 0
        self.warned = False


_STATE: _WorldState | None = None


def _state() -> _WorldState:
    """This world's state; a world other than the one it was built in starts afresh (torch has
    no destroy callback: ``destroy_process_group()`` already destroyed every subgroup the old
    world held, so there is nothing to release)."""
    global _STATE
    world = dist.group.WORLD
    if _STATE is None or _STATE.world is not world:
        _STATE = _WorldState(world)
    return _STATE


def setup_bytes_sent() -> int:
    """The bytes this rank has sent in its start-up exchanges in the current world."""
    return _state().sent_bytes


def _held_groups() -> int:
    """How many process groups this process holds. torch (2.13) names a subgroup that only its
    members create by its ranks and this number, so the members must hold equally many."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return len(getattr(world, "pg_names", ()) or ())


def _encode(name: str, held: int, explicit: bool) -> torch.Tensor:
    raw = name.encode()
    if len(raw) > NAME_BYTES:
        raw = ("sha1:" + hashlib.sha1(raw).hexdigest()).encode()
    record = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    record[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    record[NAME_BYTES:] = torch.tensor([held * 2 + int(explicit)], dtype=torch.int64).view(torch.uint8)
    return record


def _decode(row: torch.Tensor) -> _Record:
    name = bytes(row[:NAME_BYTES].tolist()).rstrip(b"\0").decode(errors="replace")
    word = int(row[NAME_BYTES:].clone().view(torch.int64)[0])
    return _Record(name, word // 2, bool(word % 2))


def _exchange(group: dist.ProcessGroup, st: _WorldState) -> list[_Record]:
    """Every rank's record, in group rank order: one all-gather of :data:`RECORD_BYTES` bytes
    a rank over ``group``."""
    device = _device(group)
    send = _encode(node_name(), _held_groups(), bool(os.environ.get(NODE_ENV))).to(device)
    size = dist.get_world_size(group)
    out = torch.empty(size * RECORD_BYTES, dtype=torch.uint8, device=device)
    all_gather_flat(out, send, group)
    st.sent_bytes += send.numel() * send.element_size()
    rows = out.view(size, RECORD_BYTES).cpu()
    return [_decode(rows[p]) for p in range(size)]


def _node_indices(names: Sequence[str]) -> tuple[int, ...]:
    first: dict[str, int] = {}
    return tuple(first.setdefault(n, len(first)) for n in names)


def _layout(global_ranks: tuple[int, ...], names: Sequence[str], what: str, even: bool = True
            ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """``(node_of, intra_ranks, inter_ranks)`` of the group of ``global_ranks`` (group rank
    order) given each of its ranks' node ``names``. ``even``: raise :class:`ConfigError` naming
    the nodes when they hold unequal numbers of the group's ranks; else such a group has no
    ``inter_ranks``."""
    node_of = _node_indices(names)
    members: list[list[int]] = [[] for _ in range(max(node_of) + 1)]
    for p, d in enumerate(node_of):
        members[d].append(p)
    counts = [len(m) for m in members]
    by_global = lambda ps: tuple(sorted(ps, key=lambda p: global_ranks[p]))  # noqa: E731
    if len(set(counts)) > 1 and not even:
        return node_of, tuple(by_global(m) for m in members), ()
    if len(set(counts)) > 1:
        where = ", ".join(f"node {names[m[0]]}: {len(m)}" for m in members)
        raise ConfigError(
            f"the {what} (global ranks {list(global_ranks)}) has unequal numbers of ranks per node ({where}); "
            "qsdp needs the same number on every node: launch the same number of ranks per node, or emulate "
            "nodes with overrides={'local_world_size': M}"
        )
    # new_group orders a subgroup by global rank: so do these lists, so a rank's place in a list is
    # its rank in the subgroup.
    intra = tuple(by_global(m) for m in members)
    m = counts[0]
    inter = tuple(by_global([intra[d][j] for d in range(len(intra))]) for j in range(m))
    return node_of, intra, inter


def _warn_if_launcher_disagrees(st: _WorldState, ranks: tuple[int, ...], records: list[_Record],
                                per_node: int, nodes: int) -> None:
    """Rank 0, once a world: the hosts' ranks per node against what the launcher states."""
    if st.warned or dist.get_rank() != 0 or len(ranks) != dist.get_world_size() or any(r.explicit for r in records):
        return
    st.warned = True
    said = [f"{var}={value}" for var, value in stated_ranks_per_node() if value != per_node]
    if said:
        warnings.warn(
            f"qsdp: the hosts hold {per_node} rank(s) on each of {nodes} node(s) (SLURMD_NODENAME or the host name), "
            f"but the launcher states {' and '.join(said)}: qsdp follows the hosts; to emulate nodes on one host, "
            "set QSDP_NODE for each emulated node or pass overrides={'local_world_size': M}", stacklevel=4)
        return
    message = one_rank_nodes_warning(per_node, nodes, _cuda_devices())
    if message is not None:
        warnings.warn(message, stacklevel=4)


def _cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without CUDA). torch counts them through NVML
    where it can, without creating a CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def one_rank_nodes_warning(per_node: int, nodes: int, devices: int) -> str | None:
    """The warning for nodes found to hold one rank each while a rank sees ``devices`` CUDA
    devices (more than one: likely one container a GPU, each with a host name of its own, on
    machines that hold several ranks), or ``None``."""
    if per_node != 1 or nodes < 2 or devices < 2:
        return None
    return (f"qsdp: every one of the {nodes} nodes found holds one rank, but this rank sees {devices} CUDA devices: "
            "if several ranks share a machine (one container a GPU gives each its own host name), qsdp sees no "
            "intra-node level; set QSDP_NODE to the machine's name in each container, or pass "
            "overrides={'local_world_size': M}")


def _check_held(records: list[_Record], ranks: tuple[int, ...], intra, inter, what: str) -> None:
    """Raise on every rank of the group, before any subgroup is created, if the members of one
    of its subgroups hold different numbers of process groups (they would name it differently
    and wait for each other until the timeout)."""
    for sub in (*intra, *inter):
        held = {records[p].held for p in sub}
        if len(held) > 1:
            detail = ", ".join(f"rank {ranks[p]}: {records[p].held}" for p in sub)
            raise ConfigError(
                f"the ranks of the {what} hold different numbers of process groups ({detail}): torch names a "
                "subgroup that only its members create by its ranks and that number, so qsdp's node subgroups "
                f"would not meet; create the same process groups on every rank of the {what} before quantize_comms")


def _own_subgroup(st: _WorldState, ranks: tuple[int, ...], timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    """The subgroup of ``ranks`` (this rank among them), created by its members alone."""
    sub = st.subgroups.get(ranks)
    if sub is None:
        kwargs = {} if timeout is None else {"timeout": timeout}
        sub = st.subgroups[ranks] = _Subgroup(dist.new_group(list(ranks), use_local_synchronization=True, **kwargs))
    sub.users += 1
    return sub.group


def _world_subgroups(st: _WorldState, mine: tuple[tuple[int, ...], ...],
                     timeout: datetime.timedelta | None) -> list[dist.ProcessGroup]:
    """``mine``'s subgroups in a world bound to a device, where NCCL splits the world's
    communicator for every new group and so every rank must create every subgroup: the ranks
    exchange the subgroups they need over the world, and create the new ones in one order.
    They stay until the world is destroyed."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    st.sent_bytes += 8 * sum(len(r) for r in mine)
    kwargs = {} if timeout is None else {"timeout": timeout}
    for ranks in sorted({r for theirs in everyone for r in theirs}):
        if ranks not in st.world_made:
            st.world_made[ranks] = dist.new_group(list(ranks), **kwargs)
    return [st.world_made[r] for r in mine]


def build_topologies(groups: Sequence[dist.ProcessGroup | None], local_world_size: int | None = None,
                     what: str = "FSDP group", subgroups: bool | Sequence[bool] = True,
                     even: bool | Sequence[bool] = True) -> list[Topology]:
    """The topology of each of ``groups`` (``None``: the world) on this rank.

    Collective over each group in turn: every rank of a group calls it with that group, the
    groups in one order (a rank of a dp x tp mesh passes its own dp group). Each group's ranks
    exchange :data:`RECORD_BYTES` bytes each; the layout is derived locally. ``subgroups``
    (one flag, or one per group): whether to create the intra- and inter-node subgroups of this
    rank (only the two-level collectives use them); ``even`` (likewise): whether the group must hold
    the same number of ranks on every node (subgroups need it). ``local_world_size`` emulates nodes (see the
    module doc). Every returned topology counts one user until :func:`release`. Raises
    :class:`ConfigError` on every rank of a group for a bad layout."""
    world = dist.get_world_size()
    lws = local_world_size
    if lws is not None and (lws < 1 or world % lws):
        raise ConfigError(f"local_world_size={lws} must divide the world size {world} (ranks per node x nodes)")
    st = _state()
    flags = [subgroups] * len(groups) if isinstance(subgroups, bool) else list(subgroups)
    evens = [even] * len(groups) if isinstance(even, bool) else list(even)
    timeout = group_timeout(dist.group.WORLD)
    bound = getattr(dist.group.WORLD, "bound_device_id", None) is not None
    out = []
    for group, make, need_even in zip(groups, flags, evens):
        group = group or dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group))
        records = _exchange(group, st)
        names = [str(g // lws) for g in ranks] if lws else [r.name for r in records]
        node_of, intra, inter = _layout(ranks, names, what, need_even or make)
        if lws is None and inter:
            _warn_if_launcher_disagrees(st, ranks, records, len(intra[0]), len(intra))
        key = (group, lws, tuple(names), make, need_even)
        topo = st.topologies.get(key)
        if topo is None:
            topo = Topology(group, len(ranks), dist.get_rank(group), node_of, intra, inter, _key=key)
            if make and topo.nodes > 1 and topo.ranks_per_node > 1:
                mine = (tuple(ranks[p] for p in intra[topo.node]), tuple(ranks[p] for p in inter[topo.local_rank]))
                if bound:
                    topo.intra_group, topo.inter_group = _world_subgroups(st, mine, timeout)
                else:
                    if any(r not in st.subgroups for r in mine):
                        _check_held(records, ranks, intra, inter, what)
                    # Intra-node first on every member: each then holds as many groups as its peers.
                    topo.intra_group, topo.inter_group = (_own_subgroup(st, r, timeout) for r in mine)
                    topo._subgroup_keys = mine
            st.topologies[key] = topo
        topo._users += 1
        out.append(topo)
    return out


def build_topology(group: dist.ProcessGroup | None = None, ranks_per_node: int | None = None) -> Topology:
    """The topology of ``group`` (default: the world); ``ranks_per_node`` emulates nodes of that
    many consecutive global ranks. Collective over ``group`` (:func:`build_topologies`)."""
    return build_topologies([group], ranks_per_node)[0]


def release(topology: Topology) -> None:
    """Drop one user of ``topology`` (one that :func:`build_topologies` returned). Once none is
    left, its subgroups go back to this world's pool, where the next topology that needs the
    same ranks takes them instead of creating new ones; the pool goes with the world
    (``destroy_process_group()``). Not destroyed sooner: torch names a subgroup created by its
    members alone after its ranks and the number of groups they hold, so a destroyed subgroup
    made again would get the old name, and its members would meet the old one's addresses in
    the store. Local, no collective; nothing to do for a topology of a world already gone."""
    st = _STATE
    if st is None or not dist.is_initialized() or st.world is not dist.group.WORLD or topology._key is None:
        return
    if st.topologies.get(topology._key) is not topology or topology._users <= 0:
        return
    topology._users -= 1
    if topology._users:
        return
    del st.topologies[topology._key]
    for ranks in topology._subgroup_keys:
        sub = st.subgroups.get(ranks)
        if sub is not None:
            sub.users -= 1


def pooled_subgroups() -> dict[tuple[int, ...], int]:
    """``{global ranks: users}`` of every subgroup this rank created in the current world (0
    users: pooled for reuse)."""
    return {ranks: sub.users for ranks, sub in _state().subgroups.items()}
