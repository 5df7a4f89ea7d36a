"""The byte meter: what every collective actually put on the wire.

Counts are logical point-to-point traffic from this rank: a buffer of ``B`` bytes delivered to
``k`` other ranks counts ``k * B`` bytes (what a direct or ring algorithm sends), split by
whether the destination is in this rank's node (``intra``) or another node (``inter``). Elements
are counted the same way, so ``8 * bytes / elements`` is the bits per element that travelled,
padding and scales included. Bytes that never leave the rank (its own chunk) are not counted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

KINDS = ("weights", "grads", "control")
LEVELS = ("intra", "inter")


@dataclass
class Count:
    bytes: int = 0
    elements: int = 0

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.bytes / self.elements if self.elements else 0.0


class ByteMeter:
    """Thread-safe accumulator of bytes and elements per (kind, level)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {(k, lv): Count() for k in KINDS for lv in LEVELS}

    def record(self, kind: str, level: str, nbytes: int, elements: int) -> None:
        if kind not in KINDS or level not in LEVELS:
            raise ValueError(f"unknown meter slot ({kind!r}, {level!r})")
        with self._lock:
            c = self._counts[(kind, level)]
            c.bytes += int(nbytes)
            c.elements += int(elements)

    def record_peers(self, kind: str, nbytes: int, elements: int, n_intra: int, n_inter: int) -> None:
        """One buffer of ``nbytes`` carrying ``elements`` sent to ``n_intra`` + ``n_inter`` peers."""
        if n_intra:
            self.record(kind, "intra", nbytes * n_intra, elements * n_intra)
        if n_inter:
            self.record(kind, "inter", nbytes * n_inter, elements * n_inter)

    def snapshot(self, reset: bool = False) -> dict[str, dict[str, dict[str, float]]]:
        """``{kind: {level: {"bytes", "elements", "bits_per_element"}, "total": {...}}}``."""
        with self._lock:
            out: dict[str, dict[str, dict[str, float]]] = {}
            for k in KINDS:
                per: dict[str, dict[str, float]] = {}
                tb = te = 0
                for lv in LEVELS:
                    c = self._counts[(k, lv)]
                    per[lv] = {"bytes": c.bytes, "elements": c.elements, "bits_per_element": c.bits_per_element}
                    tb += c.bytes
                    te += c.elements
                per["total"] = {"bytes": tb, "elements": te, "bits_per_element": 8.0 * tb / te if te else 0.0}
                out[k] = per
            if reset:
                self._counts = {(k, lv): Count() for k in KINDS for lv in LEVELS}
        return out


METER = ByteMeter()


def comm_stats(reset: bool = True) -> dict[str, dict[str, dict[str, float]]]:
    """Bytes, elements and bits per element on the wire since the last reset, per kind
    (``weights``, ``grads``, ``control``) and level (``intra``, ``inter``, ``total``)."""
    return METER.snapshot(reset=reset)
