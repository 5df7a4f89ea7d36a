"""Communication time of a step's collectives: an alpha-beta model of the links plus the codec
time of each collective.

Plain and quantized all-gathers and the plain reduce-scatter are NCCL rings: each GPU sends
``(P - 1)`` chunks over NVLink, and each node sends ``(P - 1)`` chunks across its boundary per
data-parallel group, shared by its ``M`` ranks of that group. All-to-alls are direct: every byte
the meter counts as inter-node crosses the NIC. Every GPU of a node runs its collective at the
same time (each tensor-parallel rank has its own data-parallel group), so a GPU gets ``1/G`` of
its node's NIC bandwidth (``G`` GPUs per node; the same as one NIC per GPU as in DGX boxes) and
all of its own NVLink bandwidth. A ring step costs the latency ``alpha`` of the slowest link it
crosses; an all-to-all costs ``alpha`` per peer. The two-level reduce-scatter's exchanges (one
per pipeline slice) run as a 5-stage pipeline (quantize, intra all-to-all,
dequantize+requantize, inter all-to-all, dequantize). A ``ring_allreduce`` (a reduce-scatter
run as an all-reduce, as gloo does) costs twice a ring's bytes and steps.

Host-staged hardware (``Hardware.host_staged``: gloo on CPUs) has no engine apart from the
host but the inter-node link itself: the codecs, the copies of every byte a rank sends and the
latency of every step add up, and only the link's own time (a shaper slower than the host's
copy) is reported apart; :func:`qsdp.perfmodel.synchronous_step` adds the part of it the host
waits for.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from .codec_time import kernel_times
from .collectives import Collective
from .hardware import Hardware


def link_bytes(c: Collective, nodes: int, m: int) -> float:
    """Bytes of one collective of a rank in a D x M group over the inter-node link, its share of
    its node's: a ring's ``k (P - 1)`` chunks cross each node's boundary (shared by its ``M``
    ranks; ``k = 2`` for a ``ring_allreduce``), an all-to-all's rows to the other nodes' peers."""
    if c.algo in ("ring", "ring_allreduce"):
        k = 2 if c.algo == "ring_allreduce" else 1
        return k * (nodes * m - 1) * c.row_bytes / m if nodes > 1 else 0.0
    if c.algo in ("a2a", "a2a_inter"):
        return c.inter_peers * c.row_bytes
    return 0.0


def wire_parts(c: Collective, hw: Hardware, nodes: int, m: int) -> tuple[float, float, float, float]:
    """Seconds of one collective of a rank in a D x M group, in parts: ``(intra, inter,
    inter_copy, latency)``: its bytes over the intra-node link, over its share of the inter-node
    link, the same inter-node bytes at the intra-node (host copy) rate, and the latency of its
    steps. ``ring_allreduce`` is a reduce-scatter run as a ring all-reduce (twice a ring's bytes
    and steps; gloo's plain reduce-scatter)."""
    p = nodes * m
    bi, be = hw.intra_gbps * 1e9, hw.inter_gbps * 1e9
    ai, ae = hw.intra_latency_us * 1e-6, hw.inter_latency_us * 1e-6
    b = c.row_bytes
    if c.algo in ("ring", "ring_allreduce"):
        if p == 1:
            return 0.0, 0.0, 0.0, 0.0
        k = 2 if c.algo == "ring_allreduce" else 1
        inter_bytes = link_bytes(c, nodes, m)
        return (k * (p - 1) * b / bi if m > 1 else 0.0, inter_bytes / be, inter_bytes / bi,
                k * (p - 1) * (ae if nodes > 1 else ai))
    if c.algo in ("a2a", "a2a_intra", "a2a_inter"):
        intra = c.intra_peers if c.algo != "a2a_inter" else 0
        inter = c.inter_peers if c.algo != "a2a_intra" else 0
        return intra * b / bi, inter * b / be, inter * b / bi, intra * ai + inter * ae
    if c.algo == "allreduce":
        return 0.0, 0.0, 0.0, 2 * math.ceil(math.log2(max(p, 2))) * (ae if nodes > 1 else ai)
    raise ValueError(f"unknown collective algorithm {c.algo!r}")


def wire_time(c: Collective, hw: Hardware, nodes: int, m: int) -> float:
    """Seconds on the wire (alpha-beta) of one collective of a rank in a D x M group: the
    slower of its two links (or, ``hw.host_staged``, the host's copies of all its bytes and
    the inter-node link), plus its latency."""
    intra, inter, inter_copy, latency = wire_parts(c, hw, nodes, m)
    if hw.host_staged:
        return max(intra + inter_copy, inter) + latency
    return max(intra, inter) + latency


def measured_call_s(c: Collective, hw: Hardware) -> float | None:
    """The measured host seconds of collective ``c`` (``hw.call_us`` and
    ``hw.call_ns_per_element`` of the comm step it starts, for its elements); 0 for the second
    hop of a two-level exchange whose step is measured (the exchange's cost holds it); ``None`` where
    its step is not measured."""
    name = "two_level_slice" if c.call is None and c.hop == 2 else c.call
    if name not in hw.call_us:
        return None
    if c.call is None:
        return 0.0
    return hw.call_us[name] * 1e-6 + hw.call_ns_per_element.get(name, 0.0) * 1e-9 * c.elements


def host_time(c: Collective, hw: Hardware, nodes: int, m: int, kernels: Mapping[str, float] | None) -> float:
    """Seconds of one rank's host for collective ``c`` on host-staged hardware: the measured cost
    of its comm step (:func:`measured_call_s`), else its codecs, the copies of all the bytes it
    sends (a ring's chunks go to one neighbour, inside the node or across; an all-to-all's rows
    to every peer) and its latency."""
    measured = measured_call_s(c, hw)
    if measured is not None:
        return measured
    intra, _, inter_copy, latency = wire_parts(c, hw, nodes, m)
    copies = max(intra, inter_copy) if c.algo in ("ring", "ring_allreduce") else intra + inter_copy
    tq, tdq = kernel_times(c, hw, kernels)
    return tq + tdq + copies + latency


def comm_time(collectives: Sequence[Collective], hw: Hardware, nodes: int, ranks_per_node: int,
              kernels: Mapping[str, float] | None = None) -> dict[str, float]:
    """Seconds of communication per kind (``weights``, ``grads``, ``control``), of the
    quantization kernels included in them (``kernels``) and of the inter-node link apart
    (``link``, host-staged only). Non-pipelined collectives run their quantize, transfer and
    dequantize one after the other; the ``S`` exchanges of a two-level reduce-scatter flow
    through 5 stages: ``sum / S + (S - 1) / S * max`` of the stage totals.

    ``hw.host_staged``: each kind holds the host's work alone (codecs, the copies of all bytes,
    latency), serial, and ``link`` the inter-node link's own time, which runs alongside the
    host (the caller decides how much of it the host waits for: see ``synchronous_step``)."""
    res = {"weights": 0.0, "grads": 0.0, "control": 0.0, "kernels": 0.0, "link": 0.0}
    pipes: dict[int, list[tuple[Collective, float, float]]] = {}
    for c in collectives:
        tq, tdq = kernel_times(c, hw, kernels)
        res["kernels"] += tq + tdq
        if hw.host_staged:
            res[c.kind] += host_time(c, hw, nodes, ranks_per_node, kernels)
            res["link"] += wire_parts(c, hw, nodes, ranks_per_node)[1]
        elif c.pipeline is not None:
            pipes.setdefault(c.pipeline, []).append((c, tq, tdq))
        else:
            res[c.kind] += tq + wire_time(c, hw, nodes, ranks_per_node) + tdq
    for parts in pipes.values():
        stages = [0.0] * 5
        for c, tq, tdq in parts:
            first = 0 if c.hop == 1 else 2
            stages[first] += tq
            stages[first + 1] += wire_time(c, hw, nodes, ranks_per_node)
            stages[first + 2] += tdq
        s = max(1, sum(1 for c, _, _ in parts if c.hop == 1))
        res[parts[0][0].kind] += sum(stages) / s + (s - 1) / s * max(stages)
    return res
