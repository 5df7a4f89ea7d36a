"""``qsdp advise``: does quantized communication pay for this job, and which preset?

Given the model size, the nodes, the ranks per node, the GPU type and the inter-node bandwidth
(stated, taken from the GPU type's description, or measured with ``--measure`` by a real
all-gather between the nodes of the current torchrun world), it predicts the step time of fully
sharded FSDP2 and of HSDP (shard inside the node, replicate across nodes), unquantized and with
each preset, with the performance model :mod:`qsdp.perfmodel` (the one ``qsdp bench simulate``
stands on; with the kernel speeds of ``qsdp bench kernels --save`` when given), and recommends the
fastest; a quantized setup is recommended only when it is predicted at least ``--margin`` faster
than the best unquantized one. The state per GPU is the sharded training state plus the
weight-difference replicas a preset keeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import Any, Mapping, Sequence

import torch

from .gpt_shape import n_params
from .perfmodel import (
    GPT2_VOCAB,
    HARDWARE,
    SEQ_LEN,
    fsdp2_setup,
    gpt_shape,
    load_kernels,
    simulate_hsdp_step,
    simulate_step,
)

FLAT_PRESETS = ("fsdp", "qsdp", "zeropp", "sdp4bit")
HSDP_PRESETS = ("fsdp", "hsdp8", "hsdp4", "sdp4bit")
STATE_BYTES_PER_PARAM = 16  # fp32 master weights, gradients and two Adam moments


def parse_params(text: str) -> int:
    """``"1.3B"``, ``"350M"``, ``"7e9"`` or ``"125000000"`` -> parameters."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise ValueError(f"--params={text!r}: expected a number such as 1.3B, 350M or 7e9")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    n = int(float(m.group(1)) * scale)
    if n < 1e6:
        raise ValueError(f"--params={text!r}: {n} parameters is too small to be worth sharding")
    return n


def shape_from_config(path: str) -> dict[str, int]:
    """The GPT shape of a model config JSON: nanoGPT names (``n_layer``, ``n_embd``, ``n_head``)
    or Hugging Face ones (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``), and
    ``vocab_size``. A non-GPT block (a gated MLP, grouped attention) is priced as a GPT block of
    the same width."""
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")

    def pick(*names: str) -> int:
        for n in names:
            if isinstance(cfg.get(n), int) and cfg[n] > 0:
                return cfg[n]
        raise ValueError(f"{path}: no positive integer {' or '.join(names)}")

    return {"n_layer": pick("n_layer", "num_hidden_layers", "num_layers"),
            "n_embd": pick("n_embd", "hidden_size", "d_model"),
            "n_head": pick("n_head", "num_attention_heads"),
            "vocab_size": cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else GPT2_VOCAB}


def advise(params: int | None, nodes: int, ranks_per_node: int, gpu: str = "h800", *,
           shape: Mapping[str, int] | None = None, inter_gbps: float | None = None,
           kernels: Mapping[str, float] | None = None, seq_len: int = SEQ_LEN, micro_batch: int = 1,
           overlap: float = 0.0, margin: float = 0.05) -> dict[str, Any]:
    """The predictions and the recommendation as a JSON-ready dict (times in ms), for a model
    of ``params`` parameters (a GPT shape is chosen) or of the given ``shape``."""
    shape = dict(shape) if shape is not None else gpt_shape(int(params or 0))
    setup = fsdp2_setup(gpu, nodes, ranks_per_node, shape, seq_len=seq_len, micro_batch=micro_batch)
    hw = dataclasses.replace(HARDWARE[gpu], gpus_per_node=ranks_per_node,
                             **({"inter_gbps": inter_gbps} if inter_gbps else {}))
    params = n_params(setup.gpt())
    rows = []
    for p in FLAT_PRESETS:
        r = simulate_step(setup, p, hw, overlap=overlap, kernels=kernels)
        rows.append(_row("fsdp", p, r, params / (nodes * ranks_per_node)))
    if nodes > 1:
        for p in HSDP_PRESETS:
            r = simulate_hsdp_step(setup, p, hw, overlap=overlap, kernels=kernels)
            rows.append(_row("hsdp", p, r, params / ranks_per_node))
    return {"params": params, "shape": shape, "nodes": nodes, "ranks_per_node": ranks_per_node,
            "gpu": gpu, "inter_gbps_per_gpu": hw.inter_gbps, "seq_len": seq_len, "micro_batch": micro_batch,
            "overlap": overlap, "rows": rows, "recommendation": _recommend(rows, margin)}


