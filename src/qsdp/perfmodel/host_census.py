"""The host's work per collective call on a GPU, from the census's host floor.

On a GPU a comm step's kernels are short, and between them the host runs the comm object's
Python and launches the next: where the host takes longer, the GPU waits. ``qsdp bench census``
measures that work on a CPU, a call at a time, with every kernel launch a no-op
(:mod:`qsdp.bench.host_floor`): :data:`HOST_US`, by preset and census collective. A GPU's host
takes longer than that floor (the launches themselves, the driver, another processor):
``Hardware.host_factor`` scales it, so a step's host time is the sum over its comm steps of
:func:`call_host_us` times that factor (:mod:`qsdp.perfmodel.host_cost` derives the H200's).

The figures are data, here alone; a test holds them to ``benchmarks/results/census-host.json``.
"""

from __future__ import annotations

__all__ = ["HOST_US", "HOST_US_SOURCE", "H200_HOST_FACTOR", "call_host_us"]

HOST_US_SOURCE = "qsdp bench census --world 2x4 --shard 6922 --runs 12 (benchmarks/results/census-host.json)"

# host_us of every quantized collective (rank 0 of 2 x 4, 6922 elements a rank): microseconds a
# steady call, the minimum over runs of 25 calls (benchmarks/results/census-host.json says how many).
HOST_US: dict[tuple[str, str], float] = {
    ("qsdp", "reduce_scatter"): 12.4,
    ("qsdp", "gather_direct"): 12.0,
    ("qsdp", "hsdp_all_reduce"): 20.3,
    ("sdp4bit", "reduce_scatter"): 19.7,
    ("sdp4bit", "gather_difference"): 18.8,
    ("sdp4bit", "gather_difference_step"): 35.7,
    ("sdp4bit", "hsdp_all_reduce"): 20.6,
    ("zeropp", "reduce_scatter"): 19.8,
    ("zeropp", "gather_direct"): 10.8,
    ("zeropp", "hsdp_all_reduce"): 20.3,
}

# qsdp.perfmodel.host_cost.host_factor() of the H200 measurement, rounded to 0.1 (a test
# recomputes it): an H200 host's microseconds per microsecond of the census's floor.
H200_HOST_FACTOR = 3.0

# The census collectives whose figure a comm step (perfmodel.collectives.CALLS, and the HSDP
# all-reduce) costs, less the second's where two are named: a node replica's fill is the census's
# gather without a change (its agreement included), a difference's exchange what a step's gather
# adds to it; a two-level reduce-scatter's figure goes to its first exchange. FSDP2's own
# collectives (a plain gather or reduce-scatter) add nothing beyond what fsdp's step has.
_CENSUS_OF = {
    "quantized_gather": ("gather_direct",),
    "replica_fill": ("gather_difference",),
    "difference_update": ("gather_difference_step", "gather_difference"),
    "one_level_reduce_scatter": ("reduce_scatter",),
    "two_level_slice": ("reduce_scatter",),
    "hsdp_all_reduce": ("hsdp_all_reduce",),
}


def _figure(preset: str, collective: str) -> float:
    """The census's figure of ``preset``'s ``collective``; for a config the census did not
    measure (a custom one), the largest of that collective's."""
    if (preset, collective) in HOST_US:
        return HOST_US[preset, collective]
    return max(us for (_, c), us in HOST_US.items() if c == collective)


def call_host_us(preset: str, call: str | None) -> float:
    """The census's host floor (microseconds) of one call of the comm step ``call`` of
    ``preset`` (a config's name); 0 for a step that is FSDP2's own collective or none."""
    names = _CENSUS_OF.get(call or "")
    if names is None:
        return 0.0
    us = _figure(preset, names[0])
    return max(0.0, us - _figure(preset, names[1])) if len(names) > 1 else us
