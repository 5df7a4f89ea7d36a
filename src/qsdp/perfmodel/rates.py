"""Link rates as people write them: ``100gbit``, ``400Gbit/s``, ``3.2tbit``, ``50GB/s``, and a
node's NICs as ``8x400gbit``. The performance model's own unit is Gbit/s (bits, as NICs are
sold); a rate must carry its unit, because GB/s and Gbit/s differ by 8x and a bare number hides
which one was meant."""

from __future__ import annotations

import re

_PREFIX_GBIT = {"k": 1e-6, "m": 1e-3, "g": 1.0, "t": 1e3}
# bit or byte, in full (any case) or as one letter (b: bits, B: bytes, where the case decides),
# each optionally "per second": 400Gbit, 400Gbit/s, 400Gbps, 400Gb/s, 50GB/s, 50GBps, 50gbyte
_RATE = re.compile(
    r"(?P<number>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?P<prefix>[kKmMgGtT])"
    r"(?P<unit>[bB][iI][tT]|[bB][yY][tT][eE]|b|B)(?:/s|ps)?"
)
_LINK = re.compile(r"\s*(?:(?P<count>[0-9]+)\s*[xX*]\s*)?(?P<rate>.+?)\s*")
EXAMPLES = "100gbit, 400Gbit/s, 3.2tbit, 50GB/s"


def parse_rate(text: str) -> float:
    """A rate with its unit -> Gbit/s: ``"400Gbit/s"`` -> 400.0, ``"3.2tbit"`` -> 3200.0,
    ``"50GB/s"`` -> 400.0. Raises ``ValueError`` naming the expected form."""
    m = _RATE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a rate with its unit; write e.g. {EXAMPLES}")
    unit = m.group("unit")
    bits = 8.0 if unit.lower() == "byte" or unit == "B" else 1.0
    gbit = float(m.group("number")) * _PREFIX_GBIT[m.group("prefix").lower()] * bits
    if gbit <= 0:
        raise ValueError(f"{text!r} must be positive")
    return gbit


def parse_link(text: str) -> tuple[int, float]:
    """A node's inter-node link -> ``(NICs, Gbit/s each)``: ``"100gbit"`` -> ``(1, 100.0)``,
    ``"8x400gbit"`` -> ``(8, 400.0)``."""
    m = _LINK.fullmatch(text)
    count = int(m.group("count")) if m and m.group("count") else 1
    if count < 1:
        raise ValueError(f"{text!r}: the number of NICs must be positive")
    try:
        return count, parse_rate(m.group("rate") if m else text)
    except ValueError:
        raise ValueError(f"{text!r} is not a link rate with its unit; write e.g. {EXAMPLES}, "
                         "or NICs x rate: 8x400gbit") from None


def format_gbit(gbit: float) -> str:
    """Gbit/s for people: ``"400 Gbit/s"``, ``"3.2 Tbit/s"``, ``"12.5 Gbit/s"``."""
    if gbit >= 1000:
        return f"{gbit / 1000:.3g} Tbit/s"
    if gbit < 1:
        return f"{gbit * 1000:.3g} Mbit/s"
    return f"{gbit:.4g} Gbit/s"
