"""``qsdp advise``: does quantized communication pay for this job, and which preset?

Given the model size, the nodes, the ranks per node, the GPU type and the inter-node link (one
node's, in bits per second with its unit, ``100gbit`` or ``8x400gbit``; a GPU's share with
``--link-per-gpu``; the GPU type's NICs by default; or measured with ``--measure`` by a real
all-gather between the nodes of the current torchrun world), it predicts the step time of fully
sharded FSDP2 and of HSDP (shard inside the node, replicate across nodes), unquantized and with
each preset, with the performance model :mod:`qsdp.perfmodel` (the one ``qsdp bench simulate``
stands on; with the kernel speeds of ``qsdp bench kernels --save`` when given), says what limits
each (link bytes, all-to-all fan-out, intra-node bytes, codec time, latency, compute, memory) and
recommends the fastest that fits in memory; a quantized setup is recommended only when it is
predicted at least ``--margin`` faster than the best unquantized one. The state per GPU is the
sharded training state plus the weight-difference replicas a preset keeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from .gpt_shape import n_params
from .perfmodel import (
    GPT2_VOCAB,
    HARDWARE,
    SEQ_LEN,
    Hardware,
    cluster_hardware,
    custom_hardware,
    fan_out,
    format_gbit,
    fsdp2_setup,
    gpt_shape,
    limit,
    load_kernels,
    parse_link,
    parse_rate,
    simulate_hsdp_step,
    simulate_step,
)
from .text_table import aligned
from qsdp.usage import UsageParser, number

FLAT_PRESETS = ("fsdp", "qsdp", "zeropp", "sdp4bit")
HSDP_PRESETS = ("fsdp", "hsdp8", "hsdp4", "sdp4bit")
STATE_BYTES_PER_PARAM = 16  # fp32 master weights, gradients and two Adam moments
DEFAULT_GPU = "h800"


# The largest model advise prices: a bound on typing mistakes (1e30), not on what the model can say.
MAX_PARAMS = 10 ** 13


def parse_params(text: str) -> int:
    """``"1.3B"``, ``"350M"``, ``"7e9"`` or ``"125000000"`` -> parameters."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise ValueError(f"--params={text!r}: expected a number such as 1.3B, 350M or 7e9")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    n = int(float(m.group(1)) * scale)
    if n < 1e6:
        raise ValueError(f"--params={text!r}: {n} parameters is too small to be worth sharding")
    if n > MAX_PARAMS:
        raise ValueError(f"--params={text!r}: at most {MAX_PARAMS:.0e} parameters (10 trillion)")
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


