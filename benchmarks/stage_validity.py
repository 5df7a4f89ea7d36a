"""When a GPU report stage's result still holds, and which stages are due.

A stage's numbers depend on a known part of the source (:class:`Measures`). Its record keeps the
commit it ran at and a hash of those files' contents (:func:`fingerprint`): computed from the
files themselves, so a copy of the tree without ``.git`` (what a rented GPU host often gets) hashes
the same as the checkout. A result is *valid* while the hash of the tree at hand equals the one
recorded; results of several short GPU runs, each in its own ``<device>-<commit>/`` folder,
therefore add up to one report: :func:`stage_state` finds the newest valid result of a stage
among the folders, or says why the stage is due (``missing``: no passed result; ``stale``: the
measured files or the stage's commands changed since, or the result recorded no hash, as
reports written before hashes were kept). :func:`plan` orders the due stages within a time
budget.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Measures", "Fingerprint", "Result", "StageState", "measured_files", "fingerprint", "read_results",
           "stage_state", "plan"]

HASH_CHARS = 16  # 64 bits: enough to tell two versions of a file apart, short enough to read
SKIP_PARTS = {"__pycache__", ".git"}
CHANGED_SHOWN = 5  # changed files named in a stale reason; the rest are counted
REASON_CHARS = 120  # of a failed run's reason, in a listing line


@dataclass(frozen=True)
class Measures:
    """The source a stage's numbers depend on, as paths relative to the repository root.

    ``modules``: dotted module names under ``src/`` (the code that measures, e.g.
    ``qsdp.bench.kernels``), each followed through every ``import`` it makes (at module level
    or inside a function) to the modules that exist in the tree, and so on; a package's
    ``__init__`` counts only where it is imported itself (``from pkg import sub`` imports the
    submodule ``sub``; ``from pkg import name`` and ``import pkg`` import ``pkg``). ``files``:
    glob patterns (``**`` allowed); Python files among them are followed the same way, their own
    folder searched for plain ``import name`` (as pytest does for test helpers). ``more(root)``: paths found when the
    hash is computed (e.g. the test files that declare ``gpu`` tests)."""

    modules: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    more: Callable[[Path], Iterable[str]] | None = None


@dataclass(frozen=True)
class Fingerprint:
    """What a stage measures, in the tree at hand: ``files`` maps each measured path to the hash
    of its bytes, ``commands_hash`` hashes the stage's commands (so a changed size list or
    model re-runs it), ``source_hash`` hashes both together."""

    source_hash: str
    files: dict[str, str]
    commands_hash: str


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:HASH_CHARS]


# --------------------------------------------------------------------------- what is measured


def _module_file(name: str, search: Sequence[Path]) -> Path | None:
    for base in search:
        path = base.joinpath(*name.split("."))
        if (path / "__init__.py").is_file():
            return path / "__init__.py"
        if path.with_suffix(".py").is_file():
            return path.with_suffix(".py")
    return None


def _package_of(path: Path, src: Path) -> str | None:
    """The package a relative import in ``path`` starts from; ``None`` outside ``src``."""
    try:
        parts = path.relative_to(src).parts
    except ValueError:
        return None
    return ".".join(parts[:-1]) or None


_PARSED: dict[tuple[Path, int, int, str | None], list[tuple[str, ...]]] = {}  # the stages share most files


def _imported_names(path: Path, package: str | None) -> list[tuple[str, ...]]:
    """What ``path`` imports, each as the dotted names it may be, the likelier first:
    ``from pkg import a`` is the submodule ``pkg.a`` where there is one, else ``pkg`` itself.
    A file that does not parse is hashed but not followed."""
    stat = path.stat()
    key = (path, stat.st_mtime_ns, stat.st_size, package)
    if key not in _PARSED:
        _PARSED[key] = _parse_imports(path, package)
    return _PARSED[key]


def _parse_imports(path: Path, package: str | None) -> list[tuple[str, ...]]:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return []
    names: list[tuple[str, ...]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(a.name,) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if package is None:
                    continue
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    continue
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base:
                names += [(f"{base}.{a.name}", base) if a.name != "*" else (base,) for a in node.names]
    return names


def _pattern_files(root: Path, pattern: str) -> list[Path]:
    return [p for p in root.glob(pattern)
            if p.is_file() and not SKIP_PARTS.intersection(p.relative_to(root).parts) and p.suffix != ".pyc"]


def measured_files(measures: Measures, root: Path) -> list[str]:
    """The files ``measures`` names in the tree at ``root`` (see :class:`Measures`), sorted,
    as POSIX paths relative to ``root``. A module that is not in the tree is an error (a
    misspelt declaration would otherwise measure nothing)."""
    root = root.resolve()
    src = root / "src"
    found: set[Path] = set()
    todo: list[Path] = []
    for name in measures.modules:
        path = _module_file(name, [src])
        if path is None:
            raise ValueError(f"module {name} is not in {src}")
        todo.append(path)
    for pattern in measures.files:
        todo += _pattern_files(root, pattern)
    if measures.more is not None:
        todo += [root / p for p in measures.more(root)]
    while todo:
        path = todo.pop().resolve()
        if path in found or not path.is_file():
            continue
        found.add(path)
        if path.suffix != ".py":
            continue
        search = [src] if path.is_relative_to(src) else [src, path.parent]
        for names in _imported_names(path, _package_of(path, src)):
            target = next(filter(None, (_module_file(n, search) for n in names)), None)
            if target is not None and target.resolve().is_relative_to(root):
                todo.append(target)
    return sorted(p.relative_to(root).as_posix() for p in found)


def fingerprint(measures: Measures, root: Path, commands: str) -> Fingerprint:
    """The hash of what a stage measures in the tree at ``root`` (contents only: no git needed)
    and of its ``commands`` (their text, written the same on every host)."""
    files = {rel: digest((root / rel).read_bytes()) for rel in measured_files(measures, root)}
    commands_hash = digest(commands.encode())
    text = "".join(f"{rel} {h}\n" for rel, h in files.items()) + f"commands {commands_hash}\n"
    return Fingerprint(digest(text.encode()), files, commands_hash)


# --------------------------------------------------------------------------- the results found


@dataclass(frozen=True)
class Result:
    """One stage's record in one results folder. ``source_hash`` is ``None`` for a result
    recorded without one (a report written before hashes were kept, or a folder without
    ``report.json``)."""

    folder: Path
    stage: str
    status: str
    commit: str
    finished: str
    device: str
    source_hash: str | None = None
    source_files: dict[str, str] = field(default_factory=dict)
    commands_hash: str | None = None
    summary: str = ""
    reason: str = ""

    def where(self) -> str:
        """``h100-abc1234/ (commit abc1234, NVIDIA H100 80GB HBM3, 2026-11-27T10:02:11Z)``."""
        return f"{self.folder.name}/ (commit {self.commit}, {self.device}, {self.finished or 'undated'})"


def _folder_commit(folder: Path) -> str:
    found = re.search(r"-([0-9a-f]{7,40}(?:-dirty)?)$", folder.name)
    return found.group(1) if found else "unknown"


def _earlier_format(folder: Path, stage_files: dict[str, Sequence[str]]) -> list[Result]:
    """A folder without ``report.json`` (written by hand before the report kept records): a
    stage counts as measured there when a file named like one of its own is there (its stem,
    then anything: ``kernels-h100.json`` for ``kernels.json``), hashless."""
    readme = folder / "README.md"
    date = re.search(r"\b(\d{4}-\d{2}-\d{2})\b", readme.read_text(encoding="utf-8")) if readme.is_file() else None
    device = re.match(r"[a-z0-9]+", folder.name)
    results = []
    for stage, files in stage_files.items():
        patterns = {f"{Path(f).stem}*{Path(f).suffix}" for f in files}
        if any(p.is_file() for pattern in patterns for p in folder.rglob(pattern)):
            results.append(Result(folder, stage, "unknown", _folder_commit(folder), date.group(1) if date else "",
                                  device.group(0) if device else "unknown"))
    return results


def read_results(dirs: Iterable[Path], stage_files: dict[str, Sequence[str]]) -> list[Result]:
    """Every stage record in the ``<device>-<commit>/`` folders of ``dirs`` (folders that do not
    exist are passed over; one folder seen through two of them counts once). ``stage_files``:
    the files each stage writes, to recognise its result in a folder without ``report.json``."""
    results: list[Result] = []
    seen: set[Path] = set()
    for base in dirs:
        if not Path(base).is_dir():
            continue
        for folder in sorted(p for p in Path(base).iterdir() if p.is_dir()):
            if folder.resolve() in seen:
                continue
            seen.add(folder.resolve())
            report_path = folder / "report.json"
            if not report_path.is_file():
                results += _earlier_format(folder, stage_files)
                continue
            report = json.loads(report_path.read_text(encoding="utf-8"))
            env = report.get("environment", {})
            for r in report.get("stages", []):
                results.append(Result(folder, r["name"], r.get("status", "unknown"),
                                      r.get("commit") or env.get("commit") or _folder_commit(folder),
                                      r.get("finished") or report.get("date", ""), env.get("device", "unknown"),
                                      r.get("source_hash") or None, dict(r.get("source_files") or {}),
                                      r.get("commands_hash"), r.get("summary", ""), r.get("reason", "")))
    return results


# --------------------------------------------------------------------------- due or valid


@dataclass(frozen=True)
class StageState:
    """A stage against the results found: ``state`` is ``valid``, ``stale`` or ``missing``;
    ``result``: the newest valid result, or the one ``reason`` speaks of."""

    stage: str
    state: str
    reason: str
    result: Result | None = None

    @property
    def due(self) -> bool:
        return self.state != "valid"


def _newest(results: Iterable[Result]) -> Result | None:
    return max(results, key=lambda r: (r.finished, r.folder.name), default=None)


def _changes(old: Result, now: Fingerprint) -> str:
    changed = sorted(p for p in set(old.source_files) | set(now.files) if old.source_files.get(p) != now.files.get(p))
    parts = []
    if changed:
        shown = ", ".join(changed[:CHANGED_SHOWN]) + (f" (+{len(changed) - CHANGED_SHOWN} more)"
                                                      if len(changed) > CHANGED_SHOWN else "")
        parts.append(f"files changed: {shown}")
    if old.commands_hash != now.commands_hash:
        parts.append("its commands changed")
    return "; ".join(parts) or "its source hash differs"


def stage_state(stage: str, now: Fingerprint, results: Iterable[Result]) -> StageState:
    """The state of ``stage`` given the tree's fingerprint ``now`` and the results found: valid
    when a passed result recorded ``now.source_hash`` (the newest such); else due, and why: a
    run of this very code that did not pass (``missing``, with how it ended), a passed result of
    older code (``stale``, with the files that changed since), a result without a hash
    (``stale``), or nothing (``missing``)."""
    mine = [r for r in results if r.stage == stage]
    valid = _newest(r for r in mine if r.status == "passed" and r.source_hash == now.source_hash)
    if valid is not None:
        return StageState(stage, "valid", f"valid at commit {valid.commit}: {valid.where()}", valid)
    tried = _newest(r for r in mine if r.source_hash == now.source_hash)
    if tried is not None:
        why = f": {tried.reason[:REASON_CHARS]}" if tried.reason else ""
        return StageState(stage, "missing", f"missing: no passed result of this code (the last run, {tried.where()}: "
                          f"{tried.status.replace('_', ' ')}{why})", tried)
    passed = _newest(r for r in mine if r.status == "passed" and r.source_hash)
    if passed is not None:
        return StageState(stage, "stale", f"stale since {passed.where()}: {_changes(passed, now)}", passed)
    hashless = _newest(r for r in mine if not r.source_hash)
    if hashless is not None:
        return StageState(stage, "stale", f"stale: {hashless.where()} recorded no source hash "
                          f"({'no report.json: ' if hashless.status == 'unknown' else ''}an earlier format)", hashless)
    last = _newest(mine)
    if last is not None:  # runs of older code, none passed
        return StageState(stage, "missing", f"missing: no passed result (the last run, {last.where()}, was of "
                          f"older code: {last.status.replace('_', ' ')})", last)
    return StageState(stage, "missing", "missing: no result")


def plan(stages: Sequence[tuple[str, float]], left: float | None) -> tuple[list[str], list[str]]:
    """``(run, wait)``: stages taken in their order while each one's ``cost`` (seconds at most)
    fits in what is ``left`` (``None``: no limit); one that does not fit waits and a later,
    shorter one may still go."""
    run, wait = [], []
    for name, cost in stages:
        if left is None or cost <= left:
            run.append(name)
            left = None if left is None else left - cost
        else:
            wait.append(name)
    return run, wait

