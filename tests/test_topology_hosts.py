"""Nodes are hosts under every launcher: ranks given real host names (a UTS namespace each,
``QSDP_NODE`` where namespaces are unavailable), srun-style cyclic and block placement, HSDP
groups from the same nodes, the launcher's ranks per node checked against the hosts', and the
start-up exchange of a fixed number of bytes a rank."""

from __future__ import annotations

import ctypes
import os
import socket
import warnings

import pytest

import qsdp
from distributed import run_pooled
from qsdp.comm.topology import NODE_ENV, RECORD_BYTES, build_topologies, build_topology, setup_bytes_sent

pytestmark = pytest.mark.timeout(180)

CLONE_NEWUTS = 0x04000000


def put_on_host(host: str) -> str:
    """Give this process a host of its own named ``host`` (a new UTS namespace; root only) and
    drop the harness's ``QSDP_NODE``, so the node comes from the host name as on a real
    cluster; where namespaces are unavailable, name the node with ``QSDP_NODE`` instead.
    Returns how: ``"uts"`` or ``"env"``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) == 0:
        socket.sethostname(host)
        os.environ.pop(NODE_ENV, None)
        return "uts"
    os.environ[NODE_ENV] = host
    return "env"


def _placed(fn, placement: str, per_node: int = 2):
    """``fn`` with rank ``r`` on host ``h(r)``: ``cyclic`` (``srun --distribution=cyclic``:
    ``r % nodes``) or ``block`` (``r // per_node``), and no torchrun variables (srun sets
    ``SLURM_NTASKS_PER_NODE``, not ``LOCAL_WORLD_SIZE``)."""
    def run(rank, world, *args):
        nodes = world // per_node
        host = f"host{rank % nodes if placement == 'cyclic' else rank // per_node}"
        how = put_on_host(host)
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        os.environ["SLURM_NTASKS_PER_NODE"] = str(per_node)
        return how, fn(rank, world, *args)
    return run


def _layout_and_hsdp(rank, world):
    import torch.distributed as dist

    t = build_topology()
    groups = qsdp.hsdp_groups(device_type="cpu")
    return {"host": socket.gethostname(), "node_of": t.node_of, "intra": t.intra_ranks,
            "intra_group": dist.get_process_group_ranks(t.intra_group),
            "inter_group": dist.get_process_group_ranks(t.inter_group),
            "shard": dist.get_process_group_ranks(groups.shard_group),
            "replicate": dist.get_process_group_ranks(groups.replicate_group),
            "nodes": (groups.nodes, groups.ranks_per_node)}


@pytest.mark.parametrize("placement,hosts", [("cyclic", [[0, 2], [1, 3]]), ("block", [[0, 1], [2, 3]])])
def test_ranks_group_by_host_and_hsdp_shards_inside_each_host(placement, hosts):
    for rank, (how, got) in enumerate(run_pooled(_placed(_layout_and_hsdp, placement), 4)):
        mine = next(h for h in hosts if rank in h)
        other = next(h for h in hosts if rank not in h)
        if how == "uts":
            assert got["host"] == f"host{hosts.index(mine)}"
        assert got["intra"] == tuple(tuple(h) for h in hosts)
        assert got["intra_group"] == mine  # the node subgroup holds this host's ranks
        assert got["inter_group"] == sorted([mine[mine.index(rank)], other[mine.index(rank)]])
        # HSDP: the shard group never spans hosts; the replicas are the same local index on each
        assert got["shard"] == mine and got["nodes"] == (2, 2)
        assert got["replicate"] == got["inter_group"]


def _nodes_given(rank, world, nodes):
    try:
        qsdp.hsdp_groups(nodes=nodes, device_type="cpu")
    except qsdp.ConfigError as e:
        return str(e)
    return None


def test_hsdp_nodes_that_contradict_the_hosts_are_refused_naming_both():
    for _, message in run_pooled(_placed(_nodes_given, "cyclic"), 4, 4):
        assert "nodes=4, but the hosts place the 4 ranks on 2 nodes of 2" in message


def _one_host(rank, world, stated):
    """Every rank on one host; the launcher states ``stated`` ranks per node."""
    put_on_host("host0")
    os.environ["LOCAL_WORLD_SIZE"] = str(stated)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = build_topology()
        build_topology()  # once a world, not once a call
    return t.nodes, [str(w.message) for w in caught if "launcher states" in str(w.message)]


def test_rank_0_warns_once_when_the_launcher_states_other_ranks_per_node_than_the_hosts_hold():
    results = run_pooled(_one_host, 4, 1)  # e.g. 4 torchrun agents of one rank each on one host
    assert [nodes for nodes, _ in results] == [1] * 4
    assert len(results[0][1]) == 1 and all(said == [] for _, said in results[1:])
    message = results[0][1][0]
    assert "4 rank(s) on each of 1 node(s)" in message and "LOCAL_WORLD_SIZE=1" in message


def test_no_warning_when_the_launcher_agrees_with_the_hosts():
    assert [said for _, said in run_pooled(_one_host, 4, 4)] == [[]] * 4


def _setup_bytes(rank, world):
    """Bytes this rank sends to place the ranks of the world and of its own half of it (a
    pipeline stage: ranks of the other half never take part)."""
    import torch.distributed as dist

    halves = [dist.new_group(list(range(h * world // 2, (h + 1) * world // 2))) for h in range(2)]
    before = setup_bytes_sent()
    build_topology()
    world_bytes = setup_bytes_sent() - before
    mine = halves[rank * 2 // world]
    t = build_topologies([mine])[0]
    if rank < world // 2:
        build_topologies([mine])  # the first stage places its group twice (two model parts)
    intra = dist.get_process_group_ranks(t.intra_group) if t.intra_group is not None else None
    return world_bytes, t.nodes, t.ranks_per_node, intra


@pytest.mark.parametrize("world", [4, 8])
def test_each_rank_sends_one_fixed_size_record_at_setup(world):
    """O(1) bytes a rank (its node's name and a count), whatever the world size, where the
    previous exchange sent every rank's group ranks (O(world x group))."""
    for rank, (sent, nodes, per_node, intra) in enumerate(run_pooled(_setup_bytes, world, local_world_size=2)):
        assert sent == RECORD_BYTES == 72
        # each half: world / 4 nodes of 2 ranks; its node subgroup, when it has two levels
        assert (nodes, per_node) == (world // 4, 2)
        assert intra == ([rank - rank % 2, rank - rank % 2 + 1] if world == 8 else None)


def _uneven_held_groups(rank, world):
    import torch.distributed as dist

    dist.new_group([0, 1])  # ranks 0 and 1 now hold one process group more than ranks 2 and 3
    try:
        build_topology()
    except qsdp.ConfigError as e:
        return str(e)
    return None


def test_ranks_holding_different_numbers_of_groups_are_refused_instead_of_hanging():
    for message in run_pooled(_uneven_held_groups, 4, local_world_size=2, timeout=60):
        assert message is not None and "hold different numbers of process groups" in message
        assert "rank 0: " in message and "rank 2: " in message


def _train_hsdp_shard_groups(rank, world, out):
    """The groups ``qsdp train --hsdp`` shards its model over, with the launcher's layout."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from qsdp.train.args import TrainArgs
    from qsdp.train.preflight import preflight
    from qsdp.train.trainer import shard_and_quantize

    args = TrainArgs(out=out, data="unused", model="tiny", steps=1, batch_size=2, seq_len=16, hsdp=True,
                     progress=False, preset="sdp4bit")
    plan = preflight(args, world)
    model, _, comms, layout = shard_and_quantize(args, plan, 64, torch.device("cpu"))
    mesh = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh
    comms.close()
    return layout, mesh.mesh_dim_names, dist.get_process_group_ranks(mesh.get_group("shard"))


@pytest.mark.slow  # builds the trainer's model: ~40 s on 2 cores
@pytest.mark.parametrize("placement,hosts", [("cyclic", [[0, 2], [1, 3]]), ("block", [[0, 1], [2, 3]])])
def test_qsdp_train_hsdp_shards_inside_each_host(placement, hosts, tmp_path):
    for rank, (_, (layout, dims, shard)) in enumerate(run_pooled(_placed(_train_hsdp_shard_groups, placement), 4,
                                                                str(tmp_path / "run"))):
        # FSDP2's native HSDP mesh, its shard dimension the host's ranks
        assert layout == (2, 2) and dims == ("replicate", "shard") and shard == next(h for h in hosts if rank in h)
