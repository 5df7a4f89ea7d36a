"""GPU types and their clusters: compute, memory and link speeds the performance model prices with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from .host_census import H200_HOST_FACTOR


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its cluster. Bandwidths are effective (achieved by NCCL), per GPU, one
    direction; ``inter_gbps`` is a GPU's share of its node's NIC bandwidth.

    ``codec_call_us``: the fixed cost of one codec call (dispatch and the small steps around the
    kernels), paid on top of its bytes over the kernel speed; it dominates for small shards.
    ``host_staged``: the transfers are copies by the same processors that run the codecs (gloo
    on CPUs): a rank's codec time, its intra-node bytes and its inter-node bytes (at
    ``intra_gbps``, the host's copy rate) add up, and only the inter-node link's own time (a
    shaped link slower than that copy) runs alongside them.
    ``call_us``, ``call_ns_per_element``: a host-staged cluster's measured host cost of one step
    of a comm object, by its name in :data:`~qsdp.perfmodel.collectives.CALLS`: fixed us per
    call and ns per element its collective carries (``Collective.elements``): its collective's
    latency and copies, its codec calls and the Python and torch work around them, all at once.
    A collective whose step is named here costs the host that instead of its latency, copies and
    codecs priced one by one.
    ``inter_burst_bytes``: a shaped inter-node link's token bucket, a GPU's share (bytes that
    pass at once after the link was idle long enough to refill it at ``inter_gbps``).
    ``host_factor``: a GPU host's time per microsecond of the census's host floor of a comm
    step (:mod:`qsdp.perfmodel.host_census`); the GPU waits for the host, so a step adds the
    floors of its collectives' comm steps times this (0: not priced).
    ``memory_gb``: one GPU's memory (0: not known). ``nics`` x ``nic_gbit``: a node's NICs and
    the line rate of each, of which the collectives achieve ``link_efficiency``; ``inter_gbps``
    is that, a GPU's share, in GB/s."""

    name: str
    gpus_per_node: int
    tflops: float
    mfu: float
    hbm_gbps: float
    intra_gbps: float
    inter_gbps: float
    intra_latency_us: float
    inter_latency_us: float
    quant_hbm_fraction: float = 0.5
    codec_call_us: float = 0.0
    host_staged: bool = False
    notes: tuple[str, ...] = ()
    call_us: Mapping[str, float] = field(default_factory=dict)
    call_ns_per_element: Mapping[str, float] = field(default_factory=dict)
    inter_burst_bytes: float = 0.0
    host_factor: float = 0.0
    memory_gb: float = 0.0
    nics: int = 0
    nic_gbit: float = 0.0
    link_efficiency: float = 1.0

    @property
    def quant_gbps(self) -> float:
        return self.quant_hbm_fraction * self.hbm_gbps


# NCCL over InfiniBand achieves about 80% of a NIC's line rate: the GPU types' default links.
NIC_EFFICIENCY = 0.8

HARDWARE: dict[str, Hardware] = {
    "a100": Hardware(
        name="a100", gpus_per_node=4, tflops=312.0, mfu=0.40, hbm_gbps=1555.0,
        intra_gbps=200.0, inter_gbps=3.36, intra_latency_us=3.0, inter_latency_us=8.0,
        memory_gb=40.0, nics=1, nic_gbit=107.52, link_efficiency=1.0,
        notes=(
            "4 A100-SXM4 per node: the authors' README says their A100 nodes hold 4 GPUs (so 128 "
            "GPUs = 32 nodes), and sets TP/PP so that TP stays inside a node",
            "NVLink3 inside the node, 200 GB/s per GPU per direction effective",
            "inter-node 13.4 GB/s per node (~107 Gb/s, 3.36 GB/s per GPU) effective: the paper "
            "does not name this network; this is what its Table 4 implies (the fp32 ring "
            "reduce-scatter of GPT-1.3B on 32 A100 took 379.3 ms), the only measurement of it",
            "312 TFLOP/s bf16 peak, MFU 0.40 (assumed), HBM 1555 GB/s (40 GB part)",
        ),
    ),
    "h100": Hardware(
        name="h100", gpus_per_node=8, tflops=989.0, mfu=0.40, hbm_gbps=3350.0,
        intra_gbps=360.0, inter_gbps=40.0, intra_latency_us=3.0, inter_latency_us=8.0,
        memory_gb=80.0, nics=8, nic_gbit=400.0, link_efficiency=NIC_EFFICIENCY,
        notes=(
            "8 H100-SXM5 per node (DGX/HGX H100)",
            "NVLink4 450 GB/s per GPU per direction; 360 GB/s effective (assumed: the 80% that "
            "H800's achieved 160 GB/s is of its 200)",
            "inter-node one 400 Gb/s InfiniBand NIC per GPU (8 per node, the DGX H100 build) at "
            "80% efficiency: 40 GB/s per GPU",
            "989 TFLOP/s bf16 dense peak, MFU 0.40 (assumed), HBM3 3350 GB/s, 80 GB",
        ),
    ),
    "h200": Hardware(
        name="h200", gpus_per_node=8, tflops=989.0, mfu=0.40, hbm_gbps=4800.0,
        intra_gbps=360.0, inter_gbps=40.0, intra_latency_us=3.0, inter_latency_us=8.0,
        memory_gb=141.0, nics=8, nic_gbit=400.0, link_efficiency=NIC_EFFICIENCY, host_factor=H200_HOST_FACTOR,
        notes=(
            "8 H200-SXM per node (HGX H200)",
            "NVLink4 as H100: 360 GB/s per GPU per direction effective (assumed)",
            "inter-node one 400 Gb/s NIC per GPU (8 per node, the usual HGX H200 build; assumed) "
            "at 80% efficiency: 40 GB/s per GPU",
            "989 TFLOP/s bf16 dense peak (H100's compute), MFU 0.40 (assumed), HBM3e 4800 GB/s, 141 GB",
            f"host: {H200_HOST_FACTOR:g} us per us of a comm step's census host floor, measured on one H200 "
            "(qsdp bench codec-share: each preset's wall step beyond fsdp's, over its reduce-scatters' "
            "census host floor)",
        ),
    ),
    "h800": Hardware(
        name="h800", gpus_per_node=8, tflops=989.0, mfu=0.40, hbm_gbps=3350.0,
        intra_gbps=160.0, inter_gbps=40.0, intra_latency_us=3.0, inter_latency_us=8.0,
        memory_gb=80.0, nics=8, nic_gbit=400.0, link_efficiency=NIC_EFFICIENCY,
        notes=(
            "8 H800-SXM5 per node (the authors' README)",
            "NVLink 160 GB/s per GPU effective (H800's 400 GB/s NVLink; the achieved figure "
            "DeepSeek-V3's report gives for H800 nodes)",
            "inter-node one 400 Gb/s InfiniBand NIC per GPU (8 per node, the usual HGX H800 "
            "build; assumed) at 80% efficiency: 40 GB/s per GPU",
            "989 TFLOP/s bf16 dense peak, MFU 0.40 (assumed), HBM 3350 GB/s, 80 GB",
        ),
    ),
}
# The GPU types of the SDP4Bit paper, whose measurements `qsdp bench simulate` compares with.
PAPER_GPUS = ("a100", "h800")


