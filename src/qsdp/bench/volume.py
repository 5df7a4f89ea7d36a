"""``qsdp bench volume``: bits per element on the wire per preset, read from the byte meter.

A few training steps of the ``tiny`` GPT run in 4 local processes treated as 2 nodes x 2 ranks
(gloo, the config's ``local_world_size=2`` emulating the nodes), once per preset. The first step is a warm-up
and is not counted: it establishes the weight-difference replicas with exact values, a cost
paid once per run (and after each checkpoint load), not per step.
"""

from __future__ import annotations

from typing import Any

from qsdp.config import resolve_config
from qsdp.launch import launch_local
from qsdp.text_table import aligned

from .report import BENCH_PRESETS, emit, meta
from .workload import run_steps
from qsdp.train.model import MODEL_SIZES
from qsdp.usage import UsageParser, save_path


def measure(presets=BENCH_PRESETS, steps: int = 3, nproc: int = 4, ranks_per_node: int = 2,
            model: str = "tiny", seq_len: int = 64, batch_size: int = 4) -> dict[str, Any]:
    """Run every preset and return the JSON-ready result (rank 0's meter; all ranks send the
    same volumes by symmetry)."""
    for p in presets:
        resolve_config(p)  # fail on a bad name before launching anything
    out: dict[str, Any] = {"nodes": nproc // ranks_per_node, "ranks_per_node": ranks_per_node,
                           "model": model, "steps": steps, "warmup_steps": 1, "presets": {}}
    for p in presets:
        res = launch_local(run_steps, nproc, p, steps, model, seq_len, batch_size, ranks_per_node)[0]
        st = res["stats"]
        out["presets"][p] = {
            "weights_bits_per_elt": st["weights"]["total"]["bits_per_element"],
            "weights_intra_bits_per_elt": st["weights"]["intra"]["bits_per_element"],
            "weights_inter_bits_per_elt": st["weights"]["inter"]["bits_per_element"],
            "grads_intra_bits_per_elt": st["grads"]["intra"]["bits_per_element"],
            "grads_inter_bits_per_elt": st["grads"]["inter"]["bits_per_element"],
            "weights_bytes_per_step": st["weights"]["total"]["bytes"] / steps,
            "weights_inter_bytes_per_step": st["weights"]["inter"]["bytes"] / steps,
            "grads_intra_bytes_per_step": st["grads"]["intra"]["bytes"] / steps,
            "grads_inter_bytes_per_step": st["grads"]["inter"]["bytes"] / steps,
            "control_bytes_per_step": st["control"]["total"]["bytes"] / steps,
        }
    base = out["presets"].get("fsdp")
    for p, r in out["presets"].items():
        total = r["weights_bytes_per_step"] + r["grads_intra_bytes_per_step"] + r["grads_inter_bytes_per_step"]
        inter = r["grads_inter_bytes_per_step"]
        r["total_bytes_per_step"] = total
        if base:
            btotal = base["weights_bytes_per_step"] + base["grads_intra_bytes_per_step"] + base["grads_inter_bytes_per_step"]
            r["reduction_vs_fsdp"] = btotal / total if total else float("inf")
            r["grads_inter_reduction_vs_fsdp"] = base["grads_inter_bytes_per_step"] / inter if inter else float("inf")
            between = r["weights_inter_bytes_per_step"] + inter
            base_between = base["weights_inter_bytes_per_step"] + base["grads_inter_bytes_per_step"]
            r["inter_reduction_vs_fsdp"] = base_between / between if between else float("inf")
    return out


def format_table(result: dict[str, Any]) -> str:
    rows = [("preset", "weights intra/inter b/elt", "grads intra/inter b/elt", "bytes/step", "reduction",
             "inter-node reduction")]
    for p, r in result["presets"].items():
        rows.append((p, f"{r['weights_intra_bits_per_elt']:.3f} / {r['weights_inter_bits_per_elt']:.3f}",
                     f"{r['grads_intra_bits_per_elt']:.3f} / {r['grads_inter_bits_per_elt']:.3f}",
                     f"{r['total_bytes_per_step'] / 1e6:.2f} MB", f"{r.get('reduction_vs_fsdp', float('nan')):.2f}x",
                     f"{r.get('inter_reduction_vs_fsdp', float('nan')):.2f}x"))
    lines = aligned(rows)
    head = (f"{result['nodes']} nodes x {result['ranks_per_node']} ranks, model {result['model']}, "
            f"{result['steps']} steps after {result['warmup_steps']} warm-up step (byte meter)")
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(prog="qsdp bench volume", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(BENCH_PRESETS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default="tiny", choices=tuple(MODEL_SIZES))
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1")

    result = measure(args.presets, steps=args.steps, model=args.model)
    result["meta"] = meta("volume", argv, "cpu (gloo)")
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)
