"""One torchrun agent per GPU (``srun --ntasks-per-node 2 torchrun --nproc-per-node 1``, or a
pod per GPU): four agents of one rank each, two on each of two hosts, are 2 nodes x 2 ranks,
not 4 nodes. Each host is a UTS namespace of its own (root only; skipped elsewhere)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from qsdp.launch import free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # four agents and their rendezvous: ~100 s on 2 cores

HERE = os.path.dirname(os.path.abspath(__file__))


def _can_unshare_uts() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--uts", "hostname", "qsdp-probe"], capture_output=True).returncode == 0


def _agent(port: int, first: bool, out: str) -> str:
    """A torchrun agent of the 4-agent job (one rank), on 127.0.0.1 whatever its host's name."""
    conf = f"is_host={1 if first else 0},join_timeout=120"
    return shlex.join([
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "agents-per-host",
        "--rdzv-conf", conf, "--local-addr", "127.0.0.1", "--max-restarts", "0",
        os.path.join(HERE, "agents_per_host_worker.py"), out])


@pytest.mark.skipif(not _can_unshare_uts(), reason="needs UTS namespaces (unshare --uts, as root)")
def test_four_one_rank_agents_on_two_hosts_are_two_nodes_of_two(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID",
                        "MASTER_ADDR", "MASTER_PORT", "QSDP_NODE", "SLURM_NODEID", "SLURMD_NODENAME")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"), HERE,
                                                                 env.get("PYTHONPATH", "")]))
    hosts = []
    for h, name in enumerate(("hostA", "hostB")):
        agents = " & ".join(_agent(port, h == 0 and i == 0, str(tmp_path)) for i in range(2))
        script = f"hostname {name} && {{ {agents} & wait; }}"
        hosts.append(subprocess.Popen(["unshare", "--uts", "sh", "-c", script], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=200)[0] for p in hosts]
    finally:
        for p in hosts:
            if p.poll() is None:
                p.kill()
    records = []
    for r in range(4):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing:\n" + "\n".join(log[-3000:] for log in logs)
        records.append(json.loads(path.read_text()))
    for r, rec in enumerate(records):
        assert rec["local_world_size"] == "1"
        mine = [q for q in range(4) if records[q]["host"] == rec["host"]]
        assert len(mine) == 2
        assert (rec["nodes"], rec["ranks_per_node"]) == (2, 2)
        assert [list(ranks) for ranks in rec["intra"]] in ([mine, [q for q in range(4) if q not in mine]],
                                                           [[q for q in range(4) if q not in mine], mine])
        assert rec["shard"] == mine and r in rec["replicate"] and len(rec["replicate"]) == 2
        # a two-level route and a replica of one row a node, not a whole model a rank
        assert rec["intra_grad_bits"] > 0 and rec["inter_grad_bits"] > 0
        assert rec["replica_rows"] and all(rows == 2 for rows in rec["replica_rows"])
    said = records[0]["warnings"]
    assert len(said) == 1 and "2 rank(s) on each of 2 node(s)" in said[0] and "LOCAL_WORLD_SIZE=1" in said[0]
    assert all(rec["warnings"] == [] for rec in records[1:])