def custom_hardware(ranks_per_node: int, *, tflops: float, hbm_gbps: float, intra_gbps: float,
                    link_gbit: float, memory_gb: float = 0.0, mfu: float = 0.40,
                    intra_latency_us: float = 3.0, inter_latency_us: float = 8.0) -> Hardware:
    """A GPU type of the caller's figures (``qsdp advise --gpu custom``): ``ranks_per_node``
    GPUs of ``tflops`` bf16 peak (at ``mfu``), ``hbm_gbps`` GB/s of memory bandwidth and
    ``memory_gb`` of memory, ``intra_gbps`` GB/s per GPU inside the node, and a node link of
    ``link_gbit`` Gbit/s as the collectives achieve it."""
    figures = {"ranks_per_node": ranks_per_node, "tflops": tflops, "hbm_gbps": hbm_gbps,
               "intra_gbps": intra_gbps, "link_gbit": link_gbit, "mfu": mfu}
    for name, value in figures.items():
        if value is None or value <= 0:
            raise ValueError(f"{name}={value} must be positive")
    return Hardware(name="custom", gpus_per_node=ranks_per_node, tflops=tflops, mfu=mfu, hbm_gbps=hbm_gbps,
                    intra_gbps=intra_gbps, inter_gbps=link_gbit / 8 / ranks_per_node,
                    intra_latency_us=intra_latency_us, inter_latency_us=inter_latency_us,
                    memory_gb=memory_gb, nics=1, nic_gbit=link_gbit, notes=("the caller's figures",))


def cluster_hardware(gpu: str | Hardware = "h800", ranks_per_node: int | None = None, *,
                     link_gbit: float | None = None, link_gbit_per_gpu: float | None = None,
                     link_latency_us: float | None = None, intra_gbps: float | None = None,
                     host_factor: float | None = None) -> Hardware:
    """``HARDWARE[gpu]`` (or the given ``Hardware``) with nodes of ``ranks_per_node`` GPUs
    (default: the type's) and, where given, the measured or stated links: ``link_gbit`` is one
    node's inter-node link in Gbit/s per direction as the collectives achieve it (shared by its
    GPUs: each gets ``link_gbit / 8 / ranks_per_node`` GB/s), ``link_gbit_per_gpu`` the same as
    one GPU's share, ``link_latency_us`` its latency per step, ``intra_gbps`` a GPU's intra-node
    GB/s, ``host_factor`` the host's time per microsecond of a comm step's census host floor
    (0: not priced)."""
    if isinstance(gpu, Hardware):
        hw = gpu
    elif gpu in HARDWARE:
        hw = HARDWARE[gpu]
    else:
        raise ValueError(f"gpu={gpu!r}; known: {', '.join(HARDWARE)}")
    m = hw.gpus_per_node if ranks_per_node is None else ranks_per_node
    given = {"ranks_per_node": m, "link_gbit": link_gbit, "link_gbit_per_gpu": link_gbit_per_gpu,
             "intra_gbps": intra_gbps}
    for name, value in given.items():
        if value is not None and value <= 0:
            raise ValueError(f"{name}={value} must be positive")
    if link_gbit is not None and link_gbit_per_gpu is not None:
        raise ValueError("give link_gbit (a node's) or link_gbit_per_gpu (a GPU's share), not both")
    for name, value in (("link_latency_us", link_latency_us), ("host_factor", host_factor)):
        if value is not None and value < 0:
            raise ValueError(f"{name}={value} must not be negative")
    changes: dict[str, float] = {"gpus_per_node": m}
    if link_gbit is not None:
        changes["inter_gbps"] = link_gbit / 8 / m
    if link_gbit_per_gpu is not None:
        changes["inter_gbps"] = link_gbit_per_gpu / 8
    if link_latency_us is not None:
        changes["inter_latency_us"] = link_latency_us
    if intra_gbps is not None:
        changes["intra_gbps"] = intra_gbps
    if host_factor is not None:
        changes["host_factor"] = host_factor
    return dataclasses.replace(hw, **changes)
