"""Directories a command may clear: only those it marked as its own when it wrote them.

A command that replaces its earlier output (``qsdp demo``, the convergence sweep of ``benchmarks/`` with ``--reuse``)
writes a marker file naming itself into each directory it fills, and clears a directory only
when that marker is there. A directory that holds anything else, a training run of
``qsdp train`` for example, is refused with one line instead: nothing is deleted that the
command did not write.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from qsdp.train.files import atomic_write

__all__ = ["MARKER_FILE", "check_clearable", "clear_owned", "mark_owned"]

MARKER_FILE = ".qsdp-owner.json"


class NotOwnedError(ValueError):
    """A directory holds output that the command clearing it did not write."""


def _owner(directory: Path) -> str | None:
    try:
        return json.loads((directory / MARKER_FILE).read_text(encoding="utf-8")).get("owner")
    except (OSError, ValueError, AttributeError):
        return None


def check_clearable(directory: str | Path, owner: str, names: Iterable[str] | None = None) -> None:
    """Raise :class:`NotOwnedError` unless ``directory`` may be cleared by ``owner``: it does not
    exist, holds none of ``names`` (None: nothing at all besides the marker), or carries
    ``owner``'s marker."""
    path = Path(directory)
    if not path.is_dir():
        if path.exists():
            raise NotOwnedError(f"{path} is not a directory; {owner} writes a directory there: pass another --out")
        return
    present = sorted(p.name for p in path.iterdir() if p.name != MARKER_FILE
                     and (names is None or p.name in set(names)))
    if present and _owner(path) != owner:
        raise NotOwnedError(f"{path} holds {', '.join(present)} that {owner} did not write (no marker "
                            f"{MARKER_FILE} of its own); move it away or pass another --out")


def clear_owned(directory: str | Path, owner: str, names: Iterable[str] | None = None) -> None:
    """Delete ``names`` (None: everything) in ``directory`` after :func:`check_clearable`, then
    mark it as ``owner``'s."""
    path = Path(directory)
    check_clearable(path, owner, names)
    if path.is_dir():
        for child in list(path.iterdir()):
            if child.name == MARKER_FILE or (names is not None and child.name not in set(names)):
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    mark_owned(path, owner)


def mark_owned(directory: str | Path, owner: str) -> None:
    """Write ``owner``'s marker into ``directory`` (created if need be)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / MARKER_FILE, lambda f: f.write(json.dumps({"owner": owner}).encode("utf-8")))