def advise(params: int | None, nodes: int, ranks_per_node: int | None = None, gpu: str | Hardware = DEFAULT_GPU, *,
           shape: Mapping[str, int] | None = None, link_gbit: float | None = None,
           link_gbit_per_gpu: float | None = None, intra_gbps: float | None = None,
           kernels: Mapping[str, float] | None = None, seq_len: int = SEQ_LEN, micro_batch: int = 1,
           overlap: float = 0.0, margin: float = 0.05, measured: bool = False,
           host_factor: float | None = None) -> dict[str, Any]:
    """The predictions and the recommendation as a JSON-ready dict (times in ms, bytes in GB per
    GPU per step), for a model of ``params`` parameters (a GPT shape is chosen) or of the given
    ``shape``, on ``nodes`` x ``ranks_per_node`` GPUs (default: the type's per node).

    ``gpu``: a name of :data:`~qsdp.perfmodel.HARDWARE` or a
    :class:`~qsdp.perfmodel.Hardware` (:func:`~qsdp.perfmodel.custom_hardware`). The inter-node
    link, in Gbit/s as the collectives achieve it, as :func:`qsdp.perfmodel.predict_step` takes
    it: ``link_gbit`` one node's, or ``link_gbit_per_gpu`` one GPU's share (``measured``: that
    share was measured); default: the GPU type's NICs. ``intra_gbps``: a GPU's intra-node GB/s
    (default: the type's NVLink). ``host_factor``: the host's time per microsecond of a comm step's
    census host floor (:mod:`qsdp.perfmodel.host_census`; default: the GPU type's, measured on
    its host where known, else 0: not priced). Every row
    names what limits it (``limit``, ``why``)."""
    hw = cluster_hardware(gpu, ranks_per_node, link_gbit=link_gbit, link_gbit_per_gpu=link_gbit_per_gpu,
                          intra_gbps=intra_gbps, host_factor=host_factor)
    m = hw.gpus_per_node
    shape = dict(shape) if shape is not None else gpt_shape(int(params or 0))
    setup = fsdp2_setup(hw.name, nodes, m, shape, seq_len=seq_len, micro_batch=micro_batch)
    params = n_params(setup.gpt())
    rows = []
    for p in FLAT_PRESETS:
        r = simulate_step(setup, p, hw, overlap=overlap, kernels=kernels)
        rows.append(_row("fsdp", p, r, params / (nodes * m), hw))
    if nodes > 1:
        for p in HSDP_PRESETS:
            r = simulate_hsdp_step(setup, p, hw, overlap=overlap, kernels=kernels)
            rows.append(_row("hsdp", p, r, params / m, hw))
    for row in rows:
        row["why"] = _why(row, rows, hw) + _host_verdict(row, rows)
        del row["parts"]
    source = ("measured" if measured else "given per GPU" if link_gbit_per_gpu
              else "given per node" if link_gbit else "default")
    link = {"gbit_per_node": 8 * hw.inter_gbps * m, "gbit_per_gpu": 8 * hw.inter_gbps, "source": source}
    if source == "default":
        link.update(nics=hw.nics, nic_gbit=hw.nic_gbit, efficiency=hw.link_efficiency)
    return {"params": params, "shape": shape, "nodes": nodes, "ranks_per_node": m, "gpu": hw.name,
            "memory_gb": hw.memory_gb, "link": link, "intra_gbps_per_gpu": hw.intra_gbps,
            "intra_source": "given" if intra_gbps else "default", "host_factor": hw.host_factor,
            "host_source": "given" if host_factor is not None else "default", "seq_len": seq_len,
            "micro_batch": micro_batch, "overlap": overlap, "rows": rows, "recommendation": _recommend(rows, margin)}


def _row(layout: str, preset: str, r: Mapping[str, Any], params_per_gpu: float, hw: Hardware) -> dict[str, Any]:
    # The replicas of weight differences (sdp4bit) stay in memory next to the sharded state.
    replica = r["replica_bytes"]
    state_gb = (STATE_BYTES_PER_PARAM * params_per_gpu + replica) / 1e9
    fits = not hw.memory_gb or state_gb <= hw.memory_gb
    parts = r["parts"]
    return {"layout": layout, "preset": preset, "quantized": preset != "fsdp",
            "step_ms": 1e3 * r["step_s"], "compute_ms": 1e3 * r["compute_s"], "comm_ms": 1e3 * r["comm_s"],
            "host_ms": 1e3 * r["host_s"], "launches": r["launches"],
            "nic_gb_per_gpu": parts["nic_bytes"] / 1e9, "intra_gb_per_gpu": parts["intra_bytes"] / 1e9,
            "state_gb_per_gpu": state_gb, "replica_gb_per_gpu": replica / 1e9, "fits": fits,
            "limit": limit(parts, r["compute_s"], r["comm_s"] + r["host_s"], fits), "parts": parts}


