"""``qsdp check``: will this preset's communication hurt this model?

Measures, per FSDP group and in total, the quantities SDP4Bit's convergence theorem is about, on
real gradients and real optimizer steps, with the collectives of a ``D x M`` world emulated in
one process (no process group): the variance the gradient path adds next to the variance SGD
already has, the weight error next to one step's update, the weight-difference compressor's
relative error; then a verdict per layer with its reasons and fixes, on thresholds calibrated
against the committed convergence result (:mod:`qsdp.check.verdict`).
"""

from .emulate import difference_gather, direct_gather, flat_rows, reduce_scatter
from .measure import CheckSpec, GroupSums, Measurement, measure, measure_many
from .report import format_table, result

__all__ = ["CheckSpec", "GroupSums", "Measurement", "measure", "measure_many", "result", "format_table", "flat_rows",
           "reduce_scatter", "direct_gather", "difference_gather", "run_check"]


def run_check(spec: CheckSpec, preset: str = "sdp4bit", overrides: dict | None = None) -> dict:
    """Measure ``preset`` (with config ``overrides``) on ``spec`` and return :func:`result`."""
    from ..config import resolve_config

    return result(measure(spec, resolve_config(preset, overrides)))
