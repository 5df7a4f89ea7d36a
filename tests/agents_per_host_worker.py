"""One worker of a torchrun job whose agents run one rank each, several agents a host: places
the ranks, builds the HSDP groups, trains one step of a small model under ``sdp4bit`` and
writes what it saw to ``OUT/rank<r>.json`` (run by tests/test_topology_agents.py)."""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist

import qsdp


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    sys.path.insert(0, os.path.dirname(__file__))
    import fsdp_models as fm

    rank = dist.get_rank()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fm.build()
        handle = qsdp.quantize_comms(model, "sdp4bit")
    groups = qsdp.hsdp_groups(device_type="cpu")
    fm.train(model, 1, rank)
    stats = handle.comm_stats()
    t = handle.topology
    record = {
        "host": socket.gethostname(), "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
        "nodes": t.nodes, "ranks_per_node": t.ranks_per_node, "intra": t.intra_ranks,
        "shard": dist.get_process_group_ranks(groups.shard_group),
        "replicate": dist.get_process_group_ranks(groups.replicate_group),
        "replica_rows": [len(ag.replica_rows()) for ag in handle.all_gathers if ag.holds_replicas()],
        "intra_grad_bits": stats["grads"]["intra"]["bits_per_element"],
        "inter_grad_bits": stats["grads"]["inter"]["bits_per_element"],
        "warnings": [str(w.message) for w in caught if "launcher states" in str(w.message)],
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    handle.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