def _why(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], hw: Hardware) -> str:
    """What limits ``row``, in words, with the numbers behind it (per GPU per step)."""
    parts, kind = row["parts"], row["limit"]
    ms = lambda key: f"{1e3 * parts[key]:.0f} ms"  # noqa: E731
    if kind == "memory":
        return (f"memory: {row['state_gb_per_gpu']:.1f} GB of training state per GPU, more than the "
                f"{hw.name}'s {hw.memory_gb:.0f} GB (activations come on top)")
    if kind == "compute":
        return (f"compute: communication is {100 * row['comm_ms'] / row['compute_ms']:.0f}% of the compute "
                "time; little for quantization to save")
    nic = f"{row['nic_gb_per_gpu']:.2f} GB cross the NIC ({ms('nic_s')} at {format_gbit(8 * hw.inter_gbps)})"
    if kind == "fan-out":
        base = next(r for r in rows if r["layout"] == row["layout"] and r["preset"] == "fsdp")
        more = (f", more than {_name(base)}'s {base['nic_gb_per_gpu']:.2f} GB"
                if row["nic_gb_per_gpu"] > base["nic_gb_per_gpu"] else "")
        return (f"all-to-all fan-out: its one-level gradient all-to-all sends each rank's rows to the "
                f"{parts['a2a_inter_peers']:.0f} ranks on other nodes, {fan_out(parts):.1f}x what a ring "
                f"puts on the NIC for the same rows: {nic}{more}")
    if kind == "link":
        return f"link bytes: {nic}"
    if kind == "intra":
        fill = parts["replica_fill_bytes"] / 1e9
        replicas = f"; {fill:.2f} GB of them the node replicas' exact weights" if fill else ""
        return (f"intra-node bytes: {row['intra_gb_per_gpu']:.2f} GB over the intra-node link ({ms('intra_s')} "
                f"at {hw.intra_gbps:g} GB/s){replicas}")
    if kind == "host":
        return (f"host: its collectives' calls take {ms('host_s')} of host a step ({hw.host_factor:g} x their "
                f"census host floor; {row['launches']} kernel launches), while the GPU waits")
    if kind == "codec":
        return f"codec time: {ms('codec_s')} quantizing and dequantizing"
    return f"latency: {ms('latency_s')} of per-message latency (small messages, many peers)"


