"""``qsdp bench codecs``: the table's structure on small sizes (no timing is asserted: the
numbers belong to the benchmark's saved results, not to tests)."""

from __future__ import annotations

import json

import pytest
import torch

from qsdp.bench import codecs as bench
from qsdp.cli import main as qsdp_main

SMALL = str(2 * bench.ALIGN)
POSITIVE = ("time_s", "ns_per_element", "gbps", "copy_gbps", "fraction_of_copy", "copy_ns_per_element", "bytes")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One small CPU run through the command line, printed as JSON and saved."""
    path = tmp_path_factory.mktemp("codecs") / "codecs.json"
    threads = torch.get_num_threads()
    argv = ["bench", "codecs", "--device", "cpu", "--size", SMALL, "--repeats", "1", "--json", "--save", str(path)]
    return qsdp_main(argv), path, threads


def test_every_step_has_positive_figures(saved):
    rc, path, _ = saved
    result = json.loads(path.read_text())
    assert rc == 0 and tuple(result["steps"]) == bench.STEPS
    for name, row in result["steps"].items():
        assert row["n"] == 2 * bench.ALIGN, name
        assert all(row[k] > 0 for k in POSITIVE), name
        assert row["workload"], name


def test_random_roundings_are_compared_with_nearest(saved):
    steps = json.loads(saved[1].read_text())["steps"]
    assert "vs_nearest" not in steps["quantize_nearest"]
    for r in ("stochastic", "shift"):
        row = steps[f"quantize_{r}"]
        assert row["vs_nearest"] == pytest.approx(row["time_s"] / steps["quantize_nearest"]["time_s"])


def test_the_result_says_what_produced_it(saved):
    result = json.loads(saved[1].read_text())
    meta = result["meta"]
    assert meta["command"].startswith("qsdp bench codecs --device cpu")
    assert meta["torch"] == torch.__version__ and meta["date"] and meta["device"].startswith("CPU")
    assert result["threads"] == 1 and "minimum of 1 rounds" in result["timing"]


def test_the_callers_thread_count_is_restored(saved):
    assert torch.get_num_threads() == saved[2]


def test_text_output_is_one_line_per_step(capsys):
    assert bench.main(["--device", "cpu", "--size", SMALL, "--repeats", "1", "--steps", "quantize_nearest",
                       "quantize_shift"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("quantize_nearest") and lines[2].startswith("quantize_shift")
    assert lines[2].split()[-1].endswith("x") and len(lines) == 4


def test_bad_arguments_are_usage_errors(capsys):
    for argv in (["--size", "1K"], ["--repeats", "0"], ["--steps", "nope"]):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2
    assert "below the minimum" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_cuda_requested_without_cuda_measures_nothing(capsys):
    assert bench.main(["--device", "cuda", "--size", SMALL]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "needs a CUDA GPU" in out.err and "bench codecs --device cuda" in out.err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_table_has_every_step_from_the_kernels(capsys):
    pytest.importorskip("triton", reason="triton is not installed")
    assert bench.main(["--device", "cuda", "--size", "16M", "--repeats", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert tuple(result["steps"]) == bench.STEPS and result["threads"] is None
    assert result["meta"]["device"] == torch.cuda.get_device_name()
    for row in result["steps"].values():
        assert all(row[k] > 0 for k in POSITIVE)
