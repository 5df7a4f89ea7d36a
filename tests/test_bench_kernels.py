"""``qsdp bench kernels``: argument handling and the refusal to measure without a GPU.

The measurements themselves need CUDA (``pytest -m gpu``); the workloads are checked against
their references under Triton's interpreter in tests/test_triton_kernels.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from qsdp.bench import kernels as bench


def test_sizes_accept_suffixes_and_round_down_to_whole_groups():
    assert bench.parse_size("16M") == 16 * 2**20
    assert bench.parse_size("1G") == 2**30
    assert bench.parse_size("100000") == 100000 // bench.ALIGN * bench.ALIGN
    with pytest.raises(ValueError, match="below the minimum"):
        bench.parse_size("1K")


def test_kernel_names_are_the_documented_ones():
    assert bench.KERNELS == ("quantize", "hadamard_quantize", "dequantize_accumulate", "dequantize_requantize",
                             "weight_difference_quantize", "replica_update")
    assert set(bench.WORKLOADS) == set(bench.KERNELS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
@pytest.mark.parametrize("argv", [[], ["--json"], ["--sizes", "16M", "--kernels", "quantize"]], ids=str)
def test_without_cuda_nothing_is_measured_and_the_exit_status_is_nonzero(capsys, argv):
    assert bench.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "needs a CUDA GPU" in out.err and "nothing was measured" in out.err


def test_bad_arguments_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--sizes", "1K"])
    assert e.value.code == 2 and "below the minimum" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--kernels", "nope"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_benchmark_json_has_every_kernel_and_exact_results(capsys):
    pytest.importorskip("triton", reason="triton is not installed")
    assert bench.main(["--json", "--sizes", "16M", "--repeats", "3", "--no-compile"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["kernels"]) == set(bench.KERNELS)
    for entry in result["kernels"].values():
        assert entry["n"] == 16 * 2**20 and entry["gbps"] > 0 and 0 < entry["fraction_of_copy"]
        assert entry["matches_reference"] is True and "speedup_vs_compiled_torch" in entry
