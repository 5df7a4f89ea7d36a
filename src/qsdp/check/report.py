"""The check's result: JSON-ready data, and the table per layer with its summary."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..text_table import aligned
from .measure import GroupSums, Measurement, as_dict
from .verdict import (
    DELTA_LIMIT,
    GRAD_RATIO_LIMIT,
    GRAD_RATIO_VALIDATED,
    LEVELS,
    TOLERANCE,
    WEIGHT_RATIO_LIMIT,
    Ratios,
    judge,
    sgd_var_note,
)


def _total(groups: list[GroupSums]) -> GroupSums:
    total = GroupSums()
    for s in groups:
        total.add(dataclasses.asdict(s))
    return total


def result(m: Measurement) -> dict[str, Any]:
    """Per layer and in total: the ratios, the verdict with its reasons and fixes, the sums."""
    layers = []
    for name, numel, sums in m.groups:
        r = Ratios.of(sums)
        layers.append({"layer": name, "params": numel, **dataclasses.asdict(r),
                       **dataclasses.asdict(judge(r, m.config)), "sums": dataclasses.asdict(sums)})
    total_sums = _total([s for _, _, s in m.groups])
    r = Ratios.of(total_sums, total=True)
    worst = max((LEVELS.index(x["level"]) for x in layers), default=0)
    total = {"layer": "total", "params": m.n_params, **dataclasses.asdict(r),
             **dataclasses.asdict(judge(r, m.config)), "sums": dataclasses.asdict(total_sums)}
    return {
        **as_dict(m), "preset": m.config.name, "layers": layers, "total": total,
        "verdict": LEVELS[max(worst, LEVELS.index(total["level"]))],
        "calibration_note": sgd_var_note([(x["layer"], x["grad_sgd"]) for x in layers], m.config),
        "thresholds": {"weight_ratio_limit": WEIGHT_RATIO_LIMIT, "grad_ratio_validated": GRAD_RATIO_VALIDATED,
                       "grad_ratio_limit": GRAD_RATIO_LIMIT, "delta_limit": DELTA_LIMIT,
                       "tolerance": TOLERANCE},
    }


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def format_table(res: dict[str, Any]) -> str:
    """The table per layer, the total, then each layer's reasons and fixes and the verdict."""
    spec = res["spec"]
    head = (f"qsdp check: {spec['model']} ({res['n_params'] / 1e6:.2f}M parameters), preset {res['preset']}, "
            f"{spec['nodes']} nodes x {spec['ranks_per_node']} ranks, {spec['batch_size']} x {spec['seq_len']} "
            f"tokens per rank, {spec['warmup_steps']} + {spec['steps']} measured steps at lr {spec['lr']:g}, "
            f"weights in {spec['param_dtype']}, on {spec['device']}, {res['wall_time_s']:.0f} s")
    rows = [("layer", "params", "grad q-var", "SGD var", "q/SGD", "w err/step", "delta", "gap (pred)", "verdict")]
    for x in [*res["layers"], res["total"]]:
        rows.append((x["layer"], f"{x['params']:,}", _num(x["grad_qvar"]), _num(x["grad_sgd"]),
                     _num(x["grad_ratio"]), _num(x["weight_ratio"], ".2f"), _num(x["delta"]),
                     _pct(x["predicted_gap"]), x["level"]))
    lines = aligned(rows, rule=True)
    lines.insert(len(lines) - 1, lines[1])
    notes, fixes = [], []
    for x in [*res["layers"], res["total"]]:
        notes += [f"{x['layer']}: {reason}" for reason in x["reasons"]]
        fixes += [f for f in x["fixes"] if f not in fixes]
    if fixes:
        notes.append("try: " + "; or ".join(fixes))
    if res.get("calibration_note"):
        notes.append(res["calibration_note"])
    t = res["thresholds"]
    legend = (f"q/SGD: variance the gradient path adds / variance SGD's step already has (ok <= "
              f"{t['grad_ratio_validated']:g}, shown harmless; fail > {t['grad_ratio_limit']:g}). "
              f"w err/step: ||weights seen - weights|| / ||one step's update|| (fail > "
              f"{t['weight_ratio_limit']:.1f}). delta: weight-difference compressor's relative error "
              f"(fail >= {t['delta_limit']:g}). gap (pred): final-loss gap predicted from the total w err/step.")
    return "\n".join([head, *lines, *notes, legend, f"verdict: {res['verdict'].upper()}"])


def format_comparison(results: list[dict[str, Any]]) -> str:
    """One line per preset: the totals, the worst layer's gradient ratio and the verdict."""
    rows = [("preset", "grad q-var", "q/SGD", "worst layer q/SGD", "w err/step", "delta", "gap (pred)", "verdict")]
    for res in results:
        t = res["total"]
        worst = max((x["grad_ratio"] or 0.0 for x in res["layers"]), default=0.0)
        rows.append((res["preset"], _num(t["grad_qvar"]), _num(t["grad_ratio"]), _num(worst),
                     _num(t["weight_ratio"], ".2f"), _num(t["delta"]), _pct(t["predicted_gap"]), res["verdict"]))
    return "\n".join(aligned(rows, rule=True))


def format_text(res: dict[str, Any]) -> str:
    """One result's table, or several results' tables and their comparison."""
    if "results" not in res:
        return format_table(res)
    return "\n\n".join([*map(format_table, res["results"]), format_comparison(res["results"])])
