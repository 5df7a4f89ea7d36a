"""``qsdp bench simulate``: the performance model (:mod:`qsdp.perfmodel`) at cluster scale, per
preset, on the setups of the SDP4Bit paper, with its errors against the paper's measurements.

The model (see :mod:`qsdp.perfmodel` and docs/perfmodel.md): the exact wire bytes of every
collective one rank runs in a step, an alpha-beta time for each (rings for all-gathers and plain
reduce-scatters, direct all-to-alls for quantized reduce-scatters, a GPU's share of its node's
NIC), quantization kernels at the speeds of ``qsdp bench kernels`` (``--kernels FILE``) or half
the HBM bandwidth, compute from model FLOPs at an assumed MFU, and communication hidden behind at
most ``--overlap`` of the compute. The SDP4Bit speed runs (Megatron-LM, distributed optimizer, no
``--overlap-grad-reduce``/``--overlap-param-gather``) overlap nothing: 0.

The paper setups (Table 2 of SDP4Bit): GPT 1.3B-18B at sequence 2048, micro-batch 1, one
micro-batch per step, 128 GPUs, the authors' tensor/pipeline-parallel sizes (their README), one
weight all-gather and one gradient reduce-scatter per step over one flat buffer (Megatron's
distributed optimizer), bf16 weights and fp32 gradients on the wire for the baseline.

The model ignores: tensor- and pipeline-parallel communication (folded into the MFU), the
optimizer step, congestion and stragglers, NCCL's protocol and algorithm switching (tree, PAT,
NVLS/SHARP), quantization kernels slowing the compute they overlap, memory-bound small
collectives, and anything else that differs between the paper's cluster and these stated numbers;
its errors against the paper are reported, not fitted.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from ..config import resolve_config
from ..perfmodel import (
    GPT2_VOCAB,
    HARDWARE,
    KERNEL_NAMES,
    PAPER_GPUS,
    MICRO_BATCH,
    MICRO_BATCHES,
    MODEL_SHAPES,
    SEQ_LEN,
    Hardware,
    Setup,
    comm_time,
    kernel_gbps,
    load_kernels,
    model_params,
    shard_sizes,
    simulate_hsdp_step,
    simulate_step,
    step_collectives,
)
from ..text_table import aligned

from .report import BENCH_PRESETS, bar_chart, description, emit, meta, png_next_to
from qsdp.usage import UsageParser, save_path

DEFAULT_PRESETS = BENCH_PRESETS
HSDP_PRESETS = ("fsdp", "hsdp4", "sdp4bit")

# --------------------------------------------------------------------------------------------
# The GPT setups of the SDP4Bit paper.
# --------------------------------------------------------------------------------------------

# Shapes from the authors' Megatron-LM speed scripts (GPT-3 family shapes).
PAPER_MODELS: dict[str, dict[str, int]] = MODEL_SHAPES
# (tensor parallel, pipeline parallel) per model and GPU type: the authors' README.
PAPER_PARALLEL: dict[str, dict[str, tuple[int, int]]] = {
    "1.3B": {"a100": (1, 1), "h800": (1, 1)},
    "2.7B": {"a100": (1, 1), "h800": (1, 1)},
    "6.7B": {"a100": (4, 1), "h800": (4, 1)},
    "13B": {"a100": (4, 2), "h800": (8, 1)},
    "18B": {"a100": (4, 2), "h800": (8, 1)},
}
# Table 2: end-to-end throughput speedup of SDP4Bit over the unquantized baseline, 128 GPUs.
PAPER_SPEEDUP: dict[tuple[str, str], float] = {
    ("1.3B", "a100"): 2.39, ("2.7B", "a100"): 2.43, ("6.7B", "a100"): 3.44,
    ("13B", "a100"): 2.68, ("18B", "a100"): 2.92,
    ("1.3B", "h800"): 1.53, ("2.7B", "h800"): 1.63, ("6.7B", "h800"): 2.97,
    ("13B", "h800"): 3.85, ("18B", "h800"): 4.08,
}
# Table 4: gradient communication of GPT-1.3B on 32 A100, baseline and TLq-HS (fused kernels).
PAPER_TABLE4_MS = {"gpus": 32, "model": "1.3B", "gpu": "a100", "fsdp": 379.3, "tlq-hs": 45.8}


def _hsdp_rows(setup: Setup, hw: Hardware, overlap: float, kernels, flat_fsdp_s: float) -> dict[str, Any]:
    """A case's HSDP entries: step ms per preset (``fsdp`` = FSDP2's native HSDP), and speedups
    over native HSDP and over the flat (fully sharded) fsdp baseline."""
    steps = {p: simulate_hsdp_step(setup, p, hw, overlap=overlap, kernels=kernels)["step_s"] for p in HSDP_PRESETS}
    native = steps["fsdp"]
    return {"hsdp_step_ms": {p: 1e3 * t for p, t in steps.items()},
            "hsdp_speedup_over_native": {p: native / t for p, t in steps.items()},
            "hsdp_speedup_over_fsdp": {p: flat_fsdp_s / t for p, t in steps.items()}}


def _case(setup: Setup, hw: Hardware, presets: Sequence[str], overlap: float, kernels) -> dict[str, Any]:
    steps = {p: simulate_step(setup, p, hw, overlap=overlap, kernels=kernels) for p in presets}
    base = steps["fsdp"]["step_s"]
    nodes, m = steps["fsdp"]["dp_nodes"], steps["fsdp"]["dp_ranks_per_node"]
    return {
        "model": setup.model, "gpus": setup.gpus, "gpu": setup.gpu,
        "nodes": -(-setup.gpus // hw.gpus_per_node), "tp": setup.tp, "pp": setup.pp, "dp": setup.dp,
        "dp_nodes": nodes, "dp_ranks_per_node": m,
        "params": model_params(setup.gpt()),
        "step_ms": {p: 1e3 * r["step_s"] for p, r in steps.items()},
        "breakdown_ms": {p: {k: 1e3 * r[k] for k in ("compute_s", "weights_s", "grads_s", "kernels_s", "exposed_comm_s",
                                                              "host_s")}
                         for p, r in steps.items()},
        "bytes_per_step": {p: r["bytes"] for p, r in steps.items()},
        "speedup": {p: base / r["step_s"] for p, r in steps.items()},
        "predicted_speedup": base / steps["sdp4bit"]["step_s"],
        **_hsdp_rows(setup, hw, overlap, kernels, base),
    }


def _table4(hw: Hardware, kernels) -> dict[str, Any]:
    setup = Setup("1.3B", "a100", PAPER_TABLE4_MS["gpus"], 1, 1)
    nodes, m = setup.dp_topology(hw.gpus_per_node)
    out: dict[str, Any] = {"model": "1.3B", "gpus": setup.gpus, "gpu": hw.name, "dp_nodes": nodes,
                           "dp_ranks_per_node": m}
    for name, preset in (("fsdp", "fsdp"), ("tlq-hs", "tlq-hs")):
        colls = [c for c in step_collectives(preset, shard_sizes(setup), nodes, m, zero3=False)
                 if c.kind == "grads"]
        pred = 1e3 * comm_time(colls, hw, nodes, m, kernels)["grads"]
        paper = PAPER_TABLE4_MS[name]
        out[name] = {"predicted_ms": pred, "paper_ms": paper, "rel_error": (pred - paper) / paper}
    return out


def run(gpus_types: Sequence[str] = PAPER_GPUS, *, overrides: Mapping[str, Any] | None = None,
        overlap: float = 0.0, kernels: Mapping[str, float] | None = None,
        presets: Sequence[str] = DEFAULT_PRESETS, layout: str = "flat", zero3: bool = False,
        scale_model: str = "6.7B", scale_gpus: Sequence[int] = (16, 32, 64, 128, 256, 512, 1024),
        models: Sequence[str] = tuple(PAPER_MODELS)) -> dict[str, Any]:
    """The whole simulation as a JSON-ready dict: ``cases`` (the paper's Table 2 setups),
    ``scale`` (``scale_model`` from 16 to 1024 GPUs, weak scaling: one sequence per DP rank)."""
    presets = list(dict.fromkeys(["fsdp", *presets, "sdp4bit"]))
    for p in presets:
        resolve_config(p)
    hws = {g: dataclasses.replace(HARDWARE[g], **(overrides or {})) for g in gpus_types}
    cases, scale = [], []
    for gpu, hw in hws.items():
        for model in models:
            tp, pp = PAPER_PARALLEL[model][gpu]
            case = _case(Setup(model, gpu, 128, tp, pp, layout=layout, zero3=zero3), hw, presets, overlap, kernels)
            paper = PAPER_SPEEDUP.get((model, gpu))
            case["paper_speedup"] = paper
            case["rel_error"] = None if paper is None else (case["predicted_speedup"] - paper) / paper
            cases.append(case)
        tp, pp = PAPER_PARALLEL[scale_model][gpu]
        for n in scale_gpus:
            if n % (tp * pp) or n < tp * pp:
                continue
            c = _case(Setup(scale_model, gpu, n, tp, pp, layout=layout, zero3=zero3), hw, presets, overlap, kernels)
            scale.append({k: c[k] for k in ("model", "gpus", "gpu", "nodes", "tp", "pp", "dp", "dp_nodes",
                                             "dp_ranks_per_node", "step_ms", "speedup", "predicted_speedup", "hsdp_step_ms")})
    errs = [abs(c["rel_error"]) for c in cases if c["rel_error"] is not None]
    return {
        "cases": cases,
        "scale": scale,
        "table4": _table4(hws["a100"], kernels) if "a100" in hws else None,
        "mean_abs_rel_error": sum(errs) / len(errs) if errs else None,
        "hardware": {g: {**{k: v for k, v in dataclasses.asdict(hw).items() if k != "notes"},
                         "quant_gbps": (kernels or {}).get("quantize", hw.quant_gbps)}
                     for g, hw in hws.items()},
        "assumptions": assumptions(hws, overlap, kernels, layout, zero3),
    }


def assumptions(hws: Mapping[str, Hardware], overlap: float, kernels, layout: str, zero3: bool) -> list[str]:
    out = []
    for g, hw in hws.items():
        out += [f"{g}: {n}" for n in hw.notes]
        if kernels:
            q = "from --kernels: " + ", ".join(
                f"{k} {kernel_gbps(hw, kernels, k):.0f} GB/s" for k in KERNEL_NAMES)
        else:
            q = f"{hw.quant_hbm_fraction:g} x HBM = {hw.quant_gbps:.0f} GB/s (no kernel benchmark given)"
        out.append(f"{g}: quantize/dequantize bandwidth {q}, in GB/s of the fp32/bf16 tensor")
        out.append(f"{g}: latency {hw.intra_latency_us:g} us per NVLink step, {hw.inter_latency_us:g} us per inter-node step")
    out += [
        f"communication hides behind at most {overlap:g} of the compute time (the paper's Megatron "
        "speed runs use no --overlap-grad-reduce/--overlap-param-gather: 0)",
        f"GPT shapes of the paper's scripts, sequence {SEQ_LEN}, micro-batch {MICRO_BATCH}, "
        f"{MICRO_BATCHES} micro-batch per step, vocabulary {GPT2_VOCAB} padded to 128*TP, tied embeddings",
        ("one flat data-parallel buffer (Megatron distributed optimizer)" if layout == "flat"
         else "one FSDP group per transformer block plus one for the rest")
        + (", weights gathered twice per step (ZeRO-3)" if zero3 else ", weights gathered once per step"),
        "baseline (fsdp): bf16 weights in a ring all-gather, fp32 gradients in a ring reduce-scatter",
        "all-gathers/reduce-scatters are rings; quantized reduce-scatters are direct all-to-alls; "
        "every GPU of a node communicates at once, each with 1/G of the node's NIC bandwidth",
    ]
    return out


# --------------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------------


def format_table(result: dict[str, Any]) -> str:
    presets = list(result["cases"][0]["step_ms"]) if result["cases"] else []
    others = [p for p in presets if p not in ("fsdp", "sdp4bit")]
    head = ("model", "gpu", "GPUs", "TP", "PP", "DP (DxM)", "fsdp ms", "sdp4bit ms",
            *[f"{p} x" for p in others], "predicted", "paper", "rel.err")
    rows = [head]
    for c in result["cases"]:
        rows.append((
            c["model"], c["gpu"], str(c["gpus"]), str(c["tp"]), str(c["pp"]),
            f"{c['dp']} ({c['dp_nodes']}x{c['dp_ranks_per_node']})",
            f"{c['step_ms']['fsdp']:.1f}", f"{c['step_ms']['sdp4bit']:.1f}",
            *[f"{c['speedup'][p]:.2f}" for p in others],
            f"{c['predicted_speedup']:.2f}x",
            "-" if c["paper_speedup"] is None else f"{c['paper_speedup']:.2f}x",
            "-" if c["rel_error"] is None else f"{100 * c['rel_error']:+.0f}%",
        ))
    lines = ["SDP4Bit Table 2 setups: predicted speedup of sdp4bit over fsdp (analytic model)", *aligned(rows)]
    if result.get("mean_abs_rel_error") is not None:
        lines.append(f"mean |relative error| {100 * result['mean_abs_rel_error']:.0f}%")
    if result["cases"]:
        lines.append("")
        lines.append("step breakdown, ms (compute / weights / grads, kernels included in comm):")
        for c in result["cases"]:
            parts = "  ".join(
                f"{p}: {b['compute_s']:.0f}/{b['weights_s']:.0f}/{b['grads_s']:.0f}"
                for p, b in c["breakdown_ms"].items() if p in ("fsdp", "sdp4bit"))
            lines.append(f"  {c['model']:>5} {c['gpu']}: {parts}")
    if result["scale"]:
        lines.append("")
        lines.append("scale (weak scaling, one sequence per data-parallel rank): predicted sdp4bit speedup")
        rows = [("model", "gpu", "GPUs", "nodes", "DP (DxM)", "fsdp ms", "sdp4bit ms", "speedup")]
        for s in result["scale"]:
            rows.append((s["model"], s["gpu"], str(s["gpus"]), str(s["nodes"]),
                         f"{s['dp']} ({s['dp_nodes']}x{s['dp_ranks_per_node']})",
                         f"{s['step_ms']['fsdp']:.1f}", f"{s['step_ms']['sdp4bit']:.1f}",
                         f"{s['predicted_speedup']:.2f}x"))
        lines += aligned(rows)
    lines += _format_hsdp(result)
    t4 = result.get("table4")
    if t4:
        lines.append("")
        lines.append(f"Table 4 check, gradient communication of GPT-1.3B on {t4['gpus']} A100: "
                     f"fsdp {t4['fsdp']['predicted_ms']:.1f} ms (paper {t4['fsdp']['paper_ms']}, the A100 "
                     f"network was derived from it), TLq-HS {t4['tlq-hs']['predicted_ms']:.1f} ms "
                     f"(paper {t4['tlq-hs']['paper_ms']}, {100 * t4['tlq-hs']['rel_error']:+.0f}%)")
    lines.append("")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in result["assumptions"]]
    return "\n".join(lines)


def _format_hsdp(result: dict[str, Any]) -> list[str]:
    rows = [("model", "gpu", "GPUs", "DP (DxM)", "fsdp ms", *[f"HSDP {p} ms" for p in HSDP_PRESETS],
             *[f"{p} x native" for p in HSDP_PRESETS[1:]])]
    for c in [*result["cases"], *result["scale"]]:
        if "hsdp_step_ms" not in c:
            continue
        h = c["hsdp_step_ms"]
        rows.append((c["model"], c["gpu"], str(c["gpus"]), f"{c['dp']} ({c['dp_nodes']}x{c['dp_ranks_per_node']})",
                     f"{c['step_ms']['fsdp']:.1f}", *[f"{h[p]:.1f}" for p in HSDP_PRESETS],
                     *[f"{h['fsdp'] / h[p]:.2f}" for p in HSDP_PRESETS[1:]]))
    if len(rows) == 1:
        return []
    return ["", "HSDP (shard inside the node, replicate across nodes; HSDP fsdp = FSDP2's native "
            "HSDP, fp32 all-reduce): predicted step", *aligned(rows)]


_HW_FLAGS = {
    "gpus_per_node": int, "tflops": float, "mfu": float, "hbm_gbps": float, "intra_gbps": float,
    "inter_gbps": float, "intra_latency_us": float, "inter_latency_us": float, "quant_hbm_fraction": float,
    # the host's time per microsecond of a collective's census host floor (0 on the paper's GPU
    # types: not priced)
    "host_factor": float,
}


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(prog="qsdp bench simulate", description=description(__doc__))
    parser.add_argument("--gpu", choices=[*PAPER_GPUS, "all"], default="all",
                        help="the paper's GPU type(s) and their clusters")
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    parser.add_argument("--models", nargs="+", choices=list(PAPER_MODELS), default=list(PAPER_MODELS))
    parser.add_argument("--kernels", metavar="FILE", help='kernel benchmark JSON {"kernels": {"quantize": {"gbps": ..}, ...}}')
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="fraction of the compute time that can hide communication (default 0, as in the paper's runs)")
    parser.add_argument("--layout", choices=("flat", "layer"), default="flat")
    parser.add_argument("--zero3", action="store_true", help="gather weights before forward and backward")
    parser.add_argument("--scale-model", choices=list(PAPER_MODELS), default="6.7B")
    parser.add_argument("--scale-gpus", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    for name, typ in _HW_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=typ, default=None,
                            help=f"override the hardware presets' {name}")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    args = parser.parse_args(argv)
    if not 0.0 <= args.overlap <= 1.0:
        parser.error(f"--overlap={args.overlap} must be in [0, 1]")
    overrides = {k: getattr(args, k) for k in _HW_FLAGS if getattr(args, k) is not None}
    for k, v in overrides.items():
        if not math.isfinite(v) or v <= 0:  # nan compares false with everything: name it
            parser.error(f"--{k.replace('_', '-')}={v} must be a positive finite number")
    bad = [n for n in args.scale_gpus if n < 1]
    if bad:
        parser.error(f"--scale-gpus: {', '.join(map(str, bad))} must be positive numbers of GPUs")
    kernels = None
    if args.kernels:
        try:
            kernels = load_kernels(args.kernels)
        except (OSError, ValueError) as e:
            parser.error(f"--kernels: {e}")
    gpus = list(PAPER_GPUS) if args.gpu == "all" else [args.gpu]
    try:
        result = run(gpus, overrides=overrides, overlap=args.overlap, kernels=kernels, presets=args.presets,
                     layout=args.layout, zero3=args.zero3, scale_model=args.scale_model,
                     scale_gpus=args.scale_gpus, models=args.models)
    except ValueError as e:
        parser.error(str(e))
    result["meta"] = meta("simulate", argv, "analytic model")
    png = png_next_to(args.save)
    if png:
        plot(result, png)
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)


def plot(result: dict[str, Any], path: str) -> str:
    """Predicted against reported ``sdp4bit`` speedup for every paper case."""
    cases = result["cases"]
    return bar_chart(path, [f"{c['model']} {c['gpu']}" for c in cases],
                     {"predicted": [c["predicted_speedup"] for c in cases],
                      "paper (Table 2)": [c["paper_speedup"] for c in cases]},
                     ylabel="sdp4bit speedup over fsdp", title="SDP4Bit setups, 128 GPUs: alpha-beta model vs paper")


if __name__ == "__main__":
    raise SystemExit(main())
