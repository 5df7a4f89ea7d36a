"""The collectives of one training step, as the comm objects run them, and their bytes.

:func:`step_collectives` lists every collective one rank runs in a step, with the exact per-peer
wire size of each, computed with ``RowCodec.row_nbytes`` and the same codecs, slices and padding
as :mod:`qsdp.comm.all_gather` and :mod:`qsdp.comm.reduce_scatter`. :func:`step_bytes` sums them
the way the byte meter does (a buffer of ``B`` bytes to ``k`` peers counts ``k * B``, split
intra/inter node); tests check it against the meter of real runs. :func:`replica_elements` is
the memory the weight-difference replicas hold.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..comm.difference import replica_layout
from ..comm.hsdp import chunk_len, hsdp_codec
from ..comm.reduce_scatter import (exchange_groups, exchange_min_bytes, grad_codec, pipeline_slices_bounds,
                                    real_elements, slice_bytes)
from ..comm.weight_codec import weight_codec
from ..config import QuantConfig, resolve_config
from .host_census import call_host_us
from .launches import CENSUS, LaunchCounts

_DTYPES = {4: torch.float32, 2: torch.bfloat16}

# The steps of the comm objects (qsdp.comm) one rank runs in a step, each a Python call with its
# own host work around its collective (codec calls, padding, temporaries, the gloo call itself):
# a plain all-gather, a quantized one, a weight difference's exchange among its holders, a node
# replica's fill, the agreement of the difference gathers, a plain reduce-scatter, a one-level
# quantized one, one exchange of a two-level one (both hops; a pipeline slice, or every slice at
# once where its exchanges are not pipelined).
CALLS = ("gather", "quantized_gather", "difference_update", "replica_fill", "agreement",
         "reduce_scatter", "one_level_reduce_scatter", "two_level_slice")


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
    ``pipeline``/``hop``: the exchanges of one two-level reduce-scatter share a pipeline id.
    ``call``: the step of a comm object this collective starts (one of :data:`CALLS`), whose fixed
    host cost a measured ``Hardware.call_us`` prices; ``None`` for one that continues the step
    before it (the second hop of a two-level exchange) or has no such step (HSDP's all-reduce).
    ``launches``: the kernels its comm step launches on a GPU beyond FSDP2's own collective
    (:mod:`qsdp.perfmodel.launches`). ``host_us``: the census's host floor of its comm step's
    call (:mod:`qsdp.perfmodel.host_census`; on the first exchange of a two-level reduce-scatter
    and the first phase of the HSDP all-reduce), which ``Hardware.host_factor`` scales.
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
    call: str | None = None
    launches: int = 0
    host_us: float = 0.0


def _gathers_per_group(gathers: int | Sequence[int] | None, n_groups: int, zero3: bool) -> list[int]:
    if gathers is None:
        return [2 if zero3 else 1] * n_groups
    if isinstance(gathers, int):
        return [gathers] * n_groups
    if len(gathers) != n_groups:
        raise ValueError(f"gathers has {len(gathers)} entries for {n_groups} FSDP groups")
    return list(gathers)


def _difference_gathers(layout: str, quant: Collective, plain: Collective, calls: int,
                        d: int, m: int) -> list[Collective]:
    """A group's weight-difference gathers in one step: one carries the change, the others only
    fill the output from the replica (see :mod:`qsdp.comm.difference`)."""
    if layout == "full":
        return [dataclasses.replace(quant, call="difference_update")] if calls else []
    if layout == "exact":
        return [plain] * calls
    # node replicas: the change among the D holders of my rows, then every gather fills the
    # output with the node's rows, exactly
    n, pb = quant.elements, plain.hp_bytes
    between = dataclasses.replace(quant, algo="a2a_inter", intra_peers=0, inter_peers=d - 1, dequantize=d * n,
                                  call="difference_update")
    inside = dataclasses.replace(plain, algo="a2a_intra", row_bytes=d * n * pb, elements=d * n,
                                 intra_peers=m - 1, inter_peers=0, call="replica_fill")
    return ([between] if calls else []) + [inside] * calls


def _grad_collectives(cfg: QuantConfig, shard_sizes: Sequence[int], d: int, m: int, grad_bytes: int,
                      host_staged: bool = False, counts: LaunchCounts = CENSUS) -> list[Collective]:
    """The gradient reduce-scatters (qsdp.comm.reduce_scatter) of one step, one per group, on
    ``d`` nodes x ``m`` ranks; ``host_staged``: gloo's (see :func:`step_collectives`)."""
    world = m * d
    intra, inter = m - 1, world - m  # Topology.peers()
    g = cfg.grads
    out: list[Collective] = []
    raw = _DTYPES[grad_bytes]
    for gi, s in enumerate(shard_sizes):
        if g.mode == "plain" or not cfg.quantizes_shard(s):
            out.append(Collective("grads", "ring", s * grad_bytes, s, intra, inter, hp_bytes=grad_bytes,
                                  call="reduce_scatter"))
            continue
        if g.mode == "one_level" or d == 1 or m == 1:
            bits = g.bits if g.mode == "one_level" else (g.bits_intra if d == 1 else g.bits_inter)
            codec = grad_codec(g, bits, raw)
            inter_only = g.mode != "one_level" and d > 1
            out.append(Collective(
                "grads", "a2a", codec.row_nbytes(s), s, 0 if inter_only else intra, inter,
                quantize=world * codec.padded_len(s), dequantize=world * codec.padded_len(s),
                hp_bytes=grad_bytes, hadamard=bool(codec.hadamard_block and not codec.exact),
                call="one_level_reduce_scatter",
            ))
            continue
        hop1 = grad_codec(g, g.bits_intra, raw)
        hop2 = grad_codec(g, g.bits_inter, torch.float32)
        lp = hop1.padded_len(s)
        bounds = pipeline_slices_bounds(lp, hop1, g.rounding_slices, g.pipeline_min_slice)
        exchanges = exchange_groups(slice_bytes(hop1, hop2, bounds, world, d), exchange_min_bytes(g, host_staged))
        for j, group in enumerate(exchanges):
            slices = [bounds[k] for k in group]  # one exchange per hop carries them side by side
            width = sum(b - a for a, b in slices)
            real = sum(real_elements(a, b, s) for a, b in slices)
            out.append(Collective(
                "grads", "a2a_intra", d * sum(hop1.row_nbytes(b - a) for a, b in slices), d * real, m - 1, 0,
                quantize=world * width, dequantize=world * width, hp_bytes=grad_bytes,
                hadamard=bool(hop1.hadamard_block and not hop1.exact), pipeline=gi, hop=1,
                call="two_level_slice", launches=counts.two_level(len(group), first=j == 0),
            ))
            out.append(Collective(
                "grads", "a2a_inter", sum(hop2.row_nbytes(b - a) for a, b in slices), real, 0, d - 1,
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
    host_staged: bool = False,
    counts: LaunchCounts = CENSUS,
) -> list[Collective]:
    """Every collective one rank runs in one steady-state training step (after the warm-up step
    that establishes weight-difference replicas), for FSDP groups whose per-rank shard (the
    all-gather input = the reduce-scatter output) has ``shard_sizes[i]`` elements.

    ``zero3``: weights are gathered before forward and again before backward (FSDP2's
    ``reshard_after_forward=True``); otherwise once per step (ZeRO-2 / Megatron's distributed
    optimizer). ``gathers`` overrides the count per group. A weight-difference gather whose shard
    did not change (the second gather of a step) sends no difference (node replicas still fill
    the output inside the node); the difference gathers agree once per step. ``param_bytes``: the
    all-gather dtype's size; ``grad_bytes``: the reduce dtype's size. ``host_staged``: the
    collectives run on gloo (``Hardware.host_staged``), where ``grads.pipeline_slices="auto"``
    sends a two-level reduce-scatter's slices in one exchange per hop (elsewhere as many
    exchanges as move ``grads.pipeline_min_bytes`` each, and for a slice count one per slice per
    hop, as the comm objects do); the bytes are the same. ``counts``: each step's launches.
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
    out: list[Collective] = []
    per_group = _gathers_per_group(gathers, len(shard_sizes), zero3)

    def plain_gather(n: int) -> Collective:
        return Collective("weights", "ring", n * param_bytes, n, intra, inter, hp_bytes=param_bytes, call="gather")

    # Weight all-gathers (qsdp.comm.all_gather).
    for n, calls in zip(shard_sizes, per_group):
        if w.mode == "plain" or not cfg.quantizes_shard(n):
            out += [plain_gather(n) for _ in range(calls)]
            continue
        codec = weight_codec(w)
        quant = Collective("weights", "ring", codec.row_nbytes(n), n, intra, inter,
                           quantize=n, dequantize=world * n, hp_bytes=param_bytes, call="quantized_gather")
        if w.mode == "direct":
            out += [quant] * calls
        else:
            out += _difference_gathers(replica_layout(w.replica, d, m), quant, plain_gather(n), calls, d, m)
    if w.mode == "difference":  # one agreement per step: 2 int32 flags per group
        out.append(Collective("control", "allreduce", 8 * len(shard_sizes), 0, intra, inter, call="agreement"))

    out += _grad_collectives(cfg, shard_sizes, d, m, grad_bytes, host_staged, counts)
    return _hosted([_launching(c, counts) for c in out], cfg.name)


def _launching(c: Collective, counts: LaunchCounts) -> Collective:
    """``c`` with the launches of its comm step (a two-level exchange's are set where it is built)."""
    if c.call is None or c.call == "two_level_slice":
        return c
    return dataclasses.replace(c, launches=counts.per_call[c.call])


def _hosted(collectives: list[Collective], preset: str) -> list[Collective]:
    """``collectives`` with the census's host floor of each comm step's call: a two-level
    reduce-scatter's on its first exchange (the census's call carries one exchange per hop; the
    further exchanges of a pipelined one are not priced)."""
    out, seen = [], set()
    for c in collectives:
        if c.call == "two_level_slice":
            if c.pipeline in seen:
                out.append(c)
                continue
            seen.add(c.pipeline)
        out.append(dataclasses.replace(c, host_us=call_host_us(preset, c.call)) if c.call else c)
    return out


def _per_link(collectives: Sequence[Collective], amount: Callable[[Collective], int]) -> dict[str, dict[str, int]]:
    # The byte meter's sum: what a collective sends each peer counts once per peer.
    res = {k: {"intra": 0, "inter": 0} for k in ("weights", "grads")}
    for c in collectives:
        if c.kind in res:
            res[c.kind]["intra"] += amount(c) * c.intra_peers
            res[c.kind]["inter"] += amount(c) * c.inter_peers
    return res


def collective_bytes(collectives: Sequence[Collective]) -> dict[str, dict[str, int]]:
    """Bytes on the wire as the byte meter counts them, ``{"weights": {"intra", "inter"},
    "grads": {"intra", "inter"}}`` (control flags are not included)."""
    return _per_link(collectives, lambda c: c.row_bytes)


def collective_elements(collectives: Sequence[Collective]) -> dict[str, dict[str, int]]:
    """The elements those bytes carry, counted as the byte meter counts them (a buffer of ``n``
    elements to ``k`` peers: ``k * n``), keyed as :func:`collective_bytes`."""
    return _per_link(collectives, lambda c: c.elements)


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
    return collective_bytes(step_collectives(config, shard_sizes, nodes, ranks_per_node, zero3=zero3,
                                             gathers=gathers, param_bytes=param_bytes, grad_bytes=grad_bytes))


def replica_elements(config: str | QuantConfig, shard_sizes: Sequence[int], nodes: int, ranks_per_node: int) -> int:
    """Elements (in the parameter dtype) of the weight-difference replicas one rank holds, for
    FSDP groups of per-rank shards ``shard_sizes`` on ``nodes`` x ``ranks_per_node`` ranks: the
    rows of every group its layout keeps (``full``: all ``D * M``, ``node``: the ``D`` of its
    local rank, ``exact``: none; see :class:`qsdp.comm.difference.DifferenceAllGather`); 0 for
    presets without weight differences."""
    cfg = resolve_config(config)
    w = cfg.weights
    if w.mode != "difference":
        return 0
    layout = replica_layout(w.replica, nodes, ranks_per_node)
    rows = {"full": nodes * ranks_per_node, "node": nodes, "exact": 0}[layout]
    return sum(rows * n for n in shard_sizes if cfg.quantizes_shard(n))


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
    """Every collective one rank runs in one steady-state HSDP step (FSDP2 shards inside the
    node, the nodes hold replicas: :mod:`qsdp.comm.hsdp`): the config's gathers and
    reduce-scatters over the ``ranks_per_node`` ranks of the node (``shard_sizes``: per-rank
    shards of that group), then the all-reduce across the ``nodes`` replicas as ``config.hsdp``
    says: ``plain`` is a reduce-scatter and an all-gather of fp32 chunks (FSDP2's native HSDP,
    as a ring), ``quantized`` the two all-to-all phases of :class:`qsdp.comm.hsdp.ReplicaAllReduce`."""
    cfg = resolve_config(config)
    out = step_collectives(cfg, shard_sizes, 1, ranks_per_node, zero3=zero3,
                           param_bytes=param_bytes, grad_bytes=grad_bytes)
    d = nodes
    if d == 1:
        return out
    for s in shard_sizes:
        if cfg.hsdp.mode == "plain" or not cfg.quantizes_shard(s):
            chunk = -(-s // d)
            out += [Collective("grads", "a2a_inter", chunk * 4, chunk, 0, d - 1)] * 2
            continue
        codec = hsdp_codec(cfg.hsdp)
        length = chunk_len(s, d, codec)
        row = codec.row_nbytes(length)
        first, second = CENSUS.hsdp_all_reduce
        out.append(Collective("grads", "a2a_inter", row, length, 0, d - 1, quantize=d * length,
                              dequantize=d * length, hadamard=bool(codec.hadamard_block), launches=first,
                              host_us=call_host_us(cfg.name, "hsdp_all_reduce")))
        out.append(Collective("grads", "a2a_inter", row, length, 0, d - 1, quantize=length,
                              dequantize=d * length, launches=second))
    return out
