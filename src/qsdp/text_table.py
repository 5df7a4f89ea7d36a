"""Plain-text tables for the command line: the first column left-aligned, the others right."""

from __future__ import annotations

from collections.abc import Sequence


def aligned(rows: Sequence[Sequence[str]], *, rule: bool = False) -> list[str]:
    """One line per row, columns padded to their widest cell and joined by two spaces.

    ``rows[0]`` is the header; ``rule`` puts a line of dashes under it. Every row has as many
    cells as the header.
    """
    if not rows:
        return []
    if any(len(r) != len(rows[0]) for r in rows):
        raise ValueError(f"every row needs {len(rows[0])} cells, as the header has")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
