"""The CPU parameter dtype the demo picks: bf16 only where this CPU computes it natively."""

import pytest

from qsdp.train.runtime import choose_cpu_param_dtype, cpu_param_dtype


@pytest.mark.parametrize("fp32_s,bf16_s,expected", [
    (1.0, 0.6, "bfloat16"),  # native bf16 units: faster than fp32
    (1.0, 1.4, "bfloat16"),
    (1.0, 4.4, "float32"),  # emulated bf16 (an AVX2-only CPU): several times slower
])
def test_bf16_is_chosen_only_where_it_is_about_as_fast_as_fp32(fp32_s, bf16_s, expected):
    assert choose_cpu_param_dtype(fp32_s, bf16_s) == expected


def test_the_probe_measures_both_dtypes_and_agrees_with_its_ratio():
    dtype, ratio = cpu_param_dtype(size=64, repeats=2)
    assert ratio > 0 and dtype == choose_cpu_param_dtype(1.0, ratio)
