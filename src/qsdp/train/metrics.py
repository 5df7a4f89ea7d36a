"""Run metrics on disk: ``metrics.jsonl`` (one JSON object a line) and ``summary.json``.

Training lines carry at least ``step``, ``loss``, ``lr``, ``step_time_s``, ``tokens_per_s`` and
``wire_bytes_total`` (cumulative bytes on the wire, all kinds); validation lines carry ``step``
and ``val_loss``. Only rank 0 writes: other ranks build the writer with ``enabled=False``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

from .files import atomic_write

__all__ = ["MetricsWriter", "write_summary", "read_metrics", "read_summary",
           "METRICS_FILE", "SUMMARY_FILE"]

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
