"""Run metrics on disk: ``metrics.jsonl`` (one JSON object a line) and ``summary.json``, and the
schema of the training records.

``metrics.jsonl`` (rank 0 writes; other ranks build the writer with ``enabled=False``), one line
per logged step (:func:`train_record`)::

    step, loss (mean over ranks), lr, grad_norm (before clipping), step_time_s, tokens_per_s,
    wire_bytes_total,
    wire_bytes_{kind}_{level}, bits_per_elt_{kind}_{level}   kind: weights, grads (and
        wire_bytes_control_{level}); level: intra, inter, total
    nonfinite_skipped (steps skipped so far; grad_norm is null on a skipped step)
    hsdp (whether the run shards inside the node and replicates across nodes)

and ``{"step", "val_loss"}`` lines, and with the accuracy guard one ``{"step", "guard": {group,
name, part, from, to, ratio, limit}}`` line per move of a group (``wire_bytes_guard_{level}``
count its exact reductions). Bytes are cumulative since the start of the run (resumes
included) and summed over all ranks (:class:`WireTotals`): the whole job's traffic as the byte
meter counts it (see :mod:`qsdp.comm.meter`), evaluation forwards included.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from qsdp.comm.meter import KINDS, LEVELS, Stats, comm_stats, stats_table

from .files import atomic_write

__all__ = ["MetricsWriter", "write_summary", "read_metrics", "read_summary", "drop_records_after",
           "WireTotals", "train_record", "METRICS_FILE", "SUMMARY_FILE"]

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def _jsonable(obj: Any) -> Any:
    # Tensors and numpy scalars (a loss.item() forgotten, a np.float64) become Python numbers.
    if hasattr(obj, "tolist") and callable(obj.tolist):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"metric value of type {type(obj).__name__} is not JSON serialisable")


class MetricsWriter:
    """Appends one JSON object a line to ``out_dir/metrics.jsonl``, flushed after each line.

    Appending lets a resumed run continue the same file. A last line left incomplete by a crash
    is cut off when the file is opened, so the next record starts on a line of its own.
    """

    def __init__(self, out_dir: str | os.PathLike, enabled: bool = True) -> None:
        self.path = Path(out_dir) / METRICS_FILE
        self.enabled = enabled
        self._file: TextIO | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _drop_partial_last_line(self.path)
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (a flat dict of JSON-able values) as one line; no-op if disabled."""
        if self._file is None:
            return
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_partial_last_line(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        content = f.read()
        if not content.endswith(b"\n"):
            f.truncate(content.rfind(b"\n") + 1)


def write_summary(out_dir: str | os.PathLike, summary: dict[str, Any]) -> str:
    """Write ``out_dir/summary.json`` atomically (temp file + os.replace); returns its path."""
    path = Path(out_dir) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(summary, indent=2, sort_keys=True, default=_jsonable) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    return str(path)


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The dict in ``run_dir/summary.json``; FileNotFoundError naming the path if it is missing."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} has no {SUMMARY_FILE}")
    return json.loads(path.read_text(encoding="utf-8"))


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``run_dir/metrics.jsonl``, in file order.

    A final line without its newline (a writer still running or killed mid-line) is skipped; any
    other malformed line raises ValueError with its line number. A missing file raises
    FileNotFoundError naming the run directory.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} has no {METRICS_FILE}")
    text = path.read_text(encoding="utf-8")
    # The last piece is "" when the file ends with a newline, else an incomplete line: drop it.
    complete = text.split("\n")[:-1]
    records = []
    for lineno, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg})") from None
        if not isinstance(record, dict):
            kind = type(record).__name__
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {kind}")
        records.append(record)
    return records


def drop_records_after(out_dir: str | os.PathLike, step: int) -> None:
    """Rewrite ``metrics.jsonl`` without the records of steps after ``step`` (what an attempt
    that crashed logged past the checkpoint a resume continues from). Rank 0 only."""
    path = Path(out_dir) / METRICS_FILE
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]  # a partial last line is dropped
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and int(record.get("step", 0)) <= step:
            kept.append(line + "\n")
    if len(kept) == len(lines):
        return
    atomic_write(path, lambda f: f.write("".join(kept).encode("utf-8")))


class WireTotals:
    """Cumulative bytes and elements per (kind, level), summed over all ranks; the state a
    checkpoint keeps (:meth:`as_dict`) and restores (the constructor)."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.counts = {kind: {level: [0, 0] for level in LEVELS} for kind in KINDS}
        for kind, per_level in (state or {}).items():
            for level, count in per_level.items():
                if kind in self.counts and level in self.counts[kind]:
                    self.counts[kind][level] = [int(count["bytes"]), int(count["elements"])]

    def collect(self, device: torch.device) -> None:
        """Add what the meter counted on every rank since the last call (collective: one
        all-reduce; a training step instead carries :meth:`local_counts` in its gradient check)."""
        summed = torch.tensor(self.local_counts(), dtype=torch.float64, device=device)
        dist.all_reduce(summed)
        self.add(summed.tolist())  # the one host sync of the collection

    def local_counts(self) -> list[int]:
        """What this rank's meter counted since the last call (and resets it), as a flat list
        for a sum over the ranks that :meth:`add` then takes."""
        stats = comm_stats(reset=True)
        return [stats[kind][level][field] for kind in KINDS for level in LEVELS for field in ("bytes", "elements")]

    def add(self, summed: Sequence[float]) -> None:
        """Add :meth:`local_counts` summed over every rank."""
        values = iter(summed)
        for kind in KINDS:
            for level in LEVELS:
                self.counts[kind][level][0] += int(next(values))
                self.counts[kind][level][1] += int(next(values))

    def total_bytes(self) -> int:
        return sum(count[0] for per_level in self.counts.values() for count in per_level.values())

    def as_dict(self) -> Stats:
        """``{kind: {level or "total": {bytes, elements, bits_per_element}}}``, the meter's format."""
        return stats_table({(kind, level): (count[0], count[1])
                            for kind, per_level in self.counts.items() for level, count in per_level.items()})

    def flat(self) -> dict[str, float]:
        """The ``wire_*`` and ``bits_per_elt_*`` fields of a training record."""
        record: dict[str, float] = {"wire_bytes_total": self.total_bytes()}
        for kind, rows in self.as_dict().items():
            for level, row in rows.items():
                record[f"wire_bytes_{kind}_{level}"] = row["bytes"]
                if kind not in ("control", "guard"):
                    record[f"bits_per_elt_{kind}_{level}"] = round(row["bits_per_element"], 4)
        return record


def train_record(step: int, loss: float, lr: float, grad_norm: float | None, step_time_s: float,
                 tokens_per_step: int, skipped: int, wire: WireTotals) -> dict[str, Any]:
    """One training line of ``metrics.jsonl`` (the schema in the module docstring)."""
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "step_time_s": step_time_s, "tokens_per_s": tokens_per_step / step_time_s,
            "nonfinite_skipped": skipped, **wire.flat()}
