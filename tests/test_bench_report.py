"""Every benchmark's result says what produced it, is saved as JSON and printed; its --help
says what it is in whole sentences."""

import importlib
import json
import os

import pytest
import torch

from qsdp.bench import report
from qsdp.bench.report import emit, meta
from qsdp.cli import BENCHMARKS


def test_meta_names_the_command_torch_device_and_date():
    m = meta("volume", ["--steps", "2"], "cpu (gloo)")
    assert m["command"] == "qsdp bench volume --steps 2"
    assert m["torch"] and m["device"] == "cpu (gloo)" and len(m["date"]) == 10


def test_meta_names_the_host_a_cpu_timing_depends_on():
    host = meta("volume", [], "cpu (gloo)")["host"]
    assert f"{len(os.sched_getaffinity(0))} cores" in host
    assert host.endswith(torch.backends.cpu.get_cpu_capability())


def test_emit_saves_json_and_prints_text_or_json(tmp_path, capsys):
    result = {"presets": {"fsdp": {"x": 1.0}}}
    assert emit(result, as_json=False, save=str(tmp_path / "r" / "out.json"), format_text=lambda r: "TABLE") == 0
    assert capsys.readouterr().out == "TABLE\n"
    assert json.loads((tmp_path / "r" / "out.json").read_text()) == result
    emit(result, as_json=True, save=None, format_text=lambda r: "TABLE")
    assert json.loads(capsys.readouterr().out) == result


def test_bar_chart_writes_a_png_beside_the_json(tmp_path):
    from qsdp.bench.report import bar_chart, png_next_to

    path = png_next_to(str(tmp_path / "res" / "x.json"))
    assert path.endswith("x.png")
    bar_chart(path, ["a", "b"], {"measured": [1.0, 2.0], "ideal": [1.5, 3.0]}, ylabel="speedup", title="t")
    assert (tmp_path / "res" / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmarks_help_describes_it_in_whole_sentences(name, capsys):
    module = importlib.import_module(BENCHMARKS[name])
    with pytest.raises(SystemExit):
        module.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert report.description(module.__doc__) in shown
