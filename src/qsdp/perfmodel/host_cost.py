"""The GPU host's time per microsecond of the census's host floor, from one H200 measurement.

Each preset's step in ``qsdp bench codec-share`` on one H200 (commit c14eb26,
:data:`~qsdp.perfmodel.launches.H200_CODEC_SHARE`) took longer than ``fsdp``'s, whose
collectives are FSDP2's own: the host, issuing the quantized collectives while the GPU waits.
That code's reduce-scatters had, in the census (:mod:`qsdp.bench.host_floor`: 2 x 4, 6922
elements a rank), the host floors of :data:`C14EB26_REDUCE_SCATTER_US`. A preset's wall time
beyond ``fsdp``'s over the floors of the reduce-scatters of its step (one a group) is the H200
host's time per microsecond of floor (:func:`host_factors`); :func:`host_factor`, their median,
gives ``Hardware.host_factor`` of the ``h200`` type.

It is an upper bound: the excess is laid on the reduce-scatters alone, though that code's gathers
added host work of their own (their floors were not recorded); where they did, less time is left
per microsecond of floor.
"""

from __future__ import annotations

import statistics
from typing import Mapping, Sequence

from .collectives import step_collectives
from .launches import AT_C14EB26, CODEC_SHARE_GROUPS, H200_CODEC_SHARE, LaunchCounts

__all__ = ["step_launches", "host_factors", "host_factor", "C14EB26_REDUCE_SCATTER_US"]

# The census's host floor (microseconds a call) of each preset's reduce-scatter in the code the
# H200 measurement ran (commit c14eb26): qsdp bench census --world 2x4 --shard 6922, fused path.
C14EB26_REDUCE_SCATTER_US = {"qsdp": 243.0, "zeropp": 521.0, "sdp4bit": 2843.0}


def step_launches(preset: str, shards: Sequence[int], nodes: int, ranks_per_node: int,
                  gathers: Sequence[int], counts: LaunchCounts = AT_C14EB26) -> int:
    """Kernel launches the collectives of one step of ``preset`` add (the sum of
    ``Collective.launches``), for groups of ``shards`` gathered ``gathers`` times, counted as
    ``counts`` says (by default those of the code the H200 measurement ran)."""
    return sum(c.launches for c in step_collectives(preset, shards, nodes, ranks_per_node, gathers=list(gathers),
                                                   counts=counts))


def host_factors(measured: Mapping[str, tuple[float, float]] = H200_CODEC_SHARE,
                 floors: Mapping[str, float] = C14EB26_REDUCE_SCATTER_US, baseline: str = "fsdp") -> dict[str, float]:
    """Per preset of ``floors``: its step's wall time beyond ``baseline``'s (``measured``: ms,
    (GPU, wall)) over the census floors of its step's reduce-scatters (one per FSDP group)."""
    groups = len(CODEC_SHARE_GROUPS)
    base = measured[baseline][1]
    return {p: (measured[p][1] - base) * 1e3 / (groups * us) for p, us in floors.items()}


def host_factor(measured: Mapping[str, tuple[float, float]] = H200_CODEC_SHARE,
                floors: Mapping[str, float] = C14EB26_REDUCE_SCATTER_US) -> float:
    """The median of :func:`host_factors`."""
    return statistics.median(host_factors(measured, floors).values())
