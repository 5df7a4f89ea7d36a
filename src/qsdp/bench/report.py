"""What every benchmark does with its result: say what produced it, save it, print it."""

from __future__ import annotations

import os

from qsdp.config import PRESETS
from qsdp.extras import require
from qsdp.results import cpu_model, emit, host, meta  # noqa: F401  (re-exported: every bench writes through these)

# The presets the benchmarks compare by default, in one order: the baseline first.
BENCH_PRESETS: tuple[str, ...] = tuple(PRESETS)


def description(doc: str | None) -> str:
    """A module docstring's first paragraph as one line, for ``--help``: the whole sentence
    where it runs over more than one line."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


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
