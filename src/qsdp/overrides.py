"""Config overrides as the command lines take them: ``--set KEY=VALUE`` (``qsdp train``, ``qsdp
check``, the evidence scripts), the value read as a bool, None, int or float where it is one."""

from __future__ import annotations

import argparse
from typing import Any


def parse_value(text: str) -> Any:
    """``"true"``/``"off"`` -> bool, ``"none"`` -> None, ``"8"`` -> 8, ``"0.5"`` -> 0.5, else the text."""
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_override(text: str) -> tuple[str, Any]:
    """``"weights.bits=4"`` -> ``("weights.bits", 4)``; an argparse ``type=`` (a malformed item is
    a usage error naming it)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. weights.bits=4), got {text!r}")
    return key.strip(), parse_value(value)


class SetOverride(argparse.Action):
    """``--set KEY=VALUE`` (with ``type=parse_override``), repeatable: the pairs in order. A key
    given twice is a usage error naming both values: the last would otherwise win unseen."""

    def __call__(self, parser, namespace, values, option_string=None):
        key, value = values
        pairs = list(getattr(namespace, self.dest, None) or [])
        for given, earlier in pairs:
            if given == key:
                raise argparse.ArgumentError(self, f"{key} given twice ({earlier!r}, then {value!r}); give each "
                                                   "field once")
        setattr(namespace, self.dest, [*pairs, values])
