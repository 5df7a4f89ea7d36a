"""What the docs test checks in README.md and docs/*.md: links that resolve, commands that parse.

- Every relative link and image (``[text](path)``, ``![alt](path)``, ``[name]: path``,
  ``<img src="path">``, ``<a href="path">``) outside code must name a file or directory that
  exists, relative to the page, and a ``#heading`` in a link to a Markdown page must be one of
  its headings (GitHub's anchors). Web addresses are not checked.
- Every ``qsdp ...`` command in a shell code block (```` ```bash ````, ``sh``, ``shell``; in
  ``console``, ``text`` and unlabelled blocks only lines that start with ``$ ``) is found, also as
  ``torchrun ... -m qsdp.cli ...``, ``python -m qsdp.<module> ...`` or ``python -m
  benchmarks.<script> ...`` (the evidence scripts beside the package), and parsed by the real
  command line: ``qsdp.cli``'s parser, then, for a subcommand that hands its arguments on
  (``qsdp bench NAME ...``, ``qsdp advise ...``), the parser of the module it hands them to. A
  renamed or removed flag is an error.
- A command whose line ends with the comment ``# long-running`` is only parsed; any other command
  must run in seconds, and the docs test runs it (:func:`run_command`). A command shown after a
  ``$ `` prompt in a ``text`` block with its output below must print that output, line for line.

Parsing stops right after argparse has read the arguments: ``argparse.ArgumentParser.parse_args``
is wrapped so that the last parser of a command (one that hands nothing on) raises instead of
returning, so nothing after the parse runs (no training, no benchmark). Abbreviated flags are
not accepted there: a page shows each flag's whole name.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DocCommand", "Problem", "LONG_RUNNING", "markdown_files", "anchors", "broken_links",
           "doc_commands", "parse_error", "run_command", "python_blocks"]

ROOT = Path(__file__).resolve().parent.parent
LONG_RUNNING = "# long-running"
_LONG_RUNNING = re.compile(r"#\s*long-running\b")

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})\s*([\w+-]*)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HTML_LINK = re.compile(r"<(?:img|a|source)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_HTML_ANCHOR = re.compile(r"<a\b[^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")

_SHELL_BLOCKS = {"bash", "sh", "shell", "zsh"}  # every line is a command
# Only `$ ` lines are commands there: the rest is output, where a table's row may well begin
# with the preset named qsdp.
_PROMPT_BLOCKS = {"console", "shell-session", "text", ""}
_REDIRECTION = re.compile(r"\s\d?(?:>>?|<)&?\s*\S+")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Wrappers that run the command after them, with the options that take a value.
_WRAPPERS = {"sudo": {"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U"}, "env": {"-u", "-C", "-S"},
             "taskset": {"-c", "--cpu-list"}, "timeout": {"-s", "-k", "--signal", "--kill-after"},
             "nice": {"-n"}, "time": set(), "nohup": set(), "exec": set(), "command": set()}
_WRAPPER_POSITIONALS = {"taskset": 1, "timeout": 1}  # taskset MASK (unless -c), timeout DURATION
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


@dataclass(frozen=True)
class Problem:
    """Something wrong in a page: where and what."""
    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        try:
            where = self.path.relative_to(ROOT)
        except ValueError:
            where = self.path
        return f"{where}:{self.line}: {self.message}"


@dataclass(frozen=True)
class DocCommand:
    """One command shown in a page.

    ``module`` is ``qsdp.cli`` for ``qsdp ...`` and ``-m qsdp.cli ...``, else the ``qsdp.*``
    module run with ``-m``; ``argv`` is what follows the program (or the module). ``output``: the
    lines shown after a ``$ `` prompt line as what it prints (None in a plain shell block).
    """
    path: Path
    line: int
    text: str
    module: str
    argv: tuple[str, ...]
    long_running: bool
    output: tuple[str, ...] | None = None

    def __str__(self) -> str:
        return str(Problem(self.path, self.line, self.text))


def markdown_files(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/, sorted."""
    pages = [root / "README.md"] if (root / "README.md").is_file() else []
    return pages + sorted((root / "docs").rglob("*.md"))


@dataclass(frozen=True)
class _Block:
    index: int  # the how-many-th fenced block of the page
    info: str  # its info string, lower case ("bash", "text", "")


def _scan(text: str) -> Iterator[tuple[int, str, _Block | None]]:
    """(line number, line, the fenced block it is in or None) of every line but the fences."""
    block: _Block | None = None
    fence, count = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if block is None:
            m = _FENCE.match(line)
            if m:
                fence, count = m.group(1), count + 1
                block = _Block(count, m.group(2).lower())
            else:
                yield number, line, None
        elif line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            block = None
        else:
            yield number, line, block


