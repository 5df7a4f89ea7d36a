"""``qsdp bench convergence``: the papers' central claim, same loss with fewer bits.

Every variant trains the same model from the same seed on the same data (the embedded corpus or
``--data FILE``) with the same schedule, in 4 local workers treated as 2 nodes x 2 ranks, so the
only difference between runs is what travels on the wire. The table has the shape of SDP4Bit's
Table 1: final validation loss per variant and its relative gap to ``fsdp``; the loss curves are
plotted with :func:`qsdp.train.plots.plot_runs`.

Variants: ``fsdp`` (baseline), SDP4Bit's ablations ``qw4`` (4-bit direct weights), ``qwd4``
(4-bit weight differences), ``tlq4`` (two-level 8/4-bit gradients), ``tlq-hs`` (with Hadamard),
the full ``sdp4bit``, the ``zeropp`` baseline (qW + ULq), and QSDP's ``qsdp`` (W8G8) and
``qsdp-w4g4``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from qsdp.config import resolve_config
from qsdp.train.args import TrainArgs
from qsdp.train.launcher import launch, plan_run
from qsdp.train.plots import plot_runs

from .report import CONVERGENCE_VARIANTS, emit, meta

# The targets of the project's convergence claim, relative gap of the final validation loss.
TARGETS = {"sdp4bit": 0.003, "qsdp": 0.001}


def run(
    variants=CONVERGENCE_VARIANTS,
    *,
    out: str = "runs/convergence",
    steps: int = 300,
    nproc: int = 4,
    ranks_per_node: int = 2,
    model: str = "tiny",
    data: str | None = None,
    batch_size: int = 8,
    seq_len: int = 64,
    lr: float = 3e-3,
    eval_batches: int = 32,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Train every variant and return the JSON-ready result."""
    for v in variants:
        resolve_config(v)  # every name is valid before the first run starts
    runs = {
        v: TrainArgs(
            preset=v, out=os.path.join(out, v), model=model, data=data, steps=steps,
            batch_size=batch_size, seq_len=seq_len, lr=lr, warmup=max(1, steps // 10),
            eval_every=max(1, steps // 6), eval_batches=eval_batches, ckpt_every=0,
            keep_checkpoints=1, seed=seed, local_world_size=ranks_per_node,
            param_dtype="bfloat16", device="cpu", progress=progress,
        )
        for v in variants
    }
    plans = {v: plan_run(args, nproc, prepare_data=True) for v, args in runs.items()}
    results: dict[str, Any] = {}
    for i, (v, args) in enumerate(runs.items(), 1):
        t0 = time.perf_counter()
        print(f"[{i}/{len(runs)}] {v} -> {args.out}", file=sys.stderr, flush=True)
        summary = launch(args, plans[v])
        results[v] = {
            "final_val_loss": summary["final_val_loss"],
            "final_train_loss": summary["final_train_loss"],
            "wire_bytes_total": summary["wire_bytes_total"],
            "weights_bits_per_elt": summary["wire"]["weights"]["total"]["bits_per_element"],
            "grads_intra_bits_per_elt": summary["wire"]["grads"]["intra"]["bits_per_element"],
            "grads_inter_bits_per_elt": summary["wire"]["grads"]["inter"]["bits_per_element"],
            "wall_time_s": time.perf_counter() - t0,
        }
    base = results.get("fsdp", {}).get("final_val_loss")
    for r in results.values():
        r["rel_gap_vs_fsdp"] = (r["final_val_loss"] / base - 1.0) if base else None
    plots = plot_runs([a.out for a in runs.values()], out)
    return {
        "model": model, "steps": steps, "nodes": nproc // ranks_per_node, "ranks_per_node": ranks_per_node,
        "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "seed": seed,
        "data": data or "chitchat-dataset (embedded)", "eval_batches": eval_batches,
        "presets": results, "plots": plots, "targets": check_targets(results),
    }


def check_targets(results: dict[str, Any]) -> dict[str, Any]:
    """Each target as measured: met or missed, never hidden."""
    out: dict[str, Any] = {}
    for name, bound in TARGETS.items():
        if name in results and results[name]["rel_gap_vs_fsdp"] is not None:
            gap = results[name]["rel_gap_vs_fsdp"]
            out[f"{name}_within_{bound:.1%}"] = {"gap": gap, "met": abs(gap) <= bound}
    if "qw4" in results and "qwd4" in results:
        qw, qwd = results["qw4"]["final_val_loss"], results["qwd4"]["final_val_loss"]
        out["qw4_worse_than_qwd4"] = {"qw4": qw, "qwd4": qwd, "met": qw > qwd}
    return out


def format_table(result: dict[str, Any]) -> str:
    rows = [("variant", "final val loss", "vs fsdp", "weights b/elt", "grads intra", "grads inter")]
    for v, r in result["presets"].items():
        gap = r["rel_gap_vs_fsdp"]
        rows.append((v, f"{r['final_val_loss']:.5f}", "-" if gap is None else f"{100 * gap:+.2f}%",
                     f"{r['weights_bits_per_elt']:.2f}", f"{r['grads_intra_bits_per_elt']:.2f}",
                     f"{r['grads_inter_bits_per_elt']:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    head = (f"GPT '{result['model']}', {result['steps']} steps, {result['nodes']} nodes x "
            f"{result['ranks_per_node']} ranks, data: {result['data']}, seed {result['seed']}")
    tail = [f"target {k}: {'met' if v['met'] else 'MISSED'} ({', '.join(f'{a}={b:.5g}' for a, b in v.items() if a != 'met')})"
            for k, v in result["targets"].items()]
    return "\n".join([head, *lines, *tail, "plots: " + ", ".join(result["plots"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qsdp bench convergence", description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(CONVERGENCE_VARIANTS), help="presets or variants to compare")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--data", default=None, metavar="FILE", help="any UTF-8 text corpus (default: embedded)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--local-world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/convergence", help="run directories and plots")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", help="also write the JSON result to FILE")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1")

    result = run(args.variants, out=args.out, steps=args.steps, nproc=args.nproc,
                 ranks_per_node=args.local_world_size, model=args.model, data=args.data,
                 batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed)
    result["meta"] = meta("convergence", argv, "cpu (gloo)")
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)
