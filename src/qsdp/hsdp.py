"""Setting up quantized HSDP: the two process groups, the checks of their layout, and the
replicas' initial weights.

Two ways, both quantizing the all-reduce across the replicas as the config's ``hsdp`` says.
FSDP2's native HSDP mesh (``D`` nodes x ``M`` ranks, torchrun numbering)::

    mesh = init_device_mesh("cuda", (D, M), mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)                   # 2-D: replicate, shard
    fully_shard(model, mesh=mesh)
    qsdp.quantize_comms(model, "sdp4bit")

(with tensor parallelism: ``fully_shard(mesh=mesh3d["dp_replicate", "dp_shard"])``). qsdp's
own recipe, 1-D FSDP2 inside the node and the replicas named (any rank placement: the groups
follow the hosts)::

    groups = qsdp.hsdp_groups()                         # a (replicate, shard) DeviceMesh
    for block in model.blocks:
        fully_shard(block, mesh=groups.shard_mesh)      # 1-D FSDP2 inside the node
    fully_shard(model, mesh=groups.shard_mesh)
    qsdp.quantize_comms(model, "sdp4bit", replicate_group=groups.replicate_group)

``group`` (the shard group) may be left out: it is then the group of the 1-D mesh the model's
parameters were sharded over, which ``fully_shard(mesh=...)`` already named.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._fsdp2 import has_custom_divide_factor, param_groups, route_replicate_all_reduce_to_hook
from ._fsdp2 import native_replicate_group as read_replicate_group
from .codecs.rng import derive_seed
from .comm.hsdp import HsdpReduceScatter, NativeHsdpReduceScatter, ReplicaAllReduce
from .comm.topology import Topology
from .config import ConfigError, QuantConfig, config_diff

RECIPE = (
    "shard inside the node with 1-D FSDP2 and name the replicas: groups = qsdp.hsdp_groups(); "
    "fully_shard(block, mesh=groups.shard_mesh) for every block and the root; "
    "qsdp.quantize_comms(model, preset, group=groups.shard_group, replicate_group=groups.replicate_group)"
)


@dataclass(frozen=True)
class HsdpGroups:
    """The 2-D ``(replicate, shard)`` mesh of an HSDP run and its two 1-D parts.

    ``shard_mesh`` (the ``M`` ranks of this node) is what ``fully_shard(mesh=...)`` takes;
    ``shard_group`` and ``replicate_group`` (the ``D`` ranks with this local rank) are what
    :func:`qsdp.quantize_comms` takes as ``group`` and ``replicate_group``. Row ``d`` of
    ``mesh`` holds the global ranks of node ``d``, whatever order the launcher numbered them in.
    """

    mesh: Any
    shard_mesh: Any
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup

    @property
    def nodes(self) -> int:
        return self.mesh.size(0)

    @property
    def ranks_per_node(self) -> int:
        return self.mesh.size(1)


def hsdp_groups(nodes: int | None = None, ranks_per_node: int | None = None,
                device_type: str | None = None) -> HsdpGroups:
    """Build the HSDP groups of the whole world, one shard group per node. Collective: every
    rank calls it.

    The nodes are those :mod:`qsdp.comm.topology` finds (``QSDP_NODE``, ``SLURMD_NODENAME`` or the
    host name), so a shard group never spans hosts, under any rank placement (``srun
    --distribution=cyclic`` puts ranks 0, 2 on one host and 1, 3 on the other). ``nodes``, when
    given, must match them, except on one machine, where it emulates ``nodes`` nodes of
    consecutive ranks. ``ranks_per_node`` emulates nodes of that many consecutive ranks
    (``qsdp train --local-world-size``). ``device_type``: ``cuda`` when CUDA is available, else
    ``cpu``."""
    from torch.distributed.device_mesh import DeviceMesh

    from .comm.topology import build_topologies, release

    for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"hsdp_groups: {name} must be an int or None, got {value!r}")
    world = dist.get_world_size()
    if nodes is not None and (nodes < 1 or world % nodes):
        raise ConfigError(f"nodes={nodes} must divide the world size {world}")
    if ranks_per_node is not None and (ranks_per_node < 1 or world % ranks_per_node):
        raise ConfigError(f"ranks_per_node={ranks_per_node} must divide the world size {world}")
    if nodes is not None and ranks_per_node is not None and nodes * ranks_per_node != world:
        raise ConfigError(f"nodes={nodes} x ranks_per_node={ranks_per_node} != world size {world}")
    emulated = ranks_per_node or (world // nodes if nodes else None)
    (found,) = build_topologies([None], None, what="world", subgroups=False)
    release(found)
    if ranks_per_node is None and found.nodes > 1:
        if nodes is not None and nodes != found.nodes:
            raise ConfigError(f"nodes={nodes}, but the hosts place the {world} ranks on {found.nodes} nodes of "
                              f"{found.ranks_per_node} (QSDP_NODE, SLURMD_NODENAME or the host name); leave nodes out")
        rows = [list(r) for r in found.intra_ranks]  # world ranks are group ranks here
    else:
        m = emulated or world
        rows = [list(range(d * m, (d + 1) * m)) for d in range(world // m)]
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = DeviceMesh(device_type, torch.tensor(rows, dtype=torch.int), mesh_dim_names=("replicate", "shard"))
    return HsdpGroups(mesh, mesh["shard"], mesh["shard"].get_group(), mesh["replicate"].get_group())


def quantizes_only_replicas(config: QuantConfig) -> bool:
    """Whether ``config`` quantizes nothing but the gradient all-reduce across HSDP replicas (the
    ``hsdp4`` / ``hsdp8`` variants): without a replicate group it would run as plain FSDP."""
    return config.hsdp.mode != "plain" and config.weights.mode == "plain" and config.grads.mode == "plain"


def require_replicate_group(config: QuantConfig) -> None:
    """Raise :class:`ConfigError` if :func:`quantizes_only_replicas`: called when
    ``quantize_comms`` was given no ``replicate_group``."""
    if quantizes_only_replicas(config):
        raise ConfigError(
            f"config {config.name!r} quantizes only the gradient all-reduce across HSDP replicas "
            f"(hsdp.mode={config.hsdp.mode!r}, weights and grads plain): without replicate_group= it "
            "would run as plain FSDP at full precision; pass replicate_group= (the ranks, one per node, "
            "holding this rank's shard): " + RECIPE + "; or shard on FSDP2's native HSDP mesh "
            "(fully_shard(mesh=<(replicate, shard) mesh>)), whose replicas qsdp reads"
        )


def layout_problem(group: dist.ProcessGroup, replicate_group: dist.ProcessGroup) -> str | None:
    """What is wrong with the two groups as this rank sees them (they must meet in this rank
    only), or ``None``; local, no collective."""
    me = dist.get_rank()
    shard = dist.get_process_group_ranks(group)
    replicas = dist.get_process_group_ranks(replicate_group)
    common = sorted(set(shard) & set(replicas))
    if common != [me]:
        return (f"the replicate group {replicas} and the shard group {shard} must share exactly this rank "
                f"({me}), but share {common}; " + RECIPE)
    return None


def check_same_layout(config: QuantConfig, group: dist.ProcessGroup, replicate_group: dist.ProcessGroup) -> None:
    """One collective over the world: every rank's config, groups and local layout problem.
    Raises the same :class:`ConfigError` on every rank if a rank's groups are wrong, if the
    configs differ, or if the ranks of a replicate group do not hold the same slot of equally
    sized shard groups."""
    mine = {"config": config.to_dict(), "shard": dist.get_process_group_ranks(group),
            "replicate": dist.get_process_group_ranks(replicate_group),
            "problem": layout_problem(group, replicate_group)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, json.dumps(mine, sort_keys=True))
    layouts = {r: json.loads(x) for r, x in enumerate(everyone)}
    for r, lay in layouts.items():
        if lay["problem"]:
            raise ConfigError(f"rank {r}: {lay['problem']}")
    for r, lay in layouts.items():
        if lay["config"] != mine["config"]:
            diffs = "; ".join(f"{k}: {a!r} != {b!r}" for k, a, b in config_diff(mine["config"], lay["config"]))
            raise ConfigError(f"qsdp config differs across ranks: rank {dist.get_rank()} vs rank {r}: {diffs}")
        slot, size = lay["shard"].index(r), len(lay["shard"])
        for q in lay["replicate"]:
            other = layouts[q]
            if other["replicate"] != lay["replicate"] or len(other["shard"]) != size or other["shard"].index(q) != slot:
                raise ConfigError(
                    f"inconsistent HSDP groups: rank {r} (shard group {lay['shard']}, replicate group "
                    f"{lay['replicate']}) and rank {q} (shard group {other['shard']}, replicate group "
                    f"{other['replicate']}) must have the same shard group size and position and the "
                    "same replicate group; " + RECIPE
                )


@torch.no_grad()
def broadcast_replicas(module: nn.Module, replicate_group: dist.ProcessGroup) -> bool:
    """Copy the first replica's parameter shards to every replica (the replicas then start from
    bit-identical weights, whatever each node's initialization). Returns ``False`` and does
    nothing if a parameter is still on the meta device: call it again once they are materialized."""
    from torch.distributed.tensor import DTensor

    params = list(module.parameters())
    if any(p.is_meta for p in params):
        return False
    src = dist.get_process_group_ranks(replicate_group)[0]
    for p in params:
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.numel():
            dist.broadcast(local, src=src, group=replicate_group)
    return True


def hsdp_reduce_scatter(
    module: nn.Module, rs_cls: type, config: QuantConfig, topology: Topology, comm_id: int,
    replicate_group: dist.ProcessGroup,
) -> HsdpReduceScatter:
    """FSDP2's reduce-scatter comm for one FSDP module under HSDP: ``rs_cls`` inside the node;
    the all-reduce across the replicas is set as the module's all-reduce hook, which FSDP2 runs
    after the reduce-scatter on its all-reduce stream (with one rank per shard group FSDP2 skips
    the reduce-scatter and runs the hook alone). It replaces any all-reduce hook set before."""
    # Each node rounds its intra-node sums with its own randomness, so that the replicas'
    # rounding errors are independent when they are summed.
    node_config = dataclasses.replace(config, seed=derive_seed(config.seed, replicate_group.rank()))
    rs = HsdpReduceScatter(rs_cls(node_config, topology, comm_id), ReplicaAllReduce(config, replicate_group, comm_id),
                           divide_replicas=not has_custom_divide_factor(module))
    module.set_all_reduce_hook(rs.hook)
    return rs


def prepare(module: nn.Module, config: QuantConfig, group: dist.ProcessGroup,
            replicate_group: dist.ProcessGroup) -> None:
    """Check the shard group ``group`` (the one FSDP2 shards over) and ``replicate_group``
    (locally, then across the world), and make the replicas' weights identical."""
    check_same_layout(config, group, replicate_group)
    broadcast_replicas(module, replicate_group)


