"""A training step's host time split by phase, from ``torch.profiler`` averages: what the
workload (:mod:`qsdp.bench.workload`) records when profiled and ``qsdp bench phases``
(:mod:`qsdp.bench.phases`) reports."""

from __future__ import annotations

from typing import Any, Iterable

# Phase -> the profiler labels (without FSDP2's " (module fqn)" suffix) whose inclusive host
# time it sums; these regions never nest inside one another.
PHASE_LABELS: dict[str, tuple[str, ...]] = {
    "weights_gather": ("FSDP::all_gather",),
    "weights_wait_decode": ("FSDP::all_gather_copy_out",),
    "grads_reduce": ("FSDP::post_backward_reduce", "FSDP::post_backward_rs_wait",
                     "FSDP::root_post_backward_callback"),
    "optimizer": ("Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad"),
    "barrier": ("c10d::barrier",),
}
PHASES: tuple[str, ...] = (*PHASE_LABELS, "compute_other")


def _base_label(key: str) -> str:
    return key.split(" (", 1)[0]


def phase_times(events: Iterable[Any], total_s: float, steps: int) -> dict[str, float]:
    """Seconds per step in each phase from profiler averages (``profiler.key_averages()``: items
    with ``key`` and ``cpu_time_total`` in microseconds); ``compute_other`` is the remainder of
    ``total_s``, the summed wall time of the ``steps`` profiled steps."""
    label_phase = {label: phase for phase, labels in PHASE_LABELS.items() for label in labels}
    out = dict.fromkeys(PHASES, 0.0)
    for event in events:
        phase = label_phase.get(_base_label(event.key))
        if phase is not None:
            out[phase] += event.cpu_time_total * 1e-6 / steps
    out["compute_other"] = max(0.0, total_s / steps - sum(out.values()))
    return out
