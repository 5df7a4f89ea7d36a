"""A node's identity holds across machines: Slurm's node name, not the job step's node number;
a host name many machines share (``localhost``) made distinct by the machine's own identity;
and a warning where one container a GPU makes every rank look like a node of its own."""

from __future__ import annotations

import ctypes
import os
import socket
import tempfile

import pytest

from distributed import run_pooled
from qsdp.comm.topology import NODE_ENV, build_topology, node_name, one_rank_nodes_warning

pytestmark = pytest.mark.timeout(180)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _as_slurm_step(rank, world):
    """Rank ``r`` started by its own ``srun`` step on Slurm node ``cn{r // 2}``: each step
    numbers its nodes from 0, so ``SLURM_NODEID`` is 0 on every rank."""
    os.environ.pop(NODE_ENV, None)
    os.environ["SLURM_NODEID"] = "0"
    os.environ["SLURMD_NODENAME"] = f"cn{rank // 2}"
    t = build_topology()
    return node_name(), t.nodes, t.ranks_per_node


def test_ranks_of_separate_srun_steps_are_placed_by_the_slurm_node_name_not_the_step_node_id():
    for rank, (name, nodes, per_node) in enumerate(run_pooled(_as_slurm_step, 4)):
        assert name == f"cn{rank // 2}"
        assert (nodes, per_node) == (2, 2)


def _machine_of_its_own(boot_id: str) -> bool:
    """Put this process on a machine of its own as the kernel tells it: a UTS namespace with
    the host name ``localhost`` (as a container image may give every machine), and a mount
    namespace in which the kernel's boot id reads ``boot_id``. False where namespaces or
    mounts are not allowed (not root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS | CLONE_NEWNS) != 0:
        return False
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    with tempfile.NamedTemporaryFile("w", suffix=".boot_id", delete=False) as f:
        f.write(boot_id + "\n")
    mounted = libc.mount(f.name.encode(), BOOT_ID.encode(), None, MS_BIND, None) == 0
    os.unlink(f.name)  # the mount keeps the file's contents
    if not mounted:
        return False
    socket.sethostname("localhost")
    return True


def _on_localhost_machines(rank, world):
    machine = rank % 2  # srun --distribution=cyclic: ranks 0, 2 on one machine, 1, 3 on the other
    if not _machine_of_its_own(f"{machine}{machine}{machine}{machine}aaaa-0000-4000-8000-00000000000{machine}"):
        return None
    os.environ.pop(NODE_ENV, None)
    for var in ("SLURM_NODEID", "SLURMD_NODENAME"):
        os.environ.pop(var, None)
    t = build_topology()
    return socket.gethostname(), t.intra_ranks


def test_machines_that_all_call_themselves_localhost_are_told_apart_by_their_machine_identity():
    results = run_pooled(_on_localhost_machines, 4)
    if None in results:
        pytest.skip("needs UTS and mount namespaces (root)")
    for host, intra in results:
        assert host == "localhost"
        assert intra == ((0, 2), (1, 3))


def test_one_rank_nodes_that_see_several_cuda_devices_are_warned_about():
    message = one_rank_nodes_warning(per_node=1, nodes=4, devices=8)
    assert message is not None
    assert "every one of the 4 nodes found holds one rank" in message and "sees 8 CUDA devices" in message
    assert "QSDP_NODE" in message


@pytest.mark.parametrize("per_node,nodes,devices", [(2, 2, 8), (1, 4, 1), (1, 4, 0), (1, 1, 8)])
def test_no_warning_where_the_nodes_found_fit_the_devices_seen(per_node, nodes, devices):
    assert one_rank_nodes_warning(per_node, nodes, devices) is None