def _row(layout: str, preset: str, r: Mapping[str, Any], params_per_gpu: float) -> dict[str, Any]:
    # The replicas of weight differences (sdp4bit) stay in memory next to the sharded state.
    replica = r["replica_bytes"]
    return {"layout": layout, "preset": preset, "quantized": preset != "fsdp",
            "step_ms": 1e3 * r["step_s"], "compute_ms": 1e3 * r["compute_s"], "comm_ms": 1e3 * r["comm_s"],
            "state_gb_per_gpu": (STATE_BYTES_PER_PARAM * params_per_gpu + replica) / 1e9,
            "replica_gb_per_gpu": replica / 1e9}


def _recommend(rows: Sequence[Mapping[str, Any]], margin: float) -> dict[str, Any]:
    plain = min((r for r in rows if not r["quantized"]), key=lambda r: r["step_ms"])
    best = min(rows, key=lambda r: r["step_ms"])
    speedup = plain["step_ms"] / best["step_ms"]
    if best["quantized"] and speedup >= 1 + margin:
        pick, why = best, f"predicted {speedup:.2f}x faster than the best unquantized setup ({_name(plain)})"
    else:
        pick, why = plain, (f"no quantized setup is predicted at least {100 * margin:.0f}% faster "
                            f"(best: {_name(best)}, {speedup:.2f}x); quantization would not pay here")
    return {"layout": pick["layout"], "preset": pick["preset"], "step_ms": pick["step_ms"],
            "speedup_over_unquantized": plain["step_ms"] / pick["step_ms"], "reason": why}


def _name(row: Mapping[str, Any]) -> str:
    if row["layout"] == "hsdp":
        return "native HSDP" if row["preset"] == "fsdp" else f"HSDP {row['preset']}"
    return row["preset"]


