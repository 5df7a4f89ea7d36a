"""``qsdp presets``: every preset's fields and the bits per element it puts on each link.

The bits come from the code, not from a table kept by hand: :func:`link_bits` sums the wire
sizes of the collectives one steady-state step runs (:func:`qsdp.perfmodel.step_collectives`
and :func:`~qsdp.perfmodel.hsdp_collectives`, built from the comms' own codecs and checked
against the byte meter of real runs) and divides by the elements they carry, as the meter does.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from .config import QuantConfig, config_diff, preset_names, resolve_config
from .hsdp import quantizes_only_replicas
from .perfmodel.collectives import collective_bytes, collective_elements, hsdp_collectives, step_collectives
from .text_table import aligned
from qsdp.usage import UsageParser

# A shard of whole quantization groups, Hadamard blocks and pipeline slices for every preset,
# so the rates shown are the codecs' own, without the padding of one particular model.
SHARD = 1 << 20
NODES, RANKS_PER_NODE = 2, 4
LINKS = (("fsdp", "weights", "intra"), ("fsdp", "weights", "inter"), ("fsdp", "grads", "intra"),
         ("fsdp", "grads", "inter"), ("hsdp", "weights", "intra"), ("hsdp", "grads", "intra"),
         ("hsdp", "grads", "inter"))
HEADER = ["preset", "W intra", "W inter", "G intra", "G inter", "HSDP W intra", "HSDP G intra", "HSDP G inter"]


def link_bits(config: str | QuantConfig, *, shard: int = SHARD, nodes: int = NODES,
              ranks_per_node: int = RANKS_PER_NODE, param_bytes: int = 2,
              grad_bytes: int = 4) -> dict[str, dict[str, dict[str, float | None]]]:
    """Bits per element on each link in one steady-state ZeRO-3 step (weight differences already
    established), for FSDP groups of ``shard`` elements per rank on ``nodes`` x
    ``ranks_per_node`` ranks: ``{"fsdp" | "hsdp": {"weights" | "grads": {"intra" | "inter":
    bits or None}}}``. ``fsdp``: :func:`qsdp.quantize_comms` over every rank; ``hsdp``: with
    ``replicate_group`` (sharded inside the node, ``grads.inter`` is the all-reduce across the
    ``nodes`` replicas; ``fsdp`` is ``None`` for a config that needs it). ``None`` bits: nothing
    travels on that link. ``param_bytes``,
    ``grad_bytes``: sizes of the all-gather and reduce dtypes (2 or 4)."""
    cfg = resolve_config(config)
    kw = {"zero3": True, "param_bytes": param_bytes, "grad_bytes": grad_bytes}
    runs = {"hsdp": hsdp_collectives(cfg, [shard], nodes, ranks_per_node, **kw)}
    out: dict[str, dict[str, dict[str, float | None]] | None] = {"fsdp": None}
    if not quantizes_only_replicas(cfg):  # quantize_comms refuses those without replicate_group
        runs["fsdp"] = step_collectives(cfg, [shard], nodes, ranks_per_node, **kw)
    for mode, collectives in runs.items():
        nbytes, elements = collective_bytes(collectives), collective_elements(collectives)
        out[mode] = {k: {lv: 8 * nbytes[k][lv] / elements[k][lv] if elements[k][lv] else None
                         for lv in ("intra", "inter")} for k in ("weights", "grads")}
    return out


def listing(names: list[str] | None = None, nodes: int = NODES, ranks_per_node: int = RANKS_PER_NODE) -> dict[str, Any]:
    """The JSON of ``qsdp presets``: the assumptions, the default fields, and per preset its
    fields, the ones that differ from the defaults, and :func:`link_bits` for an FSDP group of
    ``nodes`` x ``ranks_per_node`` ranks (a dp x tp mesh's dp group with one rank per node:
    ``ranks_per_node=1``)."""
    defaults = QuantConfig().to_dict()
    presets = {}
    for name in names or preset_names():
        cfg = resolve_config(name)
        presets[name] = {
            "fields": cfg.to_dict(),
            "differs_from_defaults": {k: b for k, _, b in config_diff(defaults, cfg.to_dict()) if k != "name"},
            "bits_per_element": link_bits(cfg, nodes=nodes, ranks_per_node=ranks_per_node),
        }
    return {
        "assumptions": {"shard_elements": SHARD, "nodes": nodes, "ranks_per_node": ranks_per_node,
                        "param_dtype": "bf16", "reduce_dtype": "fp32", "steady_state": True, "zero3": True},
        "defaults": defaults,
        "presets": presets,
    }


def _dotted(fields: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"weights": {"bits": 4}}`` as ``{"weights.bits": 4}``."""
    out: dict[str, Any] = {}
    for k, v in fields.items():
        out.update(_dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def format_listing(data: dict[str, Any]) -> str:
    """:func:`listing` as text: the bits table, then the fields."""
    a = data["assumptions"]
    rows = [HEADER]
    for name, p in data["presets"].items():
        bits = p["bits_per_element"]
        rows.append([name, *(_cell(bits[m], k, lv) for m, k, lv in LINKS)])
    # Explain only the marks the table shows.
    marks = {cell for row in rows[1:] for cell in row[1:]}
    legend = "; ".join(text for mark, text in (("-", "-: nothing travels on that link"),
                                               ("n/a", "n/a: the config needs replicate_group=")) if mark in marks)
    lines = [
        "Bits per element on each link in a steady-state step (W: weight all-gathers, G: gradient",
        f"reductions; {a['param_dtype']} weights, {a['reduce_dtype']} gradients, shards of whole groups).",
        f"FSDP: quantize_comms(model, NAME) on {a['nodes']} node{'s' * (a['nodes'] != 1)} x {a['ranks_per_node']} "
        f"rank{'s' * (a['ranks_per_node'] != 1)}. HSDP: with",
        "replicate_group=, sharded inside the node; HSDP G inter is the all-reduce across replicas.",
        "",
        *aligned(rows, rule=True),
        *([f"({legend})"] if legend else []),
        "",
        "Fields (QuantConfig; each preset lists where it differs from the defaults):",
        _fields_line("defaults", {k: v for k, v in _dotted(data["defaults"]).items() if k != "name"}),
    ]
    for name, p in data["presets"].items():
        lines.append(_fields_line(name, p["differs_from_defaults"]) if p["differs_from_defaults"]
                     else f"  {name}: (the defaults)")
    return "\n".join(lines)


def _cell(bits: dict[str, dict[str, float | None]] | None, kind: str, level: str) -> str:
    if bits is None:
        return "n/a"
    value = bits[kind][level]
    return "-" if value is None else f"{value:.2f}"


def _fields_line(name: str, fields: dict[str, Any]) -> str:
    return textwrap.fill(f"{name}: " + " ".join(f"{k}={v!r}" for k, v in fields.items()), width=100,
                         initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False)


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(prog="qsdp presets", description=(
        "Every preset (or the NAMEs given) with its config fields and the bits per element it puts "
        "on each link, computed from the configs and the wire format."))
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"presets to show (default all: {', '.join(preset_names())})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--nodes", type=int, default=NODES, help=f"nodes the FSDP group spans (default {NODES})")
    parser.add_argument("--ranks-per-node", type=int, default=RANKS_PER_NODE,
                        help=f"ranks of the FSDP group on each node (default {RANKS_PER_NODE}; 1 for the dp group of a "
                             "dp x tp mesh whose dp ranks sit on different nodes)")
    ns = parser.parse_args(argv)
    if ns.nodes < 1 or ns.ranks_per_node < 1:
        parser.error(f"--nodes {ns.nodes} and --ranks-per-node {ns.ranks_per_node} must be positive")
    unknown = [n for n in ns.names if n not in preset_names()]
    if unknown:
        parser.error(f"unknown preset {unknown[0]!r}; allowed: {', '.join(preset_names())}")
    data = listing(ns.names, ns.nodes, ns.ranks_per_node)
    print(json.dumps(data, indent=2) if ns.json else format_listing(data))
    return 0
