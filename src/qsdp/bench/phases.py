"""``qsdp bench phases``: where the time of a training step goes, per phase, per preset.

Runs the benchmark workload (:mod:`qsdp.bench.workload`: a GPT under FSDP2 + qsdp, random
tokens) as local workers on loopback, 2 nodes x 2 ranks by default, so the link costs nothing and
every difference to ``fsdp`` is work on the host. The timed steps run under ``torch.profiler`` on
every rank; the host time inside FSDP2's own labelled regions (and the optimizer's) is summed
per step and averaged over the ranks:

* ``weights_gather``: ``FSDP::all_gather``, the shard's encoding (quantization, weight
  difference, replica bookkeeping) and the launch of the collective;
* ``weights_wait_decode``: ``FSDP::all_gather_copy_out``, waiting for the gathered bytes and
  decoding them into the unsharded parameters;
* ``grads_reduce``: ``FSDP::post_backward_reduce`` (+ ``post_backward_rs_wait`` and the root's
  end-of-backward callback), quantization, the exchange and the dequantize-sum of gradients;
* ``optimizer``: the optimizer's step and ``zero_grad`` (with qsdp's post-step hook);
* ``barrier``: the workload's barriers around each step, i.e. waiting for the slowest rank;
* ``compute_other``: the rest of the step, the forward and backward math and Python overhead.

The profiler adds its own cost to every recorded op (most in ``compute_other``), equally in
every preset; the step time without it is what ``qsdp bench cluster`` reports.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from qsdp.config import resolve_config
from qsdp.launch import launch_local
from qsdp.text_table import aligned

from .report import BENCH_PRESETS, emit, meta
from .step_phases import PHASES
from .workload import run_steps
from qsdp.train.model import MODEL_SIZES
from qsdp.usage import UsageParser, save_path


def _worker(preset: str, steps: int, warmup: int, model: str, seq_len: int, batch_size: int,
            ranks_per_node: int) -> dict[str, Any]:
    return run_steps(preset, steps, model, seq_len, batch_size, ranks_per_node, warmup, profile=True)


def measure(presets: Sequence[str], *, nproc: int = 4, ranks_per_node: int = 2, steps: int = 10,
            warmup: int = 2, model: str = "tiny", seq_len: int = 64, batch_size: int = 4) -> dict[str, Any]:
    """Profile every preset in its own process group; phases averaged over the ranks."""
    for p in presets:
        resolve_config(p)
    rows: dict[str, Any] = {}
    for i, preset in enumerate(presets, 1):
        print(f"[{i}/{len(presets)}] {preset}", file=sys.stderr, flush=True)
        results = launch_local(_worker, nproc, preset, steps, warmup, model, seq_len, batch_size, ranks_per_node)
        per_rank = [results[r] for r in sorted(results)]
        phases = {ph: sum(r["phases_s"][ph] for r in per_rank) / len(per_rank) for ph in PHASES}
        rows[preset] = {"step_s": sum(phases.values()), "phases_s": phases}
    base = rows.get(presets[0])
    for row in rows.values():
        row["extra_vs_baseline_s"] = {ph: row["phases_s"][ph] - base["phases_s"][ph] for ph in PHASES}
        row["step_ratio_vs_baseline"] = row["step_s"] / base["step_s"]
    return {"baseline": presets[0], "nproc": nproc, "ranks_per_node": ranks_per_node, "model": model,
            "seq_len": seq_len, "batch_size": batch_size, "steps": steps, "warmup": warmup,
            "phases": list(PHASES), "presets": rows}


def format_table(result: dict[str, Any]) -> str:
    base = result["baseline"]
    head = ("preset", "step ms", f"x {base}", *PHASES)
    lines = [head]
    for p, row in result["presets"].items():
        lines.append((p, f"{1e3 * row['step_s']:.1f}", f"{row['step_ratio_vs_baseline']:.2f}",
                      *(f"{1e3 * row['phases_s'][ph]:.1f}" for ph in PHASES)))
        if p != base:
            lines.append(("  vs " + base, f"{1e3 * (row['step_s'] - result['presets'][base]['step_s']):+.1f}", "",
                          *(f"{1e3 * row['extra_vs_baseline_s'][ph]:+.1f}" for ph in PHASES)))
    text = aligned(lines, rule=True)
    title = (f"ms per step (host, profiled, mean of {result['nproc']} ranks as "
             f"{result['nproc'] // result['ranks_per_node']} nodes x {result['ranks_per_node']} on loopback), "
             f"GPT '{result['model']}', {result['steps']} steps")
    return "\n".join([title, *text])


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(prog="qsdp bench phases", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(BENCH_PRESETS),
                        help="presets or variants; the first is the baseline of the differences")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per preset")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default="tiny", choices=tuple(MODEL_SIZES))
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    if args.nproc < 2 or args.nproc % args.ranks_per_node:
        parser.error(f"--nproc={args.nproc} must be at least 2 and a multiple of --ranks-per-node={args.ranks_per_node}")
    result = measure(args.presets, nproc=args.nproc, ranks_per_node=args.ranks_per_node, steps=args.steps,
                     warmup=args.warmup, model=args.model, seq_len=args.seq_len, batch_size=args.batch_size)
    result["meta"] = meta("phases", argv, "cpu (gloo), loopback")
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)