def native_replicate_group(fsdp_modules: list[nn.Module]) -> dist.ProcessGroup | None:
    """The replicate group of a model sharded on FSDP2's native HSDP mesh (the first
    data-parallel dimension of ``fully_shard(mesh=<2-D mesh>)``), or ``None`` if no module was.
    Raises :class:`ConfigError` if the modules that own parameters disagree (some on a 1-D mesh,
    or replicate groups of different ranks); local, no collective."""
    found: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for m in fsdp_modules:
        if param_groups(m):
            group = read_replicate_group(m)
            found.setdefault(() if group is None else tuple(dist.get_process_group_ranks(group)), group)
    if len(found) > 1:
        seen = ", ".join(str(list(k)) if k else "none (a 1-D mesh)" for k in found)
        raise ConfigError(f"the FSDP modules are sharded on different data-parallel meshes (replicate groups: {seen}); "
                          "pass one mesh to every fully_shard call: the 2-D (replicate, shard) mesh for FSDP2's "
                          "native HSDP")
    return next(iter(found.values()), None)


def native_hsdp_reduce_scatter(
    module: nn.Module, rs_cls: type, config: QuantConfig, topology: Topology, comm_id: int,
    replicate_group: dist.ProcessGroup,
) -> NativeHsdpReduceScatter:
    """FSDP2's reduce-scatter comm for one FSDP module on FSDP2's native HSDP mesh: ``rs_cls``
    over the mesh's shard dimension; FSDP2's unquantized all-reduce across the replicas is
    replaced by the module's all-reduce hook, qsdp's (see :class:`NativeHsdpReduceScatter`,
    which raises at the first backward if that hook is replaced afterwards). It replaces any
    all-reduce hook set before."""
    # Each replica rounds its reduce-scatter with its own randomness, so that the replicas'
    # rounding errors are independent when they are summed.
    shard_config = dataclasses.replace(config, seed=derive_seed(config.seed, replicate_group.rank()))
    rs = NativeHsdpReduceScatter(rs_cls(shard_config, topology, comm_id),
                                 ReplicaAllReduce(config, replicate_group, comm_id),
                                 divide_replicas=not has_custom_divide_factor(module))
    route_replicate_all_reduce_to_hook(module, rs.rank_alone)
    module.set_all_reduce_hook(rs.hook)
    return rs


def check_shard_inside_nodes(config: QuantConfig, topology: Topology) -> str | None:
    """On FSDP2's native HSDP mesh, the shard dimension (``topology``) belongs inside a node and
    the replicas across nodes. A shard group spanning nodes: :class:`ConfigError` for a config
    that quantizes only the all-reduce across replicas (``hsdp4``, ``hsdp8``: its weights and
    gradients would cross nodes at full precision); for one that quantizes the shard group's
    traffic too, the warning to give (on rank 0); ``None`` when the layout fits or the config
    quantizes nothing."""
    if topology.nodes == 1:
        return None
    where = (f"the HSDP mesh's shard dimension ({topology.world_size} ranks) spans {topology.nodes} nodes; "
             "make it the ranks of one node (mesh shape (nodes, ranks per node)) so that only the all-reduce "
             "across replicas crosses nodes")
    if quantizes_only_replicas(config):
        raise ConfigError(f"config {config.name!r} quantizes only the all-reduce across HSDP replicas, but {where}: "
                          "its weight all-gathers and gradient reduce-scatters would cross nodes at full precision")
    if config.weights.mode == "plain" and config.grads.mode == "plain":
        return None
    return f"qsdp: {config.name}: {where}"
