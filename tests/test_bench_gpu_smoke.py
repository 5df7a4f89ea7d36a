"""The GPU smoke (``make test-gpu``) without a GPU: its arguments, the loss comparison and the
whole training comparison on the CPU fallback."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from qsdp.bench import gpu_smoke
from qsdp.cli import _parser
from qsdp.train.data import load_corpus


def test_equal_losses_agree_bit_for_bit():
    got = gpu_smoke.compare_losses([5.5, 4.0], [5.5, 4.0], rtol=0.0)
    assert got == {"steps": 2, "max_rel_diff": 0.0, "bit_identical": True, "agree": True}


def test_losses_agree_within_the_tolerance_only():
    close = gpu_smoke.compare_losses([5.5, 4.002], [5.5, 4.0], rtol=1e-3)
    assert close["agree"] and not close["bit_identical"] and close["max_rel_diff"] == pytest.approx(5e-4)
    assert not gpu_smoke.compare_losses([5.5, 4.1], [5.5, 4.0], rtol=1e-3)["agree"]


def test_runs_of_different_length_or_with_nan_never_agree():
    assert not gpu_smoke.compare_losses([5.5], [5.5, 4.0], rtol=1.0)["agree"]
    assert not gpu_smoke.compare_losses([], [], rtol=1.0)["agree"]
    nan = gpu_smoke.compare_losses([5.5, math.nan], [5.5, math.nan], rtol=1.0)
    assert not nan["agree"] and nan["max_rel_diff"] == math.inf


def test_triton_is_expected_for_quantized_presets_on_cuda_with_the_kernels_on():
    assert gpu_smoke.expected_kernels("sdp4bit", "cuda", triton_disabled=False) == "triton"
    assert gpu_smoke.expected_kernels("sdp4bit", "cuda", triton_disabled=True) == "torch"
    assert gpu_smoke.expected_kernels("qsdp", "cpu", triton_disabled=False) == "torch"


def test_a_preset_that_quantizes_nothing_must_report_no_codecs():
    assert not gpu_smoke.quantizes("fsdp") and gpu_smoke.quantizes("zeropp") and gpu_smoke.quantizes("qsdp-g8")
    for device, disabled in (("cuda", False), ("cuda", True), ("cpu", False)):
        assert gpu_smoke.expected_kernels("fsdp", device, triton_disabled=disabled) == "none"


def test_a_preset_without_a_codec_trains_once_the_others_with_and_without_the_kernels():
    assert gpu_smoke.train_modes("fsdp") == ("triton",)
    assert gpu_smoke.train_modes("sdp4bit") == ("triton", "reference")


def test_the_gpu_tests_list_the_skipped_ones_with_their_reasons():
    command = gpu_smoke.gpu_tests_command()
    assert command[1:3] == ["-m", "pytest"] and "-rfEs" in command
    assert command[command.index("-m", 3) + 1] == "gpu"


def test_a_stage_stopped_at_its_timeout_keeps_what_it_printed_in_its_log(tmp_path):
    script = "import sys, time; print('test_a PASSED', flush=True); time.sleep(60)"
    stage = gpu_smoke._run(gpu_smoke.Stage("gpu tests", [sys.executable, "-c", script]), 5,
                           log_to=tmp_path / "pytest-gpu.log")
    assert stage.returncode == 124 and not stage.passed
    log = (tmp_path / "pytest-gpu.log").read_text()
    assert "test_a PASSED" in log and log.endswith("timed out after 5 s")
    assert stage.output_tail == log  # text, not the bytes TimeoutExpired carries


def test_the_line_printed_as_a_stage_ends_names_it_its_seconds_and_how_it_ended():
    ok = gpu_smoke.Stage("train qsdp (triton)", [], returncode=0, seconds=41.25)
    late = gpu_smoke.Stage("train qsdp (reference)", [], returncode=124, seconds=60.0)
    assert gpu_smoke.stage_line(ok) == "train qsdp (triton)             41.2 s  ok"
    assert gpu_smoke.stage_line(late) == "train qsdp (reference)          60.0 s  FAILED (exit 124)"


def test_training_runs_share_one_device_over_gloo(tmp_path):
    args = gpu_smoke.parse_args(["--device", "cpu", "--out", str(tmp_path)])
    command = gpu_smoke.train_command("zeropp", tmp_path / "run", args)
    assert command[1:3] == ["-m", "qsdp.cli"]
    parsed = _parser().parse_args(command[3:])  # the command line qsdp itself accepts
    assert (parsed.command, parsed.preset, parsed.nproc, parsed.local_world_size) == ("train", "zeropp", 4, 2)
    assert (parsed.device, parsed.backend, parsed.steps) == ("cpu", "gloo", 6)
    assert (parsed.tokenizer, parsed.progress) == ("byte", False)  # neither needs an extra


def test_training_data_is_the_sample_text_installed_with_the_package():
    import qsdp.train

    args = gpu_smoke.parse_args(["--device", "cpu"])
    data = _parser().parse_args(gpu_smoke.train_command("fsdp", Path("run"), args)[3:]).data
    assert Path(data).parent == Path(qsdp.train.__file__).parent
    assert len(load_corpus(data)) > 4000  # enough for the smoke's batches in both splits


def test_only_test_files_that_declare_gpu_tests_are_collected(tmp_path):
    (tmp_path / "test_a.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    (tmp_path / "test_b.py").write_text("import hypothesis\n\ndef test_y():\n    pass\n")
    (tmp_path / "helper.py").write_text("pytest.mark.gpu\n")
    assert gpu_smoke.gpu_test_files(tmp_path) == [str(tmp_path / "test_a.py")]
    assert "test_triton_kernels.py" in {Path(p).name for p in gpu_smoke.gpu_test_files()}


@pytest.mark.parametrize("argv, message", [
    (["--presets", "qsdp9"], "unknown preset(s) qsdp9"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--nproc", "4", "--ranks-per-node", "3"], "must divide --nproc 4"),
    (["--rtol", "nan"], "--rtol must be a non-negative number"),
    (["--skip", "everything"], "invalid choice"),
])
def test_bad_arguments_exit_2_naming_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_smoke.parse_args(["--device", "cpu", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_is_refused_where_there_is_none(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_smoke.parse_args([])
    assert exit_info.value.code == 2 and "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_results_go_to_the_out_variable_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_smoke.parse_args(["--device", "cpu"]).out == str(tmp_path)
    monkeypatch.delenv("OUT")
    assert gpu_smoke.parse_args(["--device", "cpu"]).out == "benchmarks/results/gpu"


@pytest.mark.slow  # two 2-rank training jobs (about a minute); on a GPU, make gpu-report's stage runs it
@pytest.mark.timeout(600)
def test_cpu_fallback_trains_with_and_without_triton_and_compares(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    argv = ["--device", "cpu", "--presets", "sdp4bit", "--steps", "2", "--nproc", "2",
            "--ranks-per-node", "1", "--out", str(tmp_path / "out"), "--stage-timeout", "280"]
    rc = gpu_smoke.main(argv)
    result = json.loads((tmp_path / "out" / "gpu_smoke.json").read_text())
    assert rc == 0, result["stages"]
    assert [s["name"] for s in result["stages"]] == ["train sdp4bit (triton)", "train sdp4bit (reference)"]
    assert all(s["passed"] for s in result["stages"])
    compared = result["loss_comparison"]["sdp4bit"]  # the reference codecs on both runs without CUDA
    assert compared["bit_identical"] is True and compared["steps"] == 2
    assert result["meta"]["device"].startswith("cpu") and result["meta"]["torch"] == torch.__version__
    lines = capsys.readouterr().out.splitlines()  # a line as each run ended, then the verdict
    assert [ln.split()[:3] for ln in lines[:2]] == [["train", "sdp4bit", "(triton)"], ["train", "sdp4bit", "(reference)"]]
    assert lines[2].startswith("all passed")
