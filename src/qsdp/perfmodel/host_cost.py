"""The host's cost of one kernel launch, from one measurement of a step's wait for the host.

Each preset's step in ``qsdp bench codec-share`` on a GPU waits for the host by its wall time
less its GPU time. ``sdp4bit``'s wait beyond ``fsdp``'s (whose collectives launch nothing beyond
FSDP2's own), divided by the launches its collectives add to that step (:func:`step_launches`,
the counts of :mod:`qsdp.perfmodel.launches`), is the host's time per launch, the Python around
it included: :func:`launch_cost_us`, which gives ``Hardware.launch_us`` of the ``h200`` type.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .collectives import step_collectives
from .launches import AT_C14EB26, CODEC_SHARE_GROUPS, CODEC_SHARE_SHARD, CODEC_SHARE_WORLD, H200_CODEC_SHARE, LaunchCounts

__all__ = ["step_launches", "launch_cost_us"]


def step_launches(preset: str, shards: Sequence[int], nodes: int, ranks_per_node: int,
                  gathers: Sequence[int], counts: LaunchCounts = AT_C14EB26) -> int:
    """Kernel launches the collectives of one step of ``preset`` add (the sum of
    ``Collective.launches``), for groups of ``shards`` gathered ``gathers`` times, counted as
    ``counts`` says (by default those of the code the H200 measurement ran)."""
    return sum(c.launches for c in step_collectives(preset, shards, nodes, ranks_per_node, gathers=list(gathers),
                                                   counts=counts))


def launch_cost_us(measured: Mapping[str, tuple[float, float]] = H200_CODEC_SHARE, preset: str = "sdp4bit",
                   baseline: str = "fsdp") -> float:
    """Microseconds of host per launch: ``preset``'s wait for the host (wall less GPU time)
    beyond ``baseline``'s, over the launches its collectives add beyond ``baseline``'s, in a step
    of the codec-share measurement (:data:`qsdp.perfmodel.launches.H200_CODEC_SHARE`)."""
    d, m = CODEC_SHARE_WORLD
    shards = [CODEC_SHARE_SHARD] * len(CODEC_SHARE_GROUPS)

    def wait_ms(p: str) -> float:
        gpu, wall = measured[p]
        return wall - gpu

    def launches(p: str) -> int:
        return step_launches(p, shards, d, m, CODEC_SHARE_GROUPS)

    extra = launches(preset) - launches(baseline)
    if extra <= 0:
        raise ValueError(f"{preset} adds no launches to {baseline}'s step: nothing to divide its host time over")
    return (wait_ms(preset) - wait_ms(baseline)) * 1e3 / extra
