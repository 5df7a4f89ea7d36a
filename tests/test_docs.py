"""README.md and docs/: every relative link resolves, every `qsdp` command shown parses with the
real command line, and every command not marked `# long-running` runs (see tests/docs_check.py)."""

import contextlib
import io
import shutil
import textwrap

import pytest

import qsdp.cli

from docs_check import ROOT, broken_links, doc_commands, markdown_files, parse_error, python_blocks, run_command
from scripts import run_script

pytestmark = pytest.mark.timeout(900)


def _printed(command: str) -> str:
    """What ``command`` (a ``qsdp ...`` line) prints, run as the docs test runs it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert qsdp.cli.main(command.split()[1:]) == 0
    return out.getvalue()


def _page(tmp_path, text: str):
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent(text), encoding="utf-8")
    return page


def test_every_relative_link_and_image_in_the_docs_resolves():
    pages = markdown_files()
    assert ROOT / "README.md" in pages and len(pages) > 1
    problems = [str(p) for page in pages for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_a_broken_link_or_image_is_reported_with_its_line(tmp_path):
    (tmp_path / "there.md").write_text("# There\n\n## `qsdp bench`: the heading, with code\n")
    page = _page(tmp_path, """\
        [fine](there.md#qsdp-bench-the-heading-with-code) and [web](https://pytorch.org) and [here](#top)
        ![missing picture](images/nowhere.png)
        `[not a link](inside/code.md)`
        ```bash
        cat [also code](nowhere.md)
        ```
        [gone](docs/gone.md) and [renamed heading](there.md#the-old-heading)
        ## Top
        """)
    problems = broken_links(page)
    assert [(p.line, p.message) for p in problems] == [
        (2, "broken link: images/nowhere.png"), (7, "broken link: docs/gone.md"),
        (7, "broken link: there.md#the-old-heading (no such heading)")]


def test_commands_are_found_in_shell_blocks_and_behind_prompts_wrappers_and_torchrun(tmp_path):
    page = _page(tmp_path, """\
        ```bash
        qsdp bench volume --json   # long-running
        sudo -E .venv/bin/qsdp bench cluster \\
            --nodes 2     # long-running
        torchrun --nnodes 2 -m qsdp.cli advise --measure --params 7B
        taskset -c 1 python -m qsdp.bench.gpu_smoke --device cpu > out.txt
        make demo && qsdp plot runs/demo
        python -m pytest -q tests/test_docs.py
        ```
        ```text
        $ qsdp advise --params 1.3B --nodes 16
        qsdp advise: the output, not a command
        ```
        ```
        preset  bits
        qsdp    8.06
        $ qsdp bench volume  # long-running
        ```
        ```python
        qsdp.quantize_comms(model, "sdp4bit")
        ```
        """)
    found = [(c.line, c.module, c.argv, c.long_running) for c in doc_commands(page)]
    assert found == [
        (2, "qsdp.cli", ("bench", "volume", "--json"), True),
        (3, "qsdp.cli", ("bench", "cluster", "--nodes", "2"), True),
        (5, "qsdp.cli", ("advise", "--measure", "--params", "7B"), False),
        (6, "qsdp.bench.gpu_smoke", ("--device", "cpu"), False),
        (7, "qsdp.cli", ("plot", "runs/demo"), False),
        (11, "qsdp.cli", ("advise", "--params", "1.3B", "--nodes", "16"), False),
        (17, "qsdp.cli", ("bench", "volume"), True),
    ]


def test_every_qsdp_command_in_the_docs_parses_with_the_real_command_line():
    commands = [c for page in markdown_files() for c in doc_commands(page)]
    assert any(c.argv[:1] == ("demo",) for c in commands), "the README shows no `qsdp demo`?"
    errors = [f"{c}\n    {err}" for c in commands if (err := parse_error(c.module, c.argv))]
    assert not errors, "\n".join(errors)


def test_a_renamed_flag_or_subcommand_fails_the_parse(tmp_path):
    page = _page(tmp_path, """\
        ```bash
        qsdp train --preset sdp4bit --nproc 4 --steps 300   # long-running
        qsdp train --presets sdp4bit      # long-running
        qsdp bench volume --no-such-flag  # long-running
        qsdp bench volumes
        python -m qsdp.bench.gpu_smoke --devices cpu  # long-running
        qsdp advise --param 1.3B --nodes 16
        ```
        """)
    errors = {c.line: parse_error(c.module, c.argv) for c in doc_commands(page)}
    assert errors[2] is None
    assert "unrecognized arguments: --presets" in errors[3]
    assert "unrecognized arguments: --no-such-flag" in errors[4]
    assert "invalid choice: 'volumes'" in errors[5]
    assert "unrecognized arguments: --devices" in errors[6]
    # argparse would take --param for --params; a page must show the whole name
    assert "--param" in errors[7]


def test_a_command_shown_without_the_marker_is_run_and_its_failure_reported(tmp_path):
    page = _page(tmp_path, """\
        ```bash
        qsdp plot runs/nowhere
        qsdp advise --params 1.3B --nodes 2 --gpu a100
        ```
        """)
    failed, ran = (run_command(c, tmp_path) for c in doc_commands(page))
    assert failed.startswith("exit code 2:") and "runs/nowhere" in failed
    assert ran is None


def test_a_command_shown_with_its_output_must_print_that_output(tmp_path):
    command = "qsdp advise --params 1.3B --nodes 2 --gpu a100"
    printed = _printed(command)
    shown = _page(tmp_path, "```text\n$ " + command + "\n" + printed + "```\n")
    assert run_command(doc_commands(shown)[0], tmp_path) is None
    edited = printed.replace("a100", "h800", 1)
    stale = _page(tmp_path, "```text\n$ " + command + "\n" + edited + "```\n")
    assert run_command(doc_commands(stale)[0], tmp_path) == (
        f"output line 1 differs: the page shows {edited.splitlines()[0]!r}, "
        f"the command prints {printed.splitlines()[0]!r}")


def test_every_command_not_marked_long_running_runs_as_shown(tmp_path):
    # In a scratch directory holding a copy of the committed results and examples, so that a
    # command that reads them finds them and one that writes files leaves the checkout as it was.
    for folder in ("benchmarks", "examples"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    quick = {}  # a command shown on several pages (with the same output, if any) runs once
    for c in (c for page in markdown_files() for c in doc_commands(page) if not c.long_running):
        quick.setdefault((c.module, c.argv, c.output), c)
    assert quick, "no command in the docs is run by this test"
    errors = [f"{c}\n    {err}" for c in quick.values() if (err := run_command(c, tmp_path))]
    assert not errors, "\n".join(errors)


def test_the_own_loop_checkpoint_example_trains_saves_and_resumes_as_shown(tmp_path):
    [script] = [b for b in python_blocks(ROOT / "docs" / "checkpoints.md") if b.startswith("# own_loop.py")]
    (tmp_path / "own_loop.py").write_text(script, encoding="utf-8")

    def run() -> str:  # torchrun --nproc-per-node 2 own_loop.py, on forked workers (tests/scripts.py)
        return run_script(2, "own_loop.py", cwd=str(tmp_path))

    assert "trained steps 0-4, saved runs/own_loop/checkpoints/step_00000005" in run()
    assert "trained steps 5-9, saved runs/own_loop/checkpoints/step_00000010" in run()
    meta = (tmp_path / "runs/own_loop/checkpoints/step_00000010/trainer.json").read_text()
    assert '"data_seed": 1000' in meta and '"step": 10' in meta