def measure_inter_gbps(nbytes: int = 64 << 20, iters: int = 5) -> float:
    """Collective over the current world (``D`` nodes x ``M`` ranks, nodes from the hosts): every rank
    all-gathers ``nbytes`` with the ranks of its local rank on the other nodes, all local ranks
    at once, as the data-parallel groups of a job do. Returns the slowest rank's received bytes
    per second per GPU, in GB/s (the simulator's ``inter_gbps``)."""
    import torch.distributed as dist

    from .comm.collectives import all_gather_flat
    from .comm.topology import build_topology

    topo = build_topology(None)  # nodes from the hosts (or QSDP_NODE)
    if topo.nodes < 2:
        raise ValueError("--measure needs a world of at least 2 nodes (its ranks all run on one host)")
    group = topo.inter_group if topo.ranks_per_node > 1 else topo.group
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    chunk = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    out = torch.empty(topo.nodes * chunk.numel(), dtype=torch.float32, device=device)
    all_gather_flat(out, chunk, group)  # warm-up: connections and buffers
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        all_gather_flat(out, chunk, group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return (topo.nodes - 1) * chunk.numel() * 4 * iters / float(elapsed.item()) / 1e9


def format_text(result: Mapping[str, Any]) -> str:
    s = result["shape"]
    lines = [f"{result['params'] / 1e9:.3g}B parameters (GPT {s['n_layer']} x {s['n_embd']}), "
             f"{result['nodes']} nodes x {result['ranks_per_node']} {result['gpu']}, inter-node "
             f"{result['inter_gbps_per_gpu']:.2f} GB/s per GPU, sequence {result['seq_len']} x {result['micro_batch']} per GPU",
             "", f"{'setup':<18}{'step ms':>10}{'comm ms':>10}{'state GB/GPU':>14}"]
    for r in result["rows"]:
        lines.append(f"{_name(r):<18}{r['step_ms']:>10.1f}{r['comm_ms']:>10.1f}{r['state_gb_per_gpu']:>14.2f}")
    rec = result["recommendation"]
    lines += ["", f"recommended: {_name(rec)} ({rec['reason']})",
              "predictions of the performance model behind `qsdp bench simulate` (no tensor/pipeline parallelism, "
              f"weights gathered twice per step, {100 * result['overlap']:.0f}% of compute hides communication); "
              "state: fp32 weights, gradients and Adam moments, sharded, plus weight-difference replicas"]
    if "measured_inter_gbps" in result:
        lines.append(f"inter-node bandwidth measured by an all-gather between the nodes: {result['measured_inter_gbps']:.2f} GB/s per GPU")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qsdp advise", description=__doc__.splitlines()[0])
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", help="model parameters, e.g. 1.3B, 350M, 7e9 (a GPT shape is chosen)")
    model.add_argument("--config", metavar="FILE", help="a model config JSON (nanoGPT or Hugging Face names)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: from the torchrun world with --measure)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="GPUs per node (default: the GPU type's)")
    p.add_argument("--gpu", choices=sorted(HARDWARE), default="h800", help="GPU type and its cluster")
    p.add_argument("--inter-gbps", type=float, default=None, help="inter-node bandwidth per GPU, GB/s (stated)")
    p.add_argument("--measure", action="store_true", help="measure it: run under torchrun on the nodes")
    p.add_argument("--kernels", metavar="FILE", help="kernel speeds (qsdp bench kernels --save FILE)")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--overlap", type=float, default=0.0, help="fraction of compute that hides communication")
    p.add_argument("--margin", type=float, default=0.05, help="how much faster a quantized setup must be")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        params = parse_params(args.params) if args.params else None
        shape = shape_from_config(args.config) if args.config else None
        kernels = load_kernels(args.kernels) if args.kernels else None
    except (OSError, ValueError) as e:
        p.error(str(e))
    for name in ("nodes", "ranks_per_node", "inter_gbps", "seq_len", "micro_batch"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            p.error(f"--{name.replace('_', '-')}={v} must be positive")
    if not 0.0 <= args.overlap <= 1.0 or args.margin < 0:
        p.error("--overlap must be in [0, 1] and --margin non-negative")
    measured, speak = None, True
    if args.measure:
        measured, nodes, per_node, speak = _measure()
        args.nodes, args.ranks_per_node = args.nodes or nodes, args.ranks_per_node or per_node
    if args.nodes is None:
        p.error("--nodes is required (or --measure under torchrun)")
    per_node = args.ranks_per_node or HARDWARE[args.gpu].gpus_per_node
    result = advise(params, args.nodes, per_node, args.gpu, shape=shape, inter_gbps=measured or args.inter_gbps,
                    kernels=kernels, seq_len=args.seq_len, micro_batch=args.micro_batch,
                    overlap=args.overlap, margin=args.margin)
    if measured is not None:
        result["measured_inter_gbps"] = measured
    result["meta"] = {"command": "qsdp advise " + " ".join(argv if argv is not None else sys.argv[1:]),
                      "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                      "device": "analytic model" + (" + measured all-gather" if measured else "")}
    if speak:
        print(json.dumps(result) if args.json else format_text(result))
    if args.measure:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def _measure() -> tuple[float, int, int, bool]:
    """Join (or use) the torchrun world, time the all-gather; (GB/s, nodes, ranks per node,
    whether this rank prints)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise SystemExit("qsdp advise: --measure runs under torchrun, e.g. "
                             "torchrun --nnodes 2 --nproc-per-node 8 ... -m qsdp.cli advise --measure --params 7B")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gbps = measure_inter_gbps()
    return gbps, world // per_node, per_node, dist.get_rank() == 0


if __name__ == "__main__":
    raise SystemExit(main())
