"""What limits a predicted step: where its communication time goes, and the name of the part
that dominates.

:func:`step_parts` takes a step's collectives apart, collective by collective, before overlap
and pipelining: the seconds of their bytes on the inter-node link (a GPU's share of its node's
NICs), on the intra-node link, in latency and in the codecs, and the bytes per GPU on each link.
It also keeps the inter-node bytes of all-to-alls over the whole data-parallel group (a one-level
reduce-scatter) next to what a ring would put on the NIC for the same rows: an all-to-all sends
each row to every rank on the other nodes, ``(D - 1) M`` peers, where a ring passes ``(D M - 1) /
M`` chunks across a node's boundary per rank, about ``M`` times fewer. That fan-out is why a preset
that sends fewer bytes can still be slower than ``fsdp``.

:func:`limit` names what bounds a step: ``memory`` (the state does not fit), ``compute``
(communication is a small part of it), else the largest part of its communication: ``fan-out``
(the inter-node link, most of whose bytes are an all-to-all's fan-out), ``link`` (the
inter-node link), ``intra`` (the intra-node link), ``codec``, ``latency`` or ``host`` (the
host launching the collectives' kernels while the GPU waits: :mod:`qsdp.perfmodel.launches`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .codec_time import kernel_times
from .collectives import Collective
from .comm_time import link_bytes, wire_parts
from .hardware import Hardware

LIMITS = ("memory", "compute", "fan-out", "link", "intra", "codec", "latency", "host")
# Communication under this fraction of the compute time leaves little for quantization to save.
COMPUTE_BOUND = 0.1


def step_parts(collectives: Sequence[Collective], hw: Hardware, nodes: int, ranks_per_node: int,
               kernels: Mapping[str, float] | None = None) -> dict[str, float]:
    """Per GPU and step: ``nic_s``, ``intra_s``, ``latency_s``, ``codec_s`` (seconds, summed
    over the collectives); ``nic_bytes`` and ``intra_bytes`` (bytes on each link, as the time
    model charges them); ``a2a_nic_bytes`` (the part of ``nic_bytes`` that all-to-alls over the
    whole group send), ``a2a_ring_nic_bytes`` (what rings of the same rows would send) and
    ``a2a_inter_peers`` (the most ranks on other nodes one of them sends to);
    ``replica_fill_bytes`` (intra-node bytes of the node replicas' exact fill); ``launches``
    (the kernels the comm steps launch) and ``host_s`` (their host time: the census's host floor
    of each comm step times ``hw.host_factor``; 0 on host-staged hardware, whose measured host
    work is in its collectives' own time)."""
    m = ranks_per_node
    out = dict.fromkeys(("nic_s", "intra_s", "latency_s", "codec_s", "nic_bytes", "intra_bytes",
                         "a2a_nic_bytes", "a2a_ring_nic_bytes", "a2a_inter_peers", "replica_fill_bytes",
                         "launches", "host_s"), 0.0)
    for c in collectives:
        out["launches"] += c.launches
        if not hw.host_staged:
            out["host_s"] += c.host_us * hw.host_factor * 1e-6
        intra, inter, _, latency = wire_parts(c, hw, nodes, m)
        tq, tdq = kernel_times(c, hw, kernels)
        out["nic_s"] += inter
        out["intra_s"] += intra
        out["latency_s"] += latency
        out["codec_s"] += tq + tdq
        nic = link_bytes(c, nodes, m)
        out["nic_bytes"] += nic
        out["intra_bytes"] += intra * hw.intra_gbps * 1e9
        if c.call == "replica_fill":
            out["replica_fill_bytes"] += intra * hw.intra_gbps * 1e9
        if c.algo == "a2a" and c.inter_peers:
            out["a2a_nic_bytes"] += nic
            out["a2a_ring_nic_bytes"] += (c.intra_peers + c.inter_peers) * c.row_bytes / m
            out["a2a_inter_peers"] = max(out["a2a_inter_peers"], c.inter_peers)
    return out


def fan_out(parts: Mapping[str, float]) -> float:
    """How many times a ring's inter-node bytes the step's whole-group all-to-alls send (0 without)."""
    return parts["a2a_nic_bytes"] / parts["a2a_ring_nic_bytes"] if parts["a2a_ring_nic_bytes"] else 0.0


def limit(parts: Mapping[str, float], compute_s: float, comm_s: float, fits: bool = True) -> str:
    """The name (one of :data:`LIMITS`) of what bounds a step of these ``parts`` (see the module
    doc); ``fits``: whether its state fits in the GPU's memory."""
    if not fits:
        return "memory"
    if comm_s <= COMPUTE_BOUND * compute_s:
        return "compute"
    largest = max(("nic_s", "intra_s", "codec_s", "latency_s", "host_s"), key=lambda k: parts.get(k, 0.0))
    if largest == "nic_s":
        return "fan-out" if fan_out(parts) > 1.5 and 2 * parts["a2a_nic_bytes"] > parts["nic_bytes"] else "link"
    return {"intra_s": "intra", "codec_s": "codec", "latency_s": "latency", "host_s": "host"}[largest]