def _lines_outside_code(text: str, inline_code: bool = False) -> Iterator[tuple[int, str]]:
    """Lines outside fenced blocks; inline code spans removed unless ``inline_code``."""
    for number, line, block in _scan(text):
        if block is None:
            yield number, line if inline_code else _INLINE_CODE.sub("", line)


def _code_blocks(text: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """(info string, [(line number, line)]) of every fenced block."""
    blocks: dict[_Block, list[tuple[int, str]]] = {}
    for number, line, block in _scan(text):
        if block is not None:
            blocks.setdefault(block, []).append((number, line))
    return [(block.info, lines) for block, lines in blocks.items()]


def python_blocks(page: Path) -> list[str]:
    """The text of every ```` ```python ```` block of ``page``, in order."""
    return ["\n".join(line for _, line in body) + "\n"
            for info, body in _code_blocks(page.read_text(encoding="utf-8")) if info == "python"]


def _link_targets(text: str) -> Iterator[tuple[int, str]]:
    for number, line in _lines_outside_code(text):
        for pattern in (_INLINE_LINK, _REFERENCE_LINK, _HTML_LINK):
            for m in pattern.finditer(line):
                yield number, m.group(1)


def anchors(page: Path) -> set[str]:
    """The anchors a page offers: GitHub's slug of every heading (``## `qsdp bench`: a, b`` ->
    ``qsdp-bench-a-b``; a repeated heading gets ``-1``, ``-2``), and HTML ``id``/``name``s."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _lines_outside_code(page.read_text(encoding="utf-8"), inline_code=True):
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        text = _LINK_TEXT.sub(r"\1", m.group(1)).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(page: Path) -> list[Problem]:
    """Relative links and images of ``page`` that name no existing file or directory, and links
    to a heading (``page.md#heading``, ``#heading``) of a Markdown page that has no such heading."""
    problems = []
    for number, target in _link_targets(page.read_text(encoding="utf-8")):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # a web address or mail
        path, _, anchor = target.split("?", 1)[0].partition("#")
        if not path:
            resolved = page
        else:
            resolved = (ROOT / path.lstrip("/")) if path.startswith("/") else (page.parent / path)
        if not resolved.exists():
            problems.append(Problem(page, number, f"broken link: {target}"))
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(Problem(page, number, f"broken link: {target} (no such heading)"))
    return problems


def _logical_lines(info: str, body: list[tuple[int, str]]
                   ) -> Iterator[tuple[int, str, tuple[str, ...] | None]]:
    """(line number, command line, what the page shows it printing) of a block: continuations
    joined, prompts removed. In a prompt block the lines after a ``$ `` line, up to the next one,
    are its output; a shell block shows none (None)."""
    prompt_only = info in _PROMPT_BLOCKS
    if info not in _SHELL_BLOCKS and not prompt_only:
        return
    commands: list[tuple[int, str, list[str] | None]] = []
    pending = ""
    for number, line in body:
        stripped = line.strip()
        if not pending:
            if stripped.startswith("$ "):
                stripped = stripped[2:]
            elif prompt_only:
                if commands:
                    commands[-1][2].append(line.rstrip())
                continue
            commands.append((number, "", [] if prompt_only else None))
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        commands[-1] = (commands[-1][0], pending + stripped, commands[-1][2])
        pending = ""
    if pending:
        commands[-1] = (commands[-1][0], pending, commands[-1][2])
    for number, line, output in commands:
        yield number, line, None if output is None else tuple(output)


def _simple_commands(line: str) -> Iterator[list[str]]:
    lexer = shlex.shlex(_REDIRECTION.sub(" ", line), posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: not a shell command
        return
    current: list[str] = []
    for token in tokens:
        if token and set(token) <= set(";&|()"):
            if current:
                yield current
            current = []
        else:
            current.append(token)
    if current:
        yield current


def _strip_wrappers(tokens: list[str]) -> list[str]:
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if _ENV_ASSIGNMENT.match(token):
            i += 1
        elif os.path.basename(token) in _WRAPPERS:
            name = os.path.basename(token)
            takes_value = _WRAPPERS[name]
            i += 1
            positionals = _WRAPPER_POSITIONALS.get(name, 0)
            while i < len(tokens) and (tokens[i].startswith("-") or _ENV_ASSIGNMENT.match(tokens[i])):
                if tokens[i] in ("-c", "--cpu-list") and name == "taskset":
                    positionals = 0  # `taskset -c LIST`: the list is the option's value
                i += 2 if tokens[i] in takes_value else 1
            i += positionals
        else:
            break
    return tokens[i:]


def _as_qsdp(tokens: list[str]) -> tuple[str, list[str]] | None:
    tokens = _strip_wrappers(tokens)
    if not tokens:
        return None
    program = os.path.basename(tokens[0])
    if program == "qsdp":
        return "qsdp.cli", tokens[1:]
    if _PYTHON.match(program) or program == "torchrun":
        if "-m" in tokens:
            at = tokens.index("-m")
            module = tokens[at + 1] if at + 1 < len(tokens) else ""
            if module == "qsdp" or module.startswith(("qsdp.", "benchmarks.")):
                return ("qsdp.cli" if module == "qsdp" else module), tokens[at + 2:]
    return None


def doc_commands(page: Path) -> list[DocCommand]:
    """Every ``qsdp`` command shown in the shell code blocks of ``page``."""
    commands = []
    for info, body in _code_blocks(page.read_text(encoding="utf-8")):
        for number, line, output in _logical_lines(info, body):
            for tokens in _simple_commands(line):
                found = _as_qsdp(tokens)
                if found:
                    module, argv = found
                    commands.append(DocCommand(page, number, line.strip(), module, tuple(argv),
                                               bool(_LONG_RUNNING.search(line)), output))
    return commands


class _Parsed(BaseException):
    """Raised by the wrapped ``parse_args`` once the last parser has read a command's arguments.

    A BaseException, so that no ``except Exception`` on the way up takes it for a failure.
    """


def _hands_on(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> bool:
    """Whether the chosen (sub)command hands the rest of its arguments to another parser."""
    for action in parser._actions:  # argparse keeps no public list of a parser's actions
        if action.nargs == argparse.REMAINDER:
            return True
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(ns, action.dest, None) if action.dest != argparse.SUPPRESS else None
            if chosen in action.choices and _hands_on(action.choices[chosen], ns):
                return True
    return False


@contextlib.contextmanager
def _stop_after_parsing() -> Iterator[None]:
    original, original_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def parse_args(self, args=None, namespace=None):
        ns = original(self, args, namespace)
        if _hands_on(self, ns):
            return ns
        raise _Parsed()

    def parse_known_args(self, args=None, namespace=None):
        # A page shows a flag's whole name: an abbreviation would hide a rename that keeps the
        # old name as a prefix (--model -> --model-name).
        self.allow_abbrev = False
        return original_known(self, args, namespace)

    argparse.ArgumentParser.parse_args = parse_args
    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original
        argparse.ArgumentParser.parse_known_args = original_known


def parse_error(module: str, argv: list[str] | tuple[str, ...]) -> str | None:
    """None if ``python -m module *argv`` gets through its argument parsing, else the error.

    ``module`` must have ``main(argv)`` (``qsdp.cli`` and the benchmark modules do). ``--help``
    counts as parsed.
    """
    try:
        entry = importlib.import_module(module).main
    except (ImportError, AttributeError) as e:
        return f"cannot load {module}.main: {e}"
    stderr, stdout = io.StringIO(), io.StringIO()
    try:
        with _stop_after_parsing(), contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            rc = entry(list(argv))
    except _Parsed:
        return None
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if rc == 0 and "usage:" in stdout.getvalue():
        return None  # --help
    message = stderr.getvalue().strip().splitlines()
    return message[-1] if message else f"exit code {rc} before its arguments were parsed"


def run_command(command: DocCommand, cwd: Path, limit_s: float = 180.0) -> str | None:
    """Run ``command`` as shown, in this process (torch is imported once for all of them), in
    ``cwd``; None if it exits 0 within ``limit_s`` seconds and prints what the page shows it
    printing (``command.output``, when the page shows any), else what went wrong.

    The limit is checked after the command returns: a command shown without ``# long-running``
    must take seconds, and one that takes longer is reported so that it gets the marker.
    """
    entry = importlib.import_module(command.module).main
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    started = time.perf_counter()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = entry(list(command.argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # a crash is a failure of the command shown, reported with its cause
        rc, err = 1, io.StringIO(f"{type(e).__name__}: {e}")
    finally:
        os.chdir(here)
    elapsed = time.perf_counter() - started
    if rc:
        tail = (err.getvalue() or out.getvalue()).strip().splitlines()[-3:]
        return f"exit code {rc}: " + " | ".join(tail)
    if elapsed > limit_s:
        return f"took {elapsed:.0f} s: mark it '{LONG_RUNNING}' or show a quicker variant"
    if command.output:
        return _output_difference(command.output, out.getvalue())
    return None


def _output_difference(shown: tuple[str, ...], printed: str) -> str | None:
    """None if ``printed`` is ``shown`` (trailing blanks aside), else the first line that differs."""
    want = "\n".join(line.rstrip() for line in shown).strip("\n").splitlines()
    got = "\n".join(line.rstrip() for line in printed.splitlines()).strip("\n").splitlines()
    for i, (a, b) in enumerate(zip(want, got), 1):
        if a != b:
            return f"output line {i} differs: the page shows {a!r}, the command prints {b!r}"
    if len(want) != len(got):
        return f"the page shows {len(want)} output lines, the command prints {len(got)}"
    return None
