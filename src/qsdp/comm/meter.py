"""The byte meter: what every collective actually put on the wire.

Counts are logical point-to-point traffic from this rank: a buffer of ``B`` bytes delivered to
``k`` other ranks counts ``k * B`` bytes (what a direct or ring algorithm sends), split by
whether the destination is in this rank's node (``intra``) or another node (``inter``). Elements
are counted the same way, so ``8 * bytes / elements`` is the bits per element that travelled,
padding and scales included. Bytes that never leave the rank (its own chunk) are not counted.

Meters nest: each :func:`qsdp.quantize_comms` handle owns one whose ``parent`` is the
process-wide :data:`METER`, so a handle counts its own model's traffic (two models in one
process keep separate counts) while :func:`comm_stats` still sees everything.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from ..text_table import aligned

KINDS = ("weights", "grads", "control", "guard")
LEVELS = ("intra", "inter")

Stats = dict[str, dict[str, dict[str, float]]]


@dataclass
class Count:
    bytes: int = 0
    elements: int = 0


def bits_per_element(nbytes: int, elements: int) -> float:
    return 8.0 * nbytes / elements if elements else 0.0


def stats_table(counts: Mapping[tuple[str, str], tuple[int, int]]) -> Stats:
    """``{(kind, level): (bytes, elements)}`` as ``{kind: {level or "total": {"bytes",
    "elements", "bits_per_element"}}}`` for every kind and level (missing slots count zero):
    the one format of :func:`comm_stats`, :meth:`ByteMeter.snapshot` and the training metrics."""
    out: Stats = {}
    for kind in KINDS:
        rows: dict[str, dict[str, float]] = {}
        total_bytes = total_elements = 0
        for level in LEVELS:
            nbytes, elements = counts.get((kind, level), (0, 0))
            rows[level] = {"bytes": nbytes, "elements": elements,
                           "bits_per_element": bits_per_element(nbytes, elements)}
            total_bytes += nbytes
            total_elements += elements
        rows["total"] = {"bytes": total_bytes, "elements": total_elements,
                         "bits_per_element": bits_per_element(total_bytes, total_elements)}
        out[kind] = rows
    return out


class ByteMeter:
    """Thread-safe accumulator of bytes and elements per (kind, level).

    ``parent``: a meter that receives every record of this one as well (the handles' meters
    pass theirs to the process-wide :data:`METER`).
    """

    def __init__(self, parent: ByteMeter | None = None) -> None:
        self.parent = parent
        self._lock = threading.Lock()
        self._counts = {(k, lv): Count() for k in KINDS for lv in LEVELS}

    def record(self, kind: str, level: str, nbytes: int, elements: int) -> None:
        if kind not in KINDS or level not in LEVELS:
            raise ValueError(f"unknown meter slot ({kind!r}, {level!r})")
        with self._lock:
            c = self._counts[(kind, level)]
            c.bytes += int(nbytes)
            c.elements += int(elements)
        if self.parent is not None:
            self.parent.record(kind, level, nbytes, elements)

    def record_peers(self, kind: str, nbytes: int, elements: int, n_intra: int, n_inter: int) -> None:
        """One buffer of ``nbytes`` carrying ``elements`` sent to ``n_intra`` + ``n_inter`` peers."""
        if n_intra:
            self.record(kind, "intra", nbytes * n_intra, elements * n_intra)
        if n_inter:
            self.record(kind, "inter", nbytes * n_inter, elements * n_inter)

    def add(self, entries: tuple[tuple[tuple[str, str], int, int], ...]) -> None:
        """Record ``entries`` (:func:`peer_entries`: ``((kind, level), bytes, elements)`` each, the
        slots checked when they were made) here and in every parent, one lock each: a plan's
        meter entries, made once, recorded at every call."""
        meter = self
        while meter is not None:
            with meter._lock:
                counts = meter._counts
                for slot, nbytes, elements in entries:
                    c = counts[slot]
                    c.bytes += nbytes
                    c.elements += elements
            meter = meter.parent

    def snapshot(self, reset: bool = False) -> Stats:
        """``{kind: {level: {"bytes", "elements", "bits_per_element"}, "total": {...}}}``;
        ``reset`` zeroes this meter (not its parent)."""
        with self._lock:
            counts = {slot: (c.bytes, c.elements) for slot, c in self._counts.items()}
            if reset:
                self._counts = {(k, lv): Count() for k in KINDS for lv in LEVELS}
        return stats_table(counts)


METER = ByteMeter()


def peer_entries(kind: str, nbytes: int, elements: int, n_intra: int, n_inter: int) -> tuple:
    """:meth:`ByteMeter.record_peers`'s records as :meth:`ByteMeter.add`'s entries."""
    if kind not in KINDS:
        raise ValueError(f"unknown meter kind {kind!r}")
    return tuple(((kind, level), int(nbytes) * n, int(elements) * n)
                 for level, n in (("intra", n_intra), ("inter", n_inter)) if n)


def format_stats(stats: Stats) -> str:
    """:func:`comm_stats` (or a handle's) as a plain-text table: one row per kind and link
    (``intra``, ``inter``, ``total``) with bytes, elements and bits per element; the
    ``control`` and ``guard`` rows only when such bytes were sent."""
    rows = [["kind", "link", "bytes", "elements", "bits/elt"]]
    for kind, levels in stats.items():
        if kind in ("control", "guard") and not levels["total"]["bytes"]:
            continue
        for level, c in levels.items():
            bits = f"{c['bits_per_element']:.3f}" if c["elements"] else "-"
            rows.append([kind, level, f"{int(c['bytes']):,}", f"{int(c['elements']):,}", bits])
    return "\n".join(aligned(rows, rule=True))


def comm_stats(reset: bool = True) -> Stats:
    """Bytes, elements and bits per element on the wire since the last reset, per kind
    (``weights``, ``grads``, ``control``, ``guard``: the accuracy guard's exact reductions and
    its sums) and level (``intra``, ``inter``, ``total``), of every
    handle in this process (each handle's own: ``QuantizedComms.comm_stats``)."""
    return METER.snapshot(reset=reset)