def _host_verdict(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """For a quantized row that would be faster than its layout's unquantized one but for the
    host's time launching its kernels: say so."""
    base = next(r for r in rows if r["layout"] == row["layout"] and r["preset"] == "fsdp")
    saved = base["step_ms"] - (row["step_ms"] - row["host_ms"])
    if not row["quantized"] or saved <= 0 or row["step_ms"] <= base["step_ms"]:
        return ""
    return (f"; quantization costs more than it saves here: {row['host_ms']:.0f} ms of host time for "
            f"{saved:.0f} ms saved over {_name(base)}")


def _recommend(rows: Sequence[Mapping[str, Any]], margin: float) -> dict[str, Any]:
    fit = [r for r in rows if r["fits"]]
    if not fit:
        return {"layout": None, "preset": None, "step_ms": None, "speedup_over_unquantized": None,
                "reason": "no setup fits: the training state alone exceeds the GPU's memory; more GPUs "
                          "or more memory per GPU"}
    best = min(fit, key=lambda r: r["step_ms"])
    plain_rows = [r for r in fit if not r["quantized"]]
    if not plain_rows:
        return {"layout": best["layout"], "preset": best["preset"], "step_ms": best["step_ms"],
                "speedup_over_unquantized": None,
                "reason": "the fastest setup that fits; no unquantized setup fits in the GPU's memory"}
    plain = min(plain_rows, key=lambda r: r["step_ms"])
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


def measure_link_gbit(nbytes: int = 64 << 20, iters: int = 5) -> float:
    """Collective over the current world (``D`` nodes x ``M`` ranks, nodes from the hosts): every rank
    all-gathers ``nbytes`` with the ranks of its local rank on the other nodes, all local ranks
    at once, as the data-parallel groups of a job do. Returns the slowest rank's received bits
    per second per GPU, in Gbit/s (:func:`advise`'s ``link_gbit_per_gpu``)."""
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
    return 8 * (topo.nodes - 1) * chunk.numel() * 4 * iters / float(elapsed.item()) / 1e9


def _link_text(result: Mapping[str, Any]) -> str:
    link, gpu = result["link"], result["gpu"]
    per = f"{format_gbit(link['gbit_per_node'])} per node, {format_gbit(link['gbit_per_gpu'])} per GPU"
    if link["source"] == "default" and link["efficiency"] < 1:
        return (f"inter-node: the {gpu}'s {link['nics']} x {format_gbit(link['nic_gbit'])} NICs at "
                f"{100 * link['efficiency']:.0f}%: {per}")
    if link["source"] == "default":
        return f"inter-node: the {gpu}'s network: {per}"
    if link["source"] == "measured":
        return f"inter-node: measured by an all-gather between the nodes: {per}"
    return f"inter-node: {per} (given)"


def format_text(result: Mapping[str, Any]) -> str:
    s = result["shape"]
    memory = f" ({result['memory_gb']:g} GB)" if result["memory_gb"] else ""
    intra = "given" if result["intra_source"] == "given" else f"the {result['gpu']}'s NVLink"
    lines = [f"{result['params'] / 1e9:.3g}B parameters (GPT {s['n_layer']} x {s['n_embd']}), "
             f"{result['nodes']} nodes x {result['ranks_per_node']} {result['gpu']}{memory}, "
             f"sequence {result['seq_len']} x {result['micro_batch']} per GPU",
             f"{_link_text(result)}; intra-node: {result['intra_gbps_per_gpu']:g} GB/s per GPU ({intra})",
             f"host: {_host_text(result)}", ""]
    rows = [("setup", "step ms", "comm ms", "host ms", "NIC GB", "intra GB", "state GB", "limited by")]
    for r in result["rows"]:
        rows.append((_name(r), f"{r['step_ms']:.1f}", f"{r['comm_ms']:.1f}", f"{r['host_ms']:.1f}",
                     f"{r['nic_gb_per_gpu']:.2f}",
                     f"{r['intra_gb_per_gpu']:.2f}", f"{r['state_gb_per_gpu']:.2f}", r["limit"]))
    lines += aligned(rows)
    rec = result["recommendation"]
    pick = "none" if rec["preset"] is None else _name(rec)
    lines += ["", f"recommended: {pick} ({rec['reason']})", "", "what limits each setup, per GPU and step:"]
    width = max(len(_name(r)) for r in result["rows"])
    lines += [f"  {_name(r):<{width}}  {r['why']}" for r in result["rows"]]
    lines += ["", "predictions of the performance model behind `qsdp bench simulate` (no tensor/pipeline parallelism, "
              f"weights gathered twice per step, {100 * result['overlap']:.0f}% of compute hides communication); "
              "NIC GB, intra GB: bytes per GPU per step on each link (a ring passes every chunk over the intra-node "
              "link); state: fp32 weights, gradients and Adam moments, sharded, plus weight-difference replicas"]
    return "\n".join(lines)


def _host_text(result: Mapping[str, Any]) -> str:
    factor = result["host_factor"]
    if not factor and result["host_source"] == "given":
        return "not priced (--host-factor 0)"
    if not factor:
        return "not priced (no host factor measured for this GPU type; --host-factor sets one)"
    source = "given" if result["host_source"] == "given" else f"measured on the {result['gpu']}'s host"
    return f"{factor:g} x each collective's census host floor ({source})"


def _gpu_list() -> str:
    """The GPU types and what each stands for, for ``--help``."""
    lines = ["GPU types (--gpu; a stated --link, --link-per-gpu or --intra-link replaces the type's):"]
    for name, hw in HARDWARE.items():
        nics = (f"{hw.nics} x {format_gbit(hw.nic_gbit)} NICs at {100 * hw.link_efficiency:.0f}%"
                if hw.link_efficiency < 1 else f"{format_gbit(hw.nics * hw.nic_gbit)} achieved")
        default = " (default)" if name == DEFAULT_GPU else ""
        lines.append(f"  {name}{default}: {hw.gpus_per_node} per node, {hw.memory_gb:g} GB, {hw.tflops:g} TFLOP/s "
                     f"bf16, intra-node {hw.intra_gbps:g} GB/s per GPU, inter-node {nics} per node")
    lines.append("  custom: your figures: --tflops, --hbm, --intra-link, --link (or --link-per-gpu), "
                 "--ranks-per-node, optionally --memory-gb and --mfu")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="qsdp advise", description=__doc__.splitlines()[0], epilog=_gpu_list(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", help="model parameters, e.g. 1.3B, 350M, 7e9 (a GPT shape is chosen)")
    model.add_argument("--config", metavar="FILE", help="a model config JSON (nanoGPT or Hugging Face names)")
    p.add_argument("--nodes", type=number(1, 1 << 20, integer=True), default=None, help="nodes (default: from the torchrun world with --measure)")
    p.add_argument("--ranks-per-node", type=number(1, 1024, integer=True), default=None, help="GPUs per node (default: the GPU type's)")
    p.add_argument("--gpu", choices=[*sorted(HARDWARE), "custom"], default=DEFAULT_GPU,
                   help=f"GPU type and its cluster (default {DEFAULT_GPU}; the list below)")
    link = p.add_mutually_exclusive_group()
    link.add_argument("--link", metavar="RATE", help="one node's inter-node link as the collectives achieve it, in "
                      "bits per second with the unit, or NICs x rate: 100gbit, 400Gbit/s, 3.2tbit, 8x400gbit "
                      "(NCCL gets about 80%% of a NIC's line rate; default: the GPU type's NICs at 80%%)")
    link.add_argument("--link-per-gpu", metavar="RATE", help="the same, one GPU's share: 12.5gbit is 100gbit "
                      "shared by 8 GPUs")
    link.add_argument("--measure", action="store_true", help="measure it: run under torchrun on the nodes")
    p.add_argument("--inter-gbps", type=float, help=argparse.SUPPRESS)  # the old flag, to say what replaced it
    p.add_argument("--intra-link", metavar="RATE", help="a GPU's intra-node bandwidth per direction, with the "
                   "unit: 360GB/s (default: the GPU type's NVLink; PCIe 4.0 x16 nodes: about 25GB/s)")
    p.add_argument("--tflops", type=number(0, low_open=True), help="--gpu custom: bf16 dense peak TFLOP/s per GPU")
    p.add_argument("--hbm", metavar="RATE", help="--gpu custom: memory bandwidth per GPU, e.g. 3350GB/s")
    p.add_argument("--memory-gb", type=number(0, low_open=True), help="--gpu custom: memory per GPU, GB (default: not checked)")
    p.add_argument("--mfu", type=number(0, 1, low_open=True), help="--gpu custom: model FLOPs utilisation (default 0.4)")
    p.add_argument("--kernels", metavar="FILE", help="kernel speeds (qsdp bench kernels --save FILE)")
    p.add_argument("--host-factor", type=number(0), default=None,
                   help="the host's time per microsecond of a collective's census host floor (qsdp bench census) "
                        "(default: the GPU type's: measured for h200, else 0, not priced)")
    p.add_argument("--seq-len", type=number(1, 1 << 24, integer=True), default=SEQ_LEN)
    p.add_argument("--micro-batch", type=number(1, 1 << 20, integer=True), default=1, help="sequences per GPU per step")
    p.add_argument("--overlap", type=number(0, 1), default=0.0, help="fraction of compute that hides communication")
    p.add_argument("--margin", type=number(0, 10), default=0.05,
                   help="how much faster a quantized setup must be (0.05: 5%%)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _hardware(p: argparse.ArgumentParser, args: argparse.Namespace, link_gbit: float | None,
              intra_gbps: float | None) -> str | Hardware:
    """The GPU type, or for ``--gpu custom`` a :class:`Hardware` of the figures given."""
    custom = {"--tflops": args.tflops, "--hbm": args.hbm, "--memory-gb": args.memory_gb, "--mfu": args.mfu}
    if args.gpu != "custom":
        given = [flag for flag, v in custom.items() if v is not None]
        if given:
            p.error(f"{', '.join(given)} describe a --gpu custom; --gpu {args.gpu} has its own")
        return args.gpu
    per_gpu = None if args.link_per_gpu is None else parse_rate(args.link_per_gpu)
    needed = {"--tflops": args.tflops, "--hbm": args.hbm, "--intra-link": intra_gbps, "--link or --link-per-gpu": link_gbit or per_gpu,
              "--ranks-per-node": args.ranks_per_node}
    missing = [flag for flag, v in needed.items() if v is None]
    if missing:
        p.error(f"--gpu custom needs {', '.join(missing)}")
    try:
        return custom_hardware(args.ranks_per_node, tflops=args.tflops, hbm_gbps=parse_rate(args.hbm) / 8,
                               intra_gbps=intra_gbps, link_gbit=link_gbit or per_gpu * args.ranks_per_node,
                               memory_gb=args.memory_gb or 0.0, mfu=0.4 if args.mfu is None else args.mfu)
    except ValueError as e:
        p.error(f"--hbm: {e}" if "is not a rate" in str(e) else str(e))


def _read(p: argparse.ArgumentParser, flag: str, value: str | None, read: Callable[[str], Any]) -> Any:
    """``read(value)`` (None if the flag is not given); a failure is a usage error naming the
    flag and its file."""
    if not value:
        return None
    try:
        return read(value)
    except json.JSONDecodeError as e:
        p.error(f"{flag} {value}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})")
    except OSError as e:
        p.error(f"{flag} {value}: {e.strerror or e}")
    except ValueError as e:
        p.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.inter_gbps is not None:
        p.error(f"--inter-gbps was GB/s per GPU: write --link-per-gpu {args.inter_gbps:g}GB/s, or one node's "
                "link as --link 100gbit or 8x400gbit")
    if args.measure:
        import torch.distributed as dist

        if not dist.is_initialized() and "RANK" not in os.environ:
            p.error(_MEASURE_OUTSIDE_TORCHRUN)
    params = _read(p, "--params", args.params, parse_params)
    shape = _read(p, "--config", args.config, shape_from_config)
    kernels = _read(p, "--kernels", args.kernels, load_kernels)
    rates = {}
    for flag in ("link", "link_per_gpu", "intra_link", "hbm"):  # --hbm: checked here, used by _hardware
        text = getattr(args, flag)
        try:
            rates[flag] = None if text is None else (
                math.prod(parse_link(text)) if flag == "link" else parse_rate(text))
        except ValueError as e:
            p.error(f"--{flag.replace('_', '-')}: {e}")
        if rates[flag] is not None and not math.isfinite(rates[flag]):  # 1e309gbit reads as inf
            p.error(f"--{flag.replace('_', '-')}: {text!r} is not a finite rate")
    intra_gbps = None if rates["intra_link"] is None else rates["intra_link"] / 8
    gpu = _hardware(p, args, rates["link"], intra_gbps)
    measured, speak = None, True
    if args.measure:
        measured, nodes, per_node, speak = _measure()
        args.nodes, args.ranks_per_node = args.nodes or nodes, args.ranks_per_node or per_node
    if args.nodes is None:
        p.error("--nodes is required (or --measure under torchrun)")
    per_gpu = measured if measured is not None else rates["link_per_gpu"]
    result = advise(params, args.nodes, args.ranks_per_node, gpu, shape=shape, link_gbit=rates["link"],
                    link_gbit_per_gpu=per_gpu, intra_gbps=intra_gbps, kernels=kernels, seq_len=args.seq_len,
                    micro_batch=args.micro_batch, overlap=args.overlap, margin=args.margin,
                    measured=measured is not None, host_factor=args.host_factor)
    result["meta"] = {"command": "qsdp advise " + " ".join(argv if argv is not None else sys.argv[1:]),
                      "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                      "device": "analytic model" + (" + measured all-gather" if measured else "")}
    if speak:
        print(json.dumps(result) if args.json else format_text(result))
    if args.measure:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


_MEASURE_OUTSIDE_TORCHRUN = ("--measure runs under torchrun, e.g. torchrun --nnodes 2 --nproc-per-node 8 ... "
                             "-m qsdp.cli advise --measure --params 7B")


def _measure() -> tuple[float, int, int, bool]:
    """Join (or use) the torchrun world, time the all-gather; (Gbit/s per GPU, nodes, ranks per
    node, whether this rank prints)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise SystemExit(_MEASURE_OUTSIDE_TORCHRUN)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from .comm.topology import build_topology

    gbit = measure_link_gbit()
    topo = build_topology(None)  # the same nodes the measurement used
    return gbit, topo.nodes, topo.ranks_per_node, dist.get_rank() == 0


if __name__ == "__main__":
    raise SystemExit(main())
