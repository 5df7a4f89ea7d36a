"""A step on host-staged hardware (gloo on CPUs), collective by collective.

The comm objects return only when their collective is done (on the host, gloo's collectives are
synchronous), so a rank's step is its compute and the host work of every collective in series,
and the inter-node link adds the time its bytes wait for it. The link is shaped by a token
bucket (the emulation's ``tbf``): it refills at the link's rate while the host works, up to
``Hardware.inter_burst_bytes``, and bytes that find tokens pass at once; a collective waits only
for the rest, less the host's own copy of its inter-node bytes that runs meanwhile. The compute
is spread evenly between the collectives (forward and backward run between the gathers and the
reduce-scatters of the FSDP groups).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from .collectives import Collective
from .comm_time import host_time, link_bytes, wire_parts
from .hardware import Hardware


def synchronous_step(compute_s: float, collectives: Sequence[Collective], hw: Hardware, nodes: int, m: int,
                     kernels: Mapping[str, float] | None = None) -> dict[str, float]:
    """Seconds of one rank's step of ``compute_s`` compute and ``collectives`` (in the order they
    run) on host-staged ``hw``: ``step_s``, and its parts ``host_s`` (compute and the
    collectives' host work) and ``link_wait_s`` (time waiting for the shaped link)."""
    rate = hw.inter_gbps * 1e9
    burst = hw.inter_burst_bytes
    share = compute_s / max(1, len(collectives))
    tokens, host, wait = burst, compute_s if not collectives else 0.0, 0.0
    for c in collectives:
        work = share + host_time(c, hw, nodes, m, kernels)
        host += work
        nbytes = link_bytes(c, nodes, m)
        if math.isinf(rate):
            continue
        # The bucket refills during all host work, that of collectives inside the node included.
        tokens = min(burst, tokens + work * rate)
        if nbytes == 0:
            continue
        # What the bucket cannot pass at once goes at the rate, while the host copies the bytes.
        short = max(0.0, nbytes - tokens)
        tokens = max(0.0, tokens - nbytes)
        wait += max(0.0, short / rate - wire_parts(c, hw, nodes, m)[2])
    return {"step_s": host + wait, "host_s": host, "link_wait_s": wait}
