"""``qsdp bench simulate``: an alpha-beta model of one training step, per preset, at cluster scale.

What it models, for ``P`` data-parallel GPUs in ``D`` nodes of ``M`` ranks each:

* **Bytes.** :func:`step_collectives` lists every collective one rank runs in a step, with the
  exact per-peer wire size of each, computed with ``RowCodec.row_nbytes`` and the same codecs,
  slices and padding as :mod:`qsdp.comm.all_gather` and :mod:`qsdp.comm.reduce_scatter`.
  :func:`step_bytes` sums them the way the byte meter does (a buffer of ``B`` bytes to ``k`` peers
  counts ``k * B``, split intra/inter node); a test checks it against the meter of a real run.
* **Communication time.** Plain and quantized all-gathers and the plain reduce-scatter are NCCL
  rings: each GPU sends ``(P - 1)`` chunks over NVLink, and each node sends ``(P - 1)`` chunks
  across its boundary per data-parallel group, shared by its ``M`` ranks of that group. All-to-alls
  are direct: every byte the meter counts as inter-node crosses the NIC. Every GPU of a node runs
  its collective at the same time (each tensor-parallel rank has its own data-parallel group), so
  a GPU gets ``1/G`` of its node's NIC bandwidth (``G`` GPUs per node; the same as one NIC per GPU
  as in DGX boxes) and all of its own NVLink bandwidth. A ring step costs the latency ``alpha`` of
  the slowest link it crosses; an all-to-all costs ``alpha`` per peer. The two-level
  reduce-scatter's ``pipeline_slices`` run as a 5-stage pipeline (quantize, intra all-to-all,
  dequantize+requantize, inter all-to-all, dequantize).
* **Quantization time.** Elements quantized and dequantized per collective, at the bandwidth of
  the kernel benchmark (``--kernels FILE``) or, by default, half the GPU's HBM bandwidth (in GB/s
  of the high-precision tensor), counted as part of the collective it serves.
* **Compute time.** Model FLOPs (:func:`qsdp.train.model.flops_per_token`, the ``6 N`` estimate
  plus attention) over peak bf16 TFLOP/s times one MFU per GPU type, times the pipeline bubble
  ``(m + PP - 1) / m`` for ``m`` micro-batches.
* **Step.** ``compute + max(0, communication - overlap * compute)``: communication hides behind
  at most ``overlap`` of the compute time. The SDP4Bit speed runs (Megatron-LM, distributed
  optimizer, no ``--overlap-grad-reduce``/``--overlap-param-gather``) overlap nothing: 0.

The paper setups (Table 2 of SDP4Bit): GPT 1.3B-18B at sequence 2048, micro-batch 1, one
micro-batch per step, 128 GPUs, the authors' tensor/pipeline-parallel sizes (their README), one
weight all-gather and one gradient reduce-scatter per step over one flat buffer (Megatron's
distributed optimizer), bf16 weights and fp32 gradients on the wire for the baseline.

The model ignores: tensor- and pipeline-parallel communication (folded into the MFU), the
optimizer step, congestion and stragglers, NCCL's protocol and algorithm switching (tree, PAT,
NVLS/SHARP), quantization kernels slowing the compute they overlap, memory-bound small
collectives, and anything else that differs between the paper's cluster and these stated numbers;
its errors against the paper are reported, not fitted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..comm.all_gather import weight_codec
from ..comm.difference import replica_layout
from ..comm.reduce_scatter import grad_codec
from ..comm.reduce_scatter import real_elements, pipeline_slices_bounds
from ..config import QuantConfig, resolve_config
from ..text_table import aligned
from ..train.model import GPTConfig, flops_per_token, n_params

from .report import BENCH_PRESETS, bar_chart, emit, meta, png_next_to

DEFAULT_PRESETS = BENCH_PRESETS
_DTYPES = {4: torch.float32, 2: torch.bfloat16}

# --------------------------------------------------------------------------------------------
# Bytes: the collectives of one step, as the comm objects run them.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """One collective call of one rank.

    ``row_bytes`` is what this rank sends to *each* peer (the meter records
    ``row_bytes * intra_peers`` and ``row_bytes * inter_peers``); ``elements`` the elements that
    buffer carries. ``algo``: ``ring`` (an NCCL all-gather / reduce-scatter over the whole group,
    ``row_bytes`` is one rank's chunk), ``a2a`` (all-to-all over the whole group), ``a2a_intra``
    (among the ``M`` ranks of the node), ``a2a_inter`` (among the ``D`` ranks with this local
    rank) or ``allreduce`` (a tiny control all-reduce). ``quantize`` / ``dequantize``: elements
    this rank encodes and decodes for it (``hp_bytes`` bytes each on the high-precision side).
    ``pipeline``/``hop``: slices of one pipelined two-level reduce-scatter share a pipeline id.
    """

    kind: str
    algo: str
    row_bytes: int
    elements: int
    intra_peers: int
    inter_peers: int
    quantize: int = 0
    dequantize: int = 0
    hp_bytes: int = 4
    hadamard: bool = False
    pipeline: int | None = None
    hop: int = 0


def _gathers_per_group(gathers: int | Sequence[int] | None, n_groups: int, zero3: bool) -> list[int]:
    if gathers is None:
        return [2 if zero3 else 1] * n_groups
    if isinstance(gathers, int):
        return [gathers] * n_groups
    if len(gathers) != n_groups:
        raise ValueError(f"gathers has {len(gathers)} entries for {n_groups} FSDP groups")
    return list(gathers)


def _difference_gathers(layout: str, quant: "Collective", plain: "Collective", calls: int,
                        d: int, m: int) -> list["Collective"]:
    """A group's weight-difference gathers in one step: one carries the change, the others only
    fill the output from the replica (see :mod:`qsdp.comm.difference`)."""
    if layout == "full":
        return [quant] if calls else []
    if layout == "exact":
        return [plain] * calls
    # node replicas: the change among the D holders of my rows, then every gather fills the
    # output with the node's rows, exactly
    n, pb = quant.elements, plain.hp_bytes
    between = dataclasses.replace(quant, algo="a2a_inter", intra_peers=0, inter_peers=d - 1, dequantize=d * n)
    inside = dataclasses.replace(plain, algo="a2a_intra", row_bytes=d * n * pb, elements=d * n,
                                 intra_peers=m - 1, inter_peers=0)
    return ([between] if calls else []) + [inside] * calls


def _grad_collectives(cfg: QuantConfig, shard_sizes: Sequence[int], d: int, m: int, grad_bytes: int) -> list[Collective]:
    """The gradient reduce-scatters (qsdp.comm.reduce_scatter) of one step, one per group, on
    ``d`` nodes x ``m`` ranks."""
    world = m * d
    intra, inter = m - 1, world - m  # Topology.peers()
    g = cfg.grads
    thresh = max(1, cfg.min_shard_numel)
    out: list[Collective] = []
    raw = _DTYPES[grad_bytes]
    for gi, s in enumerate(shard_sizes):
        if g.mode == "plain" or s < thresh:
            out.append(Collective("grads", "ring", s * grad_bytes, s, intra, inter, hp_bytes=grad_bytes))
            continue
        if g.mode == "one_level" or d == 1 or m == 1:
            bits = g.bits if g.mode == "one_level" else (g.bits_intra if d == 1 else g.bits_inter)
            codec = grad_codec(g, bits, raw)
            inter_only = g.mode != "one_level" and d > 1
            out.append(Collective(
                "grads", "a2a", codec.row_nbytes(s), s, 0 if inter_only else intra, inter,
                quantize=world * codec.padded_len(s), dequantize=world * codec.padded_len(s),
                hp_bytes=grad_bytes, hadamard=bool(codec.hadamard_block and not codec.exact),
            ))
            continue
        hop1 = grad_codec(g, g.bits_intra, raw)
        hop2 = grad_codec(g, g.bits_inter, torch.float32)
        lp = hop1.padded_len(s)
        for a, b in pipeline_slices_bounds(lp, hop1, g.pipeline_slices, g.pipeline_min_slice):
            width = b - a
            out.append(Collective(
                "grads", "a2a_intra", d * hop1.row_nbytes(width), d * real_elements(a, b, s), m - 1, 0,
                quantize=world * width, dequantize=world * width, hp_bytes=grad_bytes,
                hadamard=bool(hop1.hadamard_block and not hop1.exact), pipeline=gi, hop=1,
            ))
            out.append(Collective(
                "grads", "a2a_inter", hop2.row_nbytes(width), real_elements(a, b, s), 0, d - 1,
                quantize=d * width, dequantize=d * width, hp_bytes=4, pipeline=gi, hop=2,
            ))
    return out


def step_collectives(
    config: str | QuantConfig,
    shard_sizes: Sequence[int],
    nodes: int,
    ranks_per_node: int,
    *,
    zero3: bool = True,
    gathers: int | Sequence[int] | None = None,
    param_bytes: int = 2,
    grad_bytes: int = 4,
) -> list[Collective]:
    """Every collective one rank runs in one steady-state training step (after the warm-up step
    that establishes weight-difference replicas), for FSDP groups whose per-rank shard (the
    all-gather input = the reduce-scatter output) has ``shard_sizes[i]`` elements.

    ``zero3``: weights are gathered before forward and again before backward (FSDP2's
    ``reshard_after_forward=True``); otherwise once per step (ZeRO-2 / Megatron's distributed
    optimizer). ``gathers`` overrides the count per group. A weight-difference gather whose shard
    did not change (the second gather of a step) sends no difference (node replicas still fill
    the output inside the node); the difference gathers agree once per step. ``param_bytes``: the
    all-gather dtype's size; ``grad_bytes``: the reduce dtype's size.
    """
    cfg = resolve_config(config)
    if grad_bytes not in _DTYPES or param_bytes not in _DTYPES:
        raise ValueError(f"param_bytes={param_bytes}, grad_bytes={grad_bytes}: each must be 2 (bf16) or 4 (fp32)")
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"nodes={nodes} and ranks_per_node={ranks_per_node} must be positive")
    m, d = ranks_per_node, nodes
    world = m * d
    intra, inter = m - 1, world - m  # Topology.peers()
    w = cfg.weights
    thresh = max(1, cfg.min_shard_numel)
    out: list[Collective] = []
    per_group = _gathers_per_group(gathers, len(shard_sizes), zero3)

    def plain_gather(n: int) -> Collective:
        return Collective("weights", "ring", n * param_bytes, n, intra, inter, hp_bytes=param_bytes)

    # Weight all-gathers (qsdp.comm.all_gather).
    for n, calls in zip(shard_sizes, per_group):
        if w.mode == "plain" or n < thresh:
            out += [plain_gather(n) for _ in range(calls)]
            continue
        codec = weight_codec(w)
        quant = Collective("weights", "ring", codec.row_nbytes(n), n, intra, inter,
                           quantize=n, dequantize=world * n, hp_bytes=param_bytes)
        if w.mode == "direct":
            out += [quant] * calls
        else:
            out += _difference_gathers(replica_layout(w.replica, d, m), quant, plain_gather(n), calls, d, m)
    if w.mode == "difference":  # one agreement per step: 2 int32 flags per group
        out.append(Collective("control", "allreduce", 8 * len(shard_sizes), 0, intra, inter))

    out += _grad_collectives(cfg, shard_sizes, d, m, grad_bytes)
    return out


def step_bytes(
    config: str | QuantConfig,
    shard_sizes: Sequence[int],
    nodes: int,
    ranks_per_node: int,
    *,
    zero3: bool = True,
    gathers: int | Sequence[int] | None = None,
    param_bytes: int = 2,
    grad_bytes: int = 4,
) -> dict[str, dict[str, int]]:
    """Bytes one rank puts on the wire in one steady-state step, as the byte meter counts them:
    ``{"weights": {"intra", "inter"}, "grads": {"intra", "inter"}}``. Arguments as in
    :func:`step_collectives` (control flags are not included)."""
    res = {k: {"intra": 0, "inter": 0} for k in ("weights", "grads")}
    for c in step_collectives(config, shard_sizes, nodes, ranks_per_node, zero3=zero3,
                              gathers=gathers, param_bytes=param_bytes, grad_bytes=grad_bytes):
        if c.kind in res:
            res[c.kind]["intra"] += c.row_bytes * c.intra_peers
            res[c.kind]["inter"] += c.row_bytes * c.inter_peers
    return res


# --------------------------------------------------------------------------------------------
# HSDP: FSDP2 shards inside the node, the nodes hold replicas (qsdp.comm.hsdp).
# --------------------------------------------------------------------------------------------

HSDP_PRESETS = ("fsdp", "hsdp4", "sdp4bit")


def hsdp_collectives(
    config: str | QuantConfig,
    shard_sizes: Sequence[int],
    nodes: int,
    ranks_per_node: int,
    *,
    zero3: bool = True,
    param_bytes: int = 2,
    grad_bytes: int = 4,
) -> list[Collective]:
    """Every collective one rank runs in one steady-state HSDP step: the config's gathers and
    reduce-scatters over the ``ranks_per_node`` ranks of the node (``shard_sizes``: per-rank
    shards of that group), then the all-reduce across the ``nodes`` replicas as ``config.hsdp``
    says: ``plain`` is a reduce-scatter and an all-gather of fp32 chunks (FSDP2's native HSDP,
    as a ring), ``quantized`` the two all-to-all phases of :class:`qsdp.comm.hsdp.ReplicaAllReduce`."""
    from ..comm.hsdp import chunk_len, hsdp_codec

    cfg = resolve_config(config)
    out = step_collectives(cfg, shard_sizes, 1, ranks_per_node, zero3=zero3,
                           param_bytes=param_bytes, grad_bytes=grad_bytes)
    d = nodes
    if d == 1:
        return out
    for s in shard_sizes:
        if cfg.hsdp.mode == "plain" or s < max(1, cfg.min_shard_numel):
            chunk = -(-s // d)
            out += [Collective("grads", "a2a_inter", chunk * 4, chunk, 0, d - 1)] * 2
            continue
        codec = hsdp_codec(cfg.hsdp)
        length = chunk_len(s, d, codec)
        row = codec.row_nbytes(length)
        out.append(Collective("grads", "a2a_inter", row, length, 0, d - 1, quantize=d * length,
                              dequantize=d * length, hadamard=bool(codec.hadamard_block)))
        out.append(Collective("grads", "a2a_inter", row, length, 0, d - 1, quantize=length,
                              dequantize=d * length))
    return out


def simulate_hsdp_step(setup: "Setup", preset: str | QuantConfig, hw: "Hardware", *, overlap: float = 0.0,
                       kernels: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Predicted HSDP step (seconds): each data-parallel group shards over its ranks in one
    node (``M``) and replicates across its ``D`` nodes."""
    nodes, m = setup.dp_topology(hw.gpus_per_node)
    shards = shard_sizes(dataclasses.replace(setup, gpus=m * setup.tp * setup.pp))
    colls = hsdp_collectives(preset, shards, nodes, m, zero3=setup.zero3)
    # Rings run inside the node (one node of M ranks); the all-reduce's all-to-alls name their
    # inter-node peers themselves.
    ct = comm_time(colls, hw, 1, m, kernels)
    comp = compute_time(setup, hw)
    comm = ct["weights"] + ct["grads"] + ct["control"]
    exposed = max(0.0, comm - overlap * comp)
    return {"step_s": comp + exposed, "compute_s": comp, "comm_s": comm, "weights_s": ct["weights"],
            "grads_s": ct["grads"], "kernels_s": ct["kernels"]}


def _hsdp_rows(setup: "Setup", hw: "Hardware", overlap: float, kernels, flat_fsdp_s: float) -> dict[str, Any]:
    """A case's HSDP entries: step ms per preset (``fsdp`` = FSDP2's native HSDP), and speedups
    over native HSDP and over the flat (fully sharded) fsdp baseline."""
    steps = {p: simulate_hsdp_step(setup, p, hw, overlap=overlap, kernels=kernels)["step_s"] for p in HSDP_PRESETS}
    native = steps["fsdp"]
    return {"hsdp_step_ms": {p: 1e3 * t for p, t in steps.items()},
            "hsdp_speedup_over_native": {p: native / t for p, t in steps.items()},
            "hsdp_speedup_over_fsdp": {p: flat_fsdp_s / t for p, t in steps.items()}}


# --------------------------------------------------------------------------------------------
# Hardware and time.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its cluster. Bandwidths are effective (achieved by NCCL), per GPU, one
    direction; ``inter_gbps`` is a GPU's share of its node's NIC bandwidth."""

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
    notes: tuple[str, ...] = ()

    @property
    def quant_gbps(self) -> float:
        return self.quant_hbm_fraction * self.hbm_gbps


HARDWARE: dict[str, Hardware] = {
    "a100": Hardware(
        name="a100", gpus_per_node=4, tflops=312.0, mfu=0.40, hbm_gbps=1555.0,
        intra_gbps=200.0, inter_gbps=3.36, intra_latency_us=3.0, inter_latency_us=8.0,
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
    "h800": Hardware(
        name="h800", gpus_per_node=8, tflops=989.0, mfu=0.40, hbm_gbps=3350.0,
        intra_gbps=160.0, inter_gbps=40.0, intra_latency_us=3.0, inter_latency_us=8.0,
        notes=(
            "8 H800-SXM5 per node (the authors' README)",
            "NVLink 160 GB/s per GPU effective (H800's 400 GB/s NVLink; the achieved figure "
            "DeepSeek-V3's report gives for H800 nodes)",
            "inter-node one 400 Gb/s InfiniBand NIC per GPU (8 per node, the usual HGX H800 "
            "build; assumed) at 80% efficiency: 40 GB/s per GPU",
            "989 TFLOP/s bf16 dense peak, MFU 0.40 (assumed), HBM 3350 GB/s",
        ),
    ),
}

KERNEL_NAMES = ("quantize", "dequantize", "hadamard_quantize")


def load_kernels(path: str) -> dict[str, float]:
    """``{"kernels": {"<name>": {"gbps": ..}}}`` -> ``{name: GB/s}`` for the names this model
    uses (``quantize``, ``dequantize``, ``hadamard_quantize``); ``gbps`` is read as GB/s of the
    high-precision (fp32/bf16) tensor the kernel reads or writes."""
    with open(path) as f:
        data = json.load(f)
    kernels = data.get("kernels", data) if isinstance(data, dict) else None
    if not isinstance(kernels, dict):
        raise ValueError(f"{path}: expected {{\"kernels\": {{name: {{\"gbps\": ..}}}}}}")
    out = {}
    for name, entry in kernels.items():
        gbps = entry.get("gbps") if isinstance(entry, dict) else None
        if isinstance(gbps, (int, float)) and gbps > 0:
            out[name] = float(gbps)
    if "quantize" not in out and "dequantize" not in out:
        raise ValueError(f"{path}: no 'quantize' or 'dequantize' kernel with a positive 'gbps'")
    return out


def _kernel_gbps(hw: Hardware, kernels: Mapping[str, float] | None, name: str) -> float:
    k = kernels or {}
    if name == "hadamard_quantize":
        return k.get(name, k.get("quantize", hw.quant_gbps))
    return k.get(name, hw.quant_gbps)


def _kernel_times(c: Collective, hw: Hardware, kernels) -> tuple[float, float]:
    q = _kernel_gbps(hw, kernels, "hadamard_quantize" if c.hadamard else "quantize")
    dq = _kernel_gbps(hw, kernels, "dequantize")
    return c.quantize * c.hp_bytes / (q * 1e9), c.dequantize * c.hp_bytes / (dq * 1e9)


def _wire_time(c: Collective, hw: Hardware, nodes: int, m: int) -> float:
    """Seconds on the wire (alpha-beta) of one collective of a rank in a D x M group."""
    p = nodes * m
    bi, be = hw.intra_gbps * 1e9, hw.inter_gbps * 1e9
    ai, ae = hw.intra_latency_us * 1e-6, hw.inter_latency_us * 1e-6
    b = c.row_bytes
    if c.algo == "ring":
        if p == 1:
            return 0.0
        t_intra = (p - 1) * b / bi if m > 1 else 0.0
        t_inter = (p - 1) * b / (m * be) if nodes > 1 else 0.0
        return max(t_intra, t_inter) + (p - 1) * (ae if nodes > 1 else ai)
    if c.algo == "a2a":
        return max(c.intra_peers * b / bi, c.inter_peers * b / be) + c.intra_peers * ai + c.inter_peers * ae
    if c.algo == "a2a_intra":
        return c.intra_peers * b / bi + c.intra_peers * ai
    if c.algo == "a2a_inter":
        return c.inter_peers * b / be + c.inter_peers * ae
    if c.algo == "allreduce":
        return 2 * math.ceil(math.log2(max(p, 2))) * (ae if nodes > 1 else ai)
    raise ValueError(f"unknown collective algorithm {c.algo!r}")


def comm_time(collectives: Sequence[Collective], hw: Hardware, nodes: int, ranks_per_node: int,
              kernels: Mapping[str, float] | None = None) -> dict[str, float]:
    """Seconds of communication per kind (``weights``, ``grads``, ``control``) and of the
    quantization kernels included in them (``kernels``). Non-pipelined collectives run their
    quantize, transfer and dequantize one after the other; the slices of a pipelined two-level
    reduce-scatter flow through 5 stages: ``sum / S + (S - 1) / S * max`` of the stage totals."""
    res = {"weights": 0.0, "grads": 0.0, "control": 0.0, "kernels": 0.0}
    pipes: dict[int, list[Collective]] = {}
    for c in collectives:
        if c.pipeline is not None:
            pipes.setdefault(c.pipeline, []).append(c)
            continue
        tq, tdq = _kernel_times(c, hw, kernels)
        res[c.kind] += tq + _wire_time(c, hw, nodes, ranks_per_node) + tdq
        res["kernels"] += tq + tdq
    for parts in pipes.values():
        stages = [0.0] * 5
        n_slices = sum(1 for c in parts if c.hop == 1)
        for c in parts:
            tq, tdq = _kernel_times(c, hw, kernels)
            wire = _wire_time(c, hw, nodes, ranks_per_node)
            if c.hop == 1:
                stages[0] += tq
                stages[1] += wire
                stages[2] += tdq
            else:
                stages[2] += tq
                stages[3] += wire
                stages[4] += tdq
            res["kernels"] += tq + tdq
        s = max(1, n_slices)
        res[parts[0].kind] += sum(stages) / s + (s - 1) / s * max(stages)
    return res


# --------------------------------------------------------------------------------------------
# The GPT setups of the SDP4Bit paper.
# --------------------------------------------------------------------------------------------

# Shapes from the authors' Megatron-LM speed scripts (GPT-3 family shapes).
PAPER_MODELS: dict[str, dict[str, int]] = {
    "1.3B": dict(n_layer=24, n_embd=2048, n_head=16),
    "2.7B": dict(n_layer=32, n_embd=2560, n_head=32),
    "6.7B": dict(n_layer=32, n_embd=4096, n_head=32),
    "13B": dict(n_layer=40, n_embd=5120, n_head=40),
    "18B": dict(n_layer=40, n_embd=6144, n_head=48),
}
# (tensor parallel, pipeline parallel) per model and GPU type: the authors' README.
PAPER_PARALLEL: dict[str, dict[str, tuple[int, int]]] = {
    "1.3B": {"a100": (1, 1), "h800": (1, 1)},
    "2.7B": {"a100": (1, 1), "h800": (1, 1)},
    "6.7B": {"a100": (4, 1), "h800": (4, 1)},
    "13B": {"a100": (4, 2), "h800": (8, 1)},
    "18B": {"a100": (4, 2), "h800": (8, 1)},
}
# Table 2: end-to-end throughput speedup of SDP4Bit over the unquantized baseline, 128 GPUs.
PAPER_SPEEDUP: dict[tuple[str, str], float] = {
    ("1.3B", "a100"): 2.39, ("2.7B", "a100"): 2.43, ("6.7B", "a100"): 3.44,
    ("13B", "a100"): 2.68, ("18B", "a100"): 2.92,
    ("1.3B", "h800"): 1.53, ("2.7B", "h800"): 1.63, ("6.7B", "h800"): 2.97,
    ("13B", "h800"): 3.85, ("18B", "h800"): 4.08,
}
# Table 4: gradient communication of GPT-1.3B on 32 A100, baseline and TLq-HS (fused kernels).
PAPER_TABLE4_MS = {"gpus": 32, "model": "1.3B", "gpu": "a100", "fsdp": 379.3, "tlq-hs": 45.8}

GPT2_VOCAB = 50257
SEQ_LEN = 2048
MICRO_BATCH = 1
MICRO_BATCHES = 1


@dataclass(frozen=True)
class Setup:
    """A training job: model shape, parallelism, tokens per step, and how its data-parallel
    groups sit in the nodes."""

    model: str
    gpu: str
    gpus: int
    tp: int
    pp: int
    seq_len: int = SEQ_LEN
    micro_batch: int = MICRO_BATCH
    micro_batches: int = MICRO_BATCHES
    layout: str = "flat"
    zero3: bool = False

    def gpt(self) -> GPTConfig:
        unit = 128 * self.tp  # Megatron pads the vocabulary to a multiple of 128 * TP
        vocab = -(-GPT2_VOCAB // unit) * unit
        return GPTConfig(vocab_size=vocab, block_size=self.seq_len, **PAPER_MODELS[self.model])

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def dp_topology(self, gpus_per_node: int) -> tuple[int, int]:
        """(nodes, ranks per node) of one data-parallel group: Megatron orders ranks TP first,
        then DP, then PP, so a node holds ``G / TP`` consecutive ranks of a DP group."""
        m = max(1, min(self.dp, gpus_per_node // self.tp))
        return self.dp // m, m


def model_params(cfg: GPTConfig) -> int:
    """Parameters of the Megatron GPT (token embedding tied with the output layer)."""
    return n_params(cfg) - cfg.vocab_size * cfg.n_embd


def shard_sizes(setup: Setup) -> list[int]:
    """Per-rank shard sizes of the data-parallel buffers of one model-parallel rank: ``flat`` is
    Megatron's distributed optimizer (one buffer padded to the DP size); ``layer`` is FSDP2 with
    one group per transformer block and one for the rest. Model-parallel ranks are taken to
    hold ``1 / (TP * PP)`` of the parameters each."""
    cfg = setup.gpt()
    mp, dp = setup.tp * setup.pp, setup.dp
    total = model_params(cfg)
    if setup.layout == "flat":
        return [-(-(-(-total // mp)) // dp)]
    if setup.layout != "layer":
        raise ValueError(f"layout={setup.layout!r}; allowed: flat, layer")
    C = cfg.n_embd
    block = 12 * C * C + 13 * C  # n_params' per-block count with biases
    rest = total - cfg.n_layer * block
    blocks = -(-cfg.n_layer // setup.pp)
    per_block = -(-(-(-block // setup.tp)) // dp)
    return [-(-(-(-rest // mp)) // dp)] + [per_block] * blocks


def compute_time(setup: Setup, hw: Hardware) -> float:
    """Seconds of forward+backward per step on one GPU: model FLOPs of its share of the tokens
    over ``tflops * mfu``, times the pipeline bubble ``(m + PP - 1) / m``."""
    cfg = setup.gpt()
    tokens = setup.seq_len * setup.micro_batch * setup.micro_batches  # per DP rank
    flops = flops_per_token(cfg, setup.seq_len) * tokens / (setup.tp * setup.pp)
    bubble = (setup.micro_batches + setup.pp - 1) / setup.micro_batches
    return flops / (hw.tflops * 1e12 * hw.mfu) * bubble


def simulate_step(setup: Setup, preset: str | QuantConfig, hw: Hardware, *, overlap: float = 0.0,
                  kernels: Mapping[str, float] | None = None, param_bytes: int = 2,
                  grad_bytes: int = 4) -> dict[str, Any]:
    """Predicted step time and its parts (seconds) for one preset."""
    nodes, m = setup.dp_topology(hw.gpus_per_node)
    colls = step_collectives(preset, shard_sizes(setup), nodes, m, zero3=setup.zero3,
                             param_bytes=param_bytes, grad_bytes=grad_bytes)
    ct = comm_time(colls, hw, nodes, m, kernels)
    comp = compute_time(setup, hw)
    comm = ct["weights"] + ct["grads"] + ct["control"]
    exposed = max(0.0, comm - overlap * comp)
    sb = step_bytes(preset, shard_sizes(setup), nodes, m, zero3=setup.zero3,
                    param_bytes=param_bytes, grad_bytes=grad_bytes)
    return {
        "step_s": comp + exposed, "compute_s": comp, "comm_s": comm, "exposed_comm_s": exposed,
        "weights_s": ct["weights"], "grads_s": ct["grads"], "kernels_s": ct["kernels"],
        "bytes": sb, "dp_nodes": nodes, "dp_ranks_per_node": m,
    }


def _case(setup: Setup, hw: Hardware, presets: Sequence[str], overlap: float, kernels) -> dict[str, Any]:
    steps = {p: simulate_step(setup, p, hw, overlap=overlap, kernels=kernels) for p in presets}
    base = steps["fsdp"]["step_s"]
    nodes, m = steps["fsdp"]["dp_nodes"], steps["fsdp"]["dp_ranks_per_node"]
    return {
        "model": setup.model, "gpus": setup.gpus, "gpu": setup.gpu,
        "nodes": -(-setup.gpus // hw.gpus_per_node), "tp": setup.tp, "pp": setup.pp, "dp": setup.dp,
        "dp_nodes": nodes, "dp_ranks_per_node": m,
        "params": model_params(setup.gpt()),
        "step_ms": {p: 1e3 * r["step_s"] for p, r in steps.items()},
        "breakdown_ms": {p: {k: 1e3 * r[k] for k in ("compute_s", "weights_s", "grads_s", "kernels_s", "exposed_comm_s")}
                         for p, r in steps.items()},
        "bytes_per_step": {p: r["bytes"] for p, r in steps.items()},
        "speedup": {p: base / r["step_s"] for p, r in steps.items()},
        "predicted_speedup": base / steps["sdp4bit"]["step_s"],
        **_hsdp_rows(setup, hw, overlap, kernels, base),
    }


def _table4(hw: Hardware, kernels) -> dict[str, Any]:
    setup = Setup("1.3B", "a100", PAPER_TABLE4_MS["gpus"], 1, 1)
    nodes, m = setup.dp_topology(hw.gpus_per_node)
    out: dict[str, Any] = {"model": "1.3B", "gpus": setup.gpus, "gpu": hw.name, "dp_nodes": nodes,
                           "dp_ranks_per_node": m}
    for name, preset in (("fsdp", "fsdp"), ("tlq-hs", "tlq-hs")):
        colls = [c for c in step_collectives(preset, shard_sizes(setup), nodes, m, zero3=False)
                 if c.kind == "grads"]
        pred = 1e3 * comm_time(colls, hw, nodes, m, kernels)["grads"]
        paper = PAPER_TABLE4_MS[name]
        out[name] = {"predicted_ms": pred, "paper_ms": paper, "rel_error": (pred - paper) / paper}
    return out


def run(gpus_types: Sequence[str] = ("a100", "h800"), *, overrides: Mapping[str, Any] | None = None,
        overlap: float = 0.0, kernels: Mapping[str, float] | None = None,
        presets: Sequence[str] = DEFAULT_PRESETS, layout: str = "flat", zero3: bool = False,
        scale_model: str = "6.7B", scale_gpus: Sequence[int] = (16, 32, 64, 128, 256, 512, 1024),
        models: Sequence[str] = tuple(PAPER_MODELS)) -> dict[str, Any]:
    """The whole simulation as a JSON-ready dict: ``cases`` (the paper's Table 2 setups),
    ``scale`` (``scale_model`` from 16 to 1024 GPUs, weak scaling: one sequence per DP rank)."""
    presets = list(dict.fromkeys(["fsdp", *presets, "sdp4bit"]))
    for p in presets:
        resolve_config(p)
    hws = {g: dataclasses.replace(HARDWARE[g], **(overrides or {})) for g in gpus_types}
    cases, scale = [], []
    for gpu, hw in hws.items():
        for model in models:
            tp, pp = PAPER_PARALLEL[model][gpu]
            case = _case(Setup(model, gpu, 128, tp, pp, layout=layout, zero3=zero3), hw, presets, overlap, kernels)
            paper = PAPER_SPEEDUP.get((model, gpu))
            case["paper_speedup"] = paper
            case["rel_error"] = None if paper is None else (case["predicted_speedup"] - paper) / paper
            cases.append(case)
        tp, pp = PAPER_PARALLEL[scale_model][gpu]
        for n in scale_gpus:
            if n % (tp * pp) or n < tp * pp:
                continue
            c = _case(Setup(scale_model, gpu, n, tp, pp, layout=layout, zero3=zero3), hw, presets, overlap, kernels)
            scale.append({k: c[k] for k in ("model", "gpus", "gpu", "nodes", "tp", "pp", "dp", "dp_nodes",
                                             "dp_ranks_per_node", "step_ms", "speedup", "predicted_speedup", "hsdp_step_ms")})
    errs = [abs(c["rel_error"]) for c in cases if c["rel_error"] is not None]
    return {
        "cases": cases,
        "scale": scale,
        "table4": _table4(hws["a100"], kernels) if "a100" in hws else None,
        "mean_abs_rel_error": sum(errs) / len(errs) if errs else None,
        "hardware": {g: {**{k: v for k, v in dataclasses.asdict(hw).items() if k != "notes"},
                         "quant_gbps": (kernels or {}).get("quantize", hw.quant_gbps)}
                     for g, hw in hws.items()},
        "assumptions": assumptions(hws, overlap, kernels, layout, zero3),
    }


def assumptions(hws: Mapping[str, Hardware], overlap: float, kernels, layout: str, zero3: bool) -> list[str]:
    out = []
    for g, hw in hws.items():
        out += [f"{g}: {n}" for n in hw.notes]
        if kernels:
            q = "from --kernels: " + ", ".join(
                f"{k} {_kernel_gbps(hw, kernels, k):.0f} GB/s" for k in KERNEL_NAMES)
        else:
            q = f"{hw.quant_hbm_fraction:g} x HBM = {hw.quant_gbps:.0f} GB/s (no kernel benchmark given)"
        out.append(f"{g}: quantize/dequantize bandwidth {q}, in GB/s of the fp32/bf16 tensor")
        out.append(f"{g}: latency {hw.intra_latency_us:g} us per NVLink step, {hw.inter_latency_us:g} us per inter-node step")
    out += [
        f"communication hides behind at most {overlap:g} of the compute time (the paper's Megatron "
        "speed runs use no --overlap-grad-reduce/--overlap-param-gather: 0)",
        f"GPT shapes of the paper's scripts, sequence {SEQ_LEN}, micro-batch {MICRO_BATCH}, "
        f"{MICRO_BATCHES} micro-batch per step, vocabulary {GPT2_VOCAB} padded to 128*TP, tied embeddings",
        ("one flat data-parallel buffer (Megatron distributed optimizer)" if layout == "flat"
         else "one FSDP group per transformer block plus one for the rest")
        + (", weights gathered twice per step (ZeRO-3)" if zero3 else ", weights gathered once per step"),
        "baseline (fsdp): bf16 weights in a ring all-gather, fp32 gradients in a ring reduce-scatter",
        "all-gathers/reduce-scatters are rings; quantized reduce-scatters are direct all-to-alls; "
        "every GPU of a node communicates at once, each with 1/G of the node's NIC bandwidth",
    ]
    return out


# --------------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------------


def format_table(result: dict[str, Any]) -> str:
    presets = list(result["cases"][0]["step_ms"]) if result["cases"] else []
    others = [p for p in presets if p not in ("fsdp", "sdp4bit")]
    head = ("model", "gpu", "GPUs", "TP", "PP", "DP (DxM)", "fsdp ms", "sdp4bit ms",
            *[f"{p} x" for p in others], "predicted", "paper", "rel.err")
    rows = [head]
    for c in result["cases"]:
        rows.append((
            c["model"], c["gpu"], str(c["gpus"]), str(c["tp"]), str(c["pp"]),
            f"{c['dp']} ({c['dp_nodes']}x{c['dp_ranks_per_node']})",
            f"{c['step_ms']['fsdp']:.1f}", f"{c['step_ms']['sdp4bit']:.1f}",
            *[f"{c['speedup'][p]:.2f}" for p in others],
            f"{c['predicted_speedup']:.2f}x",
            "-" if c["paper_speedup"] is None else f"{c['paper_speedup']:.2f}x",
            "-" if c["rel_error"] is None else f"{100 * c['rel_error']:+.0f}%",
        ))
    lines = ["SDP4Bit Table 2 setups: predicted speedup of sdp4bit over fsdp (analytic model)", *aligned(rows)]
    if result.get("mean_abs_rel_error") is not None:
        lines.append(f"mean |relative error| {100 * result['mean_abs_rel_error']:.0f}%")
    if result["cases"]:
        lines.append("")
        lines.append("step breakdown, ms (compute / weights / grads, kernels included in comm):")
        for c in result["cases"]:
            parts = "  ".join(
                f"{p}: {b['compute_s']:.0f}/{b['weights_s']:.0f}/{b['grads_s']:.0f}"
                for p, b in c["breakdown_ms"].items() if p in ("fsdp", "sdp4bit"))
            lines.append(f"  {c['model']:>5} {c['gpu']}: {parts}")
    if result["scale"]:
        lines.append("")
        lines.append("scale (weak scaling, one sequence per data-parallel rank): predicted sdp4bit speedup")
        rows = [("model", "gpu", "GPUs", "nodes", "DP (DxM)", "fsdp ms", "sdp4bit ms", "speedup")]
        for s in result["scale"]:
            rows.append((s["model"], s["gpu"], str(s["gpus"]), str(s["nodes"]),
                         f"{s['dp']} ({s['dp_nodes']}x{s['dp_ranks_per_node']})",
                         f"{s['step_ms']['fsdp']:.1f}", f"{s['step_ms']['sdp4bit']:.1f}",
                         f"{s['predicted_speedup']:.2f}x"))
        lines += aligned(rows)
    lines += _format_hsdp(result)
    t4 = result.get("table4")
    if t4:
        lines.append("")
        lines.append(f"Table 4 check, gradient communication of GPT-1.3B on {t4['gpus']} A100: "
                     f"fsdp {t4['fsdp']['predicted_ms']:.1f} ms (paper {t4['fsdp']['paper_ms']}, the A100 "
                     f"network was derived from it), TLq-HS {t4['tlq-hs']['predicted_ms']:.1f} ms "
                     f"(paper {t4['tlq-hs']['paper_ms']}, {100 * t4['tlq-hs']['rel_error']:+.0f}%)")
    lines.append("")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in result["assumptions"]]
    return "\n".join(lines)


def _format_hsdp(result: dict[str, Any]) -> list[str]:
    rows = [("model", "gpu", "GPUs", "DP (DxM)", "fsdp ms", *[f"HSDP {p} ms" for p in HSDP_PRESETS],
             *[f"{p} x native" for p in HSDP_PRESETS[1:]])]
    for c in [*result["cases"], *result["scale"]]:
        if "hsdp_step_ms" not in c:
            continue
        h = c["hsdp_step_ms"]
        rows.append((c["model"], c["gpu"], str(c["gpus"]), f"{c['dp']} ({c['dp_nodes']}x{c['dp_ranks_per_node']})",
                     f"{c['step_ms']['fsdp']:.1f}", *[f"{h[p]:.1f}" for p in HSDP_PRESETS],
                     *[f"{h['fsdp'] / h[p]:.2f}" for p in HSDP_PRESETS[1:]]))
    if len(rows) == 1:
        return []
    return ["", "HSDP (shard inside the node, replicate across nodes; HSDP fsdp = FSDP2's native "
            "HSDP, fp32 all-reduce): predicted step", *aligned(rows)]


_HW_FLAGS = {
    "gpus_per_node": int, "tflops": float, "mfu": float, "hbm_gbps": float, "intra_gbps": float,
    "inter_gbps": float, "intra_latency_us": float, "inter_latency_us": float, "quant_hbm_fraction": float,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qsdp bench simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", choices=[*HARDWARE, "all"], default="all", help="hardware preset(s)")
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    parser.add_argument("--models", nargs="+", choices=list(PAPER_MODELS), default=list(PAPER_MODELS))
    parser.add_argument("--kernels", metavar="FILE", help='kernel benchmark JSON {"kernels": {"quantize": {"gbps": ..}, ...}}')
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="fraction of the compute time that can hide communication (default 0, as in the paper's runs)")
    parser.add_argument("--layout", choices=("flat", "layer"), default="flat")
    parser.add_argument("--zero3", action="store_true", help="gather weights before forward and backward")
    parser.add_argument("--scale-model", choices=list(PAPER_MODELS), default="6.7B")
    parser.add_argument("--scale-gpus", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    for name, typ in _HW_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=typ, default=None,
                            help=f"override the hardware presets' {name}")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", help="also write the JSON result to FILE")
    args = parser.parse_args(argv)
    if not 0.0 <= args.overlap <= 1.0:
        parser.error(f"--overlap={args.overlap} must be in [0, 1]")
    overrides = {k: getattr(args, k) for k in _HW_FLAGS if getattr(args, k) is not None}
    for k, v in overrides.items():
        if v <= 0:
            parser.error(f"--{k.replace('_', '-')}={v} must be positive")
    kernels = None
    if args.kernels:
        try:
            kernels = load_kernels(args.kernels)
        except (OSError, ValueError) as e:
            parser.error(f"--kernels: {e}")
    gpus = list(HARDWARE) if args.gpu == "all" else [args.gpu]
    try:
        result = run(gpus, overrides=overrides, overlap=args.overlap, kernels=kernels, presets=args.presets,
                     layout=args.layout, zero3=args.zero3, scale_model=args.scale_model,
                     scale_gpus=args.scale_gpus, models=args.models)
    except ValueError as e:
        parser.error(str(e))
    result["meta"] = meta("simulate", argv, "analytic model")
    png = png_next_to(args.save)
    if png:
        plot(result, png)
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)


def plot(result: dict[str, Any], path: str) -> str:
    """Predicted against reported ``sdp4bit`` speedup for every paper case."""
    cases = result["cases"]
    return bar_chart(path, [f"{c['model']} {c['gpu']}" for c in cases],
                     {"predicted": [c["predicted_speedup"] for c in cases],
                      "paper (Table 2)": [c["paper_speedup"] for c in cases]},
                     ylabel="sdp4bit speedup over fsdp", title="SDP4Bit setups, 128 GPUs: alpha-beta model vs paper")


if __name__ == "__main__":
    raise SystemExit(main())
