"""Loss curves of one or more runs: against the step and against the bytes put on the wire.

The second plot is the point of quantized communication: at equal loss, how many fewer bytes. Its
first panel counts the bytes between nodes, the scarce links and the ones ``qsdp demo``'s table
reports; its second all the bytes, inside the nodes too (where ``sdp4bit`` gathers exact weights).
Uses matplotlib's object-oriented API with the Agg canvas, so it needs no display and does not
switch the global pyplot backend of the calling program.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qsdp.comm.meter import KINDS
from qsdp.extras import require
from qsdp.train.metrics import METRICS_FILE, SUMMARY_FILE, read_metrics, read_summary

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn
    from matplotlib.figure import Figure

__all__ = ["plot_runs", "loss_figures", "ema_smooth", "LOSS_VS_STEP", "LOSS_VS_BYTES"]

LOSS_VS_STEP = "loss_vs_step.png"
LOSS_VS_BYTES = "loss_vs_bytes.png"


@dataclass
class _Run:
    label: str
    steps: np.ndarray  # [n] train steps, increasing
    loss: np.ndarray  # [n] train loss
    wire_bytes: np.ndarray | None  # [n] cumulative bytes on the wire, None if not recorded
    inter_bytes: np.ndarray | None  # [n] cumulative bytes between nodes, None if not recorded
    val_steps: np.ndarray  # [m]
    val_loss: np.ndarray  # [m]


def ema_smooth(values: np.ndarray, weight: float | None = None) -> np.ndarray:
    """Debiased exponential moving average of a [n] float array (TensorBoard's smoothing).

    ``weight=None`` averages over about n/50 points, so a short run is barely smoothed (an EMA
    lags, which would distort a steep early curve) and a long one is smoothed a lot.
    """
    if weight is None:
        weight = 1.0 - 1.0 / max(1.0, len(values) / 50)
    out = np.empty(len(values), dtype=np.float64)
    avg, norm = 0.0, 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * float(v)
        norm = weight * norm + (1 - weight)
        out[i] = avg / norm  # dividing by the weights' sum removes the bias towards 0
    return out


def _last_per_step(records: list[dict], key: str) -> dict[int, dict]:
    # A resumed run re-logs the steps after its last checkpoint: the later record wins.
    by_step: dict[int, dict] = {}
    for r in records:
        if key in r and "step" in r and r[key] is not None:
            by_step[int(r["step"])] = r
    return dict(sorted(by_step.items()))


def _load_run(run_dir: str) -> _Run:
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"run directory {run_dir!r} does not exist")
    if not (path / METRICS_FILE).is_file():
        raise FileNotFoundError(
            f"run directory {run_dir!r} has no {METRICS_FILE}: not a qsdp run, or not started"
        )
    records = read_metrics(run_dir)
    train = _last_per_step(records, "loss")
    if not train:
        raise ValueError(f"run directory {run_dir!r}: {METRICS_FILE} has no training records "
                         "(lines with 'step' and 'loss')")
    val = _last_per_step(records, "val_loss")
    label = path.resolve().name
    if (path / SUMMARY_FILE).is_file():
        name = (read_summary(run_dir).get("config") or {}).get("name")
        if name:
            label = str(name)
    has_bytes = all("wire_bytes_total" in r for r in train.values())
    has_levels = all(f"wire_bytes_{kind}_inter" in r for r in train.values() for kind in ("weights", "grads"))
    return _Run(
        label=label,
        steps=np.array(list(train), dtype=np.int64),
        loss=np.array([r["loss"] for r in train.values()], dtype=np.float64),
        wire_bytes=(np.array([r["wire_bytes_total"] for r in train.values()], dtype=np.float64)
                    if has_bytes else None),
        inter_bytes=(np.array([sum(r.get(f"wire_bytes_{kind}_inter", 0) for kind in KINDS)
                               for r in train.values()], dtype=np.float64) if has_levels else None),
        val_steps=np.array(list(val), dtype=np.int64),
        val_loss=np.array([r["val_loss"] for r in val.values()], dtype=np.float64),
    )


def _byte_unit(max_bytes: float) -> tuple[float, str]:
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if max_bytes >= scale:
            return scale, unit
    return 1.0, "bytes"


@dataclass(frozen=True)
class _Axis:
    field: str  # the _Run array the x axis reads
    label: str  # x label; "{unit}" is replaced by the byte unit
    title: str


_STEP_AXIS = _Axis("steps", "step", "loss vs step")
_INTER_AXIS = _Axis("inter_bytes", "bytes between nodes ({unit}, cumulative)",
                    "loss vs inter-node bytes (the scarce links)")
_TOTAL_AXIS = _Axis("wire_bytes", "bytes on all links, inside and between nodes ({unit}, cumulative)",
                    "loss vs all bytes communicated")


def _draw(ax, runs: list[_Run], labels: list[str], axis: _Axis) -> None:
    """One panel: each run's raw and smoothed train loss and its validation losses against ``axis``."""
    scale, unit = 1.0, ""
    if axis is not _STEP_AXIS:
        scale, unit = _byte_unit(max(float(getattr(r, axis.field).max()) for r in runs))
    for i, (run, label) in enumerate(zip(runs, labels)):
        color = f"C{i % 10}"
        x = getattr(run, axis.field) / scale
        # x at each validation step, read off the train records' (cumulative, increasing) curve.
        xv = np.interp(run.val_steps, run.steps, x)
        ax.plot(x, run.loss, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(x, ema_smooth(run.loss), color=color, linewidth=1.6, label=f"{label} train")
        if len(run.val_steps):
            ax.plot(xv, run.val_loss, color=color, linestyle="none", marker="o", markersize=4,
                    label=f"{label} val")
    ax.set_xlabel(axis.label.format(unit=unit))
    ax.set_ylabel("loss (cross entropy, nats)")
    ax.set_title(axis.title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def loss_figures(run_dirs: list[str]) -> dict[str, Figure]:
    """The runs' loss curves as matplotlib figures (Agg canvas), by file name:

    - ``loss_vs_step.png``: smoothed train loss, faint raw loss, validation loss as markers;
    - ``loss_vs_bytes.png``: the same against cumulative bytes, in two labelled panels: the bytes
      between nodes (``wire_bytes_{kind}_inter`` summed over kinds; left out when no run recorded
      any, as on one node) and all bytes (``wire_bytes_total``).

    Each run is labelled by ``config.name`` of its summary.json, else its directory name. Raises
    FileNotFoundError for a run without metrics.jsonl, ValueError for a run without training
    records or without ``wire_bytes_total``.
    """
    # matplotlib costs a second to import: loaded only when a plot is drawn.
    require("matplotlib", "plotting loss curves")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    runs = [_load_run(str(d)) for d in run_dirs]
    for d, run in zip(run_dirs, runs):
        if run.wire_bytes is None:
            raise ValueError(f"run directory {str(d)!r}: training records lack 'wire_bytes_total', "
                             "so loss against bytes cannot be plotted")
    # Two runs of the same preset (say, two seeds) need distinct labels.
    labels = [r.label for r in runs]
    for i, (d, run) in enumerate(zip(run_dirs, runs)):
        if labels.count(run.label) > 1:
            labels[i] = f"{run.label} ({Path(d).resolve().name})"

    between_nodes = all(r.inter_bytes is not None for r in runs) and any(r.inter_bytes.max() > 0 for r in runs)
    figures = {}
    for filename, axes in ((LOSS_VS_STEP, [_STEP_AXIS]),
                           (LOSS_VS_BYTES, [_INTER_AXIS, _TOTAL_AXIS] if between_nodes else [_TOTAL_AXIS])):
        fig = Figure(figsize=(7 * len(axes), 4.5), dpi=120)
        FigureCanvasAgg(fig)
        for k, axis in enumerate(axes, start=1):
            _draw(fig.add_subplot(1, len(axes), k), runs, labels, axis)
        fig.tight_layout()
        figures[filename] = fig
    return figures


def plot_runs(run_dirs: list[str], out_dir: str) -> list[str]:
    """Write :func:`loss_figures` of the runs into ``out_dir`` as PNGs; returns their paths
    (``loss_vs_step.png``, ``loss_vs_bytes.png``). Raises as :func:`loss_figures` does."""
    figures = loss_figures(run_dirs)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for filename, fig in figures.items():
        path = os.path.join(out_dir, filename)
        fig.savefig(path)
        paths.append(path)
    return paths
