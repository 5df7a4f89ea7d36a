"""The library reads in small steps: no function under src/ is longer than 60 lines (its
docstring included), so that each names one step, as quantize_comms' do."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
MOST_LINES = 60


def long_functions(root: Path = SRC, most: int = MOST_LINES) -> list[str]:
    """``path:line name (N lines)`` of every function under ``root`` longer than ``most`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > most:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_under_src_exceeds_60_lines():
    assert not long_functions(), "split into named steps: " + ", ".join(long_functions())


def test_a_long_function_is_found_and_named(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == ["m.py:5 long (62 lines)"]
