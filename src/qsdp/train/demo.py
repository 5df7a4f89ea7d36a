"""``qsdp demo``: fsdp, qsdp and sdp4bit side by side on 4 local CPU workers.

Trains a tiny GPT on the chit-chat corpus with each preset as 2 emulated nodes x 2 ranks (gloo,
bf16 weights), then prints one table (validation loss, bits per element on the wire, bytes,
step time) and writes the loss plots.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from qsdp.extras import require
from qsdp.launch import under_torchrun
from qsdp.text_table import aligned
from qsdp.train.args import TrainArgs
from qsdp.train.launcher import UsageError, check_writable, launch, plan_run
from qsdp.train.metrics import METRICS_FILE, SUMMARY_FILE
from qsdp.train.owned import NotOwnedError, check_clearable, clear_owned
from qsdp.train.plots import plot_runs
from qsdp.train.runtime import cpu_param_dtype

__all__ = ["DEMO_PRESETS", "DEMO_DEFAULTS", "add_arguments", "main", "demo_table", "format_bytes", "inter_node_bytes"]

DEMO_PRESETS = ("fsdp", "qsdp", "sdp4bit")
NPROC, RANKS_PER_NODE = 4, 2
# Measured on idle 2-core CPU machines: the three runs of 4 workers take about 2 minutes in bf16
# on a CPU with native bf16, 3 in fp32 on an AVX2-only one (about 6 under heavy load from other
# jobs), and the byte-level loss falls from ln(256) = 5.5 to about 2.4.
DEMO_DEFAULTS: dict[str, Any] = dict(
    model="tiny", steps=150, batch_size=8, seq_len=64, lr=3e-3, warmup=20, eval_every=50,
    eval_batches=8, ckpt_every=0, keep_checkpoints=1, log_every=1)
# What the demo writes in each run directory: a new demo replaces an old one, and only its own
# (the directory carries the demo's marker, see qsdp.train.owned).
_ARTIFACTS = (METRICS_FILE, SUMMARY_FILE, "checkpoints", "error.txt")
OWNER = "qsdp demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="demo directory (default runs/demo)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per run (default {DEMO_DEFAULTS['steps']})")
    parser.add_argument("--param-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="weights' compute and all-gather dtype (default auto: bfloat16 where "
                             "this CPU computes it natively, measured by a quick matmul probe, "
                             "else float32)")
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)


def format_bytes(n: float) -> str:
    """``n`` bytes with a decimal unit (kB, MB, GB, TB)."""
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def inter_node_bytes(summary: dict[str, Any]) -> int:
    """Bytes this run put on the links between nodes (every kind: weights, gradients, control)."""
    return sum(kind["inter"]["bytes"] for kind in summary["wire"].values())


def _row(preset: str, summary: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    weights, grads = summary["wire"]["weights"], summary["wire"]["grads"]
    inter = inter_node_bytes(summary)
    gap = reduction = "-"
    if base is not None:
        gap = f"{100 * (summary['final_val_loss'] / base['final_val_loss'] - 1):+.2f}%"
        if inter:
            reduction = f"{inter_node_bytes(base) / inter:.2f}x"
    return [preset, f"{summary['final_val_loss']:.4f}", gap,
            *(f"{kind[level]['bits_per_element']:.2f}" for kind in (weights, grads) for level in ("intra", "inter")),
            format_bytes(inter), reduction, f"{1000 * summary['median_step_time_s']:.0f} ms"]


def demo_table(summaries: dict[str, dict[str, Any]]) -> str:
    """The comparison table of the demo's run summaries (against ``fsdp`` when it is there)."""
    head = ["preset", "val loss", "vs fsdp", "weights intra", "weights inter", "grads intra",
            "grads inter", "inter-node bytes", "reduction", "step (median)"]
    rows = [head] + [_row(p, s, summaries.get("fsdp")) for p, s in summaries.items()]
    return "\n".join(aligned(rows, rule=True))


def main(ns: argparse.Namespace) -> int:
    """Run the demo (arguments from :func:`add_arguments`); returns the exit code."""
    if under_torchrun():
        raise UsageError("qsdp demo launches its own workers; run it without torchrun")
    require("matplotlib", "drawing the demo's loss curves")  # drawn at the end: checked before training
    opts = {**DEMO_DEFAULTS, **({"steps": ns.steps} if ns.steps is not None else {})}
    dtype, why = ns.param_dtype, "as asked"
    if dtype == "auto":
        dtype, ratio = cpu_param_dtype()
        why = f"a bf16 matmul takes {ratio:.1f}x the fp32 one here"
    runs = {p: TrainArgs(preset=p, out=os.path.join(ns.out, p), local_world_size=RANKS_PER_NODE,
                         param_dtype=dtype, device="cpu", cache_dir=ns.cache_dir, **opts)
            for p in DEMO_PRESETS}
    try:  # all three before anything is deleted
        for args in runs.values():
            check_clearable(args.out, OWNER, _ARTIFACTS)
    except NotOwnedError as e:
        raise UsageError(str(e)) from None
    check_writable(ns.out)
    plans = {}
    for preset, args in runs.items():  # validate all three before the first one starts
        clear_owned(args.out, OWNER, _ARTIFACTS)
        plans[preset] = plan_run(args, NPROC, prepare_data=True)
    print(f"qsdp demo: GPT '{opts['model']}' on the chit-chat corpus (byte tokenizer), "
          f"{opts['steps']} steps, {NPROC} workers as {NPROC // RANKS_PER_NODE} nodes x {RANKS_PER_NODE} ranks (gloo, CPU), "
          f"{dtype} weights ({why}), presets {', '.join(DEMO_PRESETS)}", flush=True)
    summaries = {}
    started = time.perf_counter()
    for i, (preset, args) in enumerate(runs.items(), 1):
        print(f"[{i}/{len(runs)}] {preset} -> {args.out}", flush=True)
        summaries[preset] = launch(args, plans[preset])
    elapsed = time.perf_counter() - started
    print()
    print(demo_table(summaries))
    plots = plot_runs([a.out for a in runs.values()], ns.out)
    print(f"\nwall time {elapsed:.0f} s. Plots: {', '.join(plots)}")
    print(f"Runs (metrics.jsonl, summary.json, checkpoints/): {', '.join(a.out for a in runs.values())}")
    return 0
