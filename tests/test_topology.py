"""Where ranks really are: nodes from the machine (not from a rank's position), any rank order,
subgroups made alike on every rank, and layouts qsdp refuses with one line."""

from __future__ import annotations

import os

import pytest
import torch

import qsdp
from distributed import run_pooled
from qsdp.comm.topology import NODE_ENV, SHARED_HOST_NAMES, Topology, build_topology, node_name

pytestmark = pytest.mark.timeout(180)


def test_qsdp_node_names_the_node_before_the_host(monkeypatch):
    monkeypatch.setenv(NODE_ENV, "rack3-node7")
    assert node_name() == "rack3-node7"


def test_the_host_is_the_node_whatever_the_torchrun_agent(monkeypatch):
    import socket

    monkeypatch.delenv(NODE_ENV, raising=False)
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("GROUP_RANK", "1")  # one agent of several on this host: the same node
    if socket.gethostname().lower() not in SHARED_HOST_NAMES:
        assert node_name() == socket.gethostname()
    monkeypatch.setenv("SLURM_NODEID", "0")  # counts the nodes of one srun step: names nothing
    monkeypatch.setenv("SLURMD_NODENAME", "cn017")  # Slurm's node name, where it is set, names the host
    assert node_name() == "cn017"


def _as_srun_cyclic(fn):
    """``fn`` on ranks placed as ``srun --distribution=cyclic`` places them: rank ``r`` on node
    ``r % 2``, and no ``LOCAL_WORLD_SIZE`` (srun sets none)."""
    def run(rank, world, *args):
        os.environ[NODE_ENV] = f"n{rank % 2}"
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        return fn(rank, world, *args)
    return run


def _layout(rank, world):
    import torch.distributed as dist

    t = build_topology()
    return (t.nodes, t.ranks_per_node, t.node_of, t.intra_ranks, t.inter_ranks, t.node_major,
            dist.get_process_group_ranks(t.intra_group), dist.get_process_group_ranks(t.inter_group))


def test_nodes_come_from_the_machine_not_from_the_rank_order():
    for rank, got in enumerate(run_pooled(_as_srun_cyclic(_layout), 4)):
        nodes, per_node, node_of, intra, inter, node_major, intra_group, inter_group = got
        assert (nodes, per_node, node_of) == (2, 2, (0, 1, 0, 1))
        assert intra == ((0, 2), (1, 3)) and inter == ((0, 1), (2, 3)) and not node_major
        assert intra_group == list(intra[rank % 2]) and inter_group == list(inter[rank // 2])


def test_torchruns_numbering_is_node_major():
    # node d's ranks are d * M .. d * M + M - 1, in order: a node replica's fill gathers into blocks
    assert Topology.contiguous(3, 4).node_major and Topology.contiguous(1, 4).node_major


def test_the_exact_two_level_route_equals_plain_reduce_scatter_in_any_rank_order():
    import torch.distributed as dist
    from test_comm_reduce_scatter import _unquantized_route

    assert all(run_pooled(_as_srun_cyclic(_unquantized_route), 4, "two_level", 3, dist.ReduceOp.AVG, 32))


def test_node_replicas_follow_the_real_nodes_in_any_rank_order():
    from test_comm_all_gather import _node_and_full

    for rank, (outs, meter, rows, shape) in enumerate(run_pooled(_as_srun_cyclic(_node_and_full), 4, 4)):
        assert all(torch.equal(a, b) for a, b in zip(outs["full"], outs["node"]))
        assert rows == [2 * (rank // 2), 2 * (rank // 2) + 1]  # the ranks with this local index
        assert meter["intra"]["bits_per_element"] == 32.0


def _error(rank, world, case):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    try:
        if case == "unequal":
            os.environ[NODE_ENV] = "a" if rank < 2 else "b"
            build_topology()
        elif case == "group":  # FSDP on a mesh's dp dimension, group= its tp dimension
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            model = nn.Linear(4, 4)
            fully_shard(model, mesh=mesh["dp"])
            qsdp.quantize_comms(model, "qsdp", group=mesh["tp"].get_group())
    except qsdp.ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case,world,words", [
    ("unequal", 3, ["unequal numbers of ranks per node", "node a: 2, node b: 1", "local_world_size"]),
    ("group", 4, ["group= holds ranks", "but FSDP2 shards this rank's parameters over", "leave group= out"]),
])
def test_a_layout_qsdp_cannot_use_is_refused_on_every_rank_with_one_line(case, world, words):
    for message in run_pooled(_error, world, case):
        assert message is not None and "\n" not in message
        for w in words:
            assert w in message
