"""What every benchmark does with its result: say what produced it, save it, print it."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any, Callable

import torch

from qsdp.config import PRESETS
from qsdp.extras import require

# The presets the benchmarks compare by default, in one order: the baseline first.
BENCH_PRESETS: tuple[str, ...] = tuple(PRESETS)
# The convergence ablation: the baseline, the SDP4Bit paper's Table 1 variants (weights alone,
# gradients alone), the presets, QSDP's halves alone, then QSDP's aggressive 4-bit setting.
CONVERGENCE_VARIANTS: tuple[str, ...] = (
    "fsdp", "qw4", "qwd4", "tlq4", "tlq-hs", "sdp4bit", "zeropp", "qsdp", "qsdp-w8", "qsdp-g8",
    "qsdp-w4g4")


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo`` where there is one)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return model


def host() -> str:
    """The machine a CPU timing depends on: its CPU, the cores this process may use and the
    vector instructions torch's CPU kernels use on it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_model()}, {cores} cores, {torch.backends.cpu.get_cpu_capability()}"


def description(doc: str | None) -> str:
    """A module docstring's first paragraph as one line, for ``--help``: the whole sentence
    where it runs over more than one line."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def meta(name: str, argv: list[str] | None, device: str, **extra: Any) -> dict[str, Any]:
    """The ``meta`` block of a result file: the command, torch version, device, host and date."""
    args = argv if argv is not None else sys.argv[1:]
    return {"command": f"qsdp bench {name} " + " ".join(args), "torch": torch.__version__,
            "device": device, "host": host(), "date": time.strftime("%Y-%m-%d"), **extra}


def emit(result: dict[str, Any], *, as_json: bool, save: str | None,
         format_text: Callable[[dict[str, Any]], str]) -> int:
    """Write ``result`` to ``save`` (JSON) if given, print it as one JSON object or as text."""
    if save:
        os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
        with open(save, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result) if as_json else format_text(result))
    return 0


def bar_chart(path: str, labels: list[str], series: dict[str, list[float]], *, ylabel: str,
              title: str) -> str:
    """Grouped bars, one group per label and one bar per series; written as a PNG."""
    # matplotlib costs a second to import: loaded only when a plot is drawn.
    require("matplotlib", "a benchmark chart")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 0.7 * len(labels) * max(1, len(series))), 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def png_next_to(save: str | None) -> str | None:
    """``results/x.json`` -> ``results/x.png`` (plots go beside the saved JSON)."""
    if not save:
        return None
    root, _ = os.path.splitext(save)
    return root + ".png"
