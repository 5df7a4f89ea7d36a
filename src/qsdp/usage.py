"""Command-line input checks shared by every ``qsdp`` subcommand: one error line, ranges.

Every parser of a subcommand is a :class:`UsageParser`: a usage error is one line
``qsdp: error: ...`` on stderr and exit code 2 (argparse's default prints the usage as well).
The ``type=`` helpers refuse a value out of range, NaN or infinite while the arguments are parsed,
and :func:`save_path` refuses a ``--save FILE`` that could not be written, before any work starts.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["PROG", "EXIT_USAGE", "UsageParser", "number", "save_path"]

PROG = "qsdp"
EXIT_USAGE = 2


class UsageParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: ``qsdp: error: ...`` (exit code 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


def _interval(low: float | None, high: float | None, low_open: bool, integer: bool) -> str:
    if integer:
        if high is None:
            return f"an integer of at least {low}"
        return f"an integer from {low} to {high}"
    left = "-inf" if low is None else f"{low:g}"
    right = "inf" if high is None else f"{high:g}"
    return f"in {'(' if low_open or low is None else '['}{left}, {right}{')' if high is None else ']'}"


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           integer: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number (an ``int`` if ``integer``) in ``[low, high]``
    (``(low, high]`` if ``low_open``; None: unbounded on that side)."""

    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{'an integer' if integer else 'a number'} is needed, "
                                             f"got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_interval(low, high, low_open, integer)}, got {text!r}")
        return value

    parse.__name__ = "integer" if integer else "number"
    return parse


def save_path(text: str) -> str:
    """An argparse ``type`` for ``--save FILE``: refused at once if ``FILE`` is a directory or
    its directory cannot be created or written, not after the measurement."""
    path = Path(text)
    if not text or path.is_dir() or text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give the name of the file to write")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    try:  # what os.access cannot tell: root on a read-only file system, /proc, a full disk
        with tempfile.TemporaryFile(dir=parent, prefix=".qsdp-write-test-"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {e.strerror or e}") from None
    return text
