"""The collectives of one FSDP group, emulated in one process on every rank's data at once.

FSDP2 flat-shards a parameter group over the ``world = D * M`` ranks: its all-gather output and
its reduce-scatter input are ``[world, n]``, row ``r`` concatenating rank ``r``'s dim-0 chunk of
every parameter (:func:`flat_rows`). The functions here take the rows of *every* rank, route them
the way the collectives' all-gathers and all-to-alls would, and call the same codec steps the
collectives call (:class:`qsdp.comm.wire.RowCodec` built by ``grad_codec`` / ``weight_codec``,
``destination_major``, the slice bounds, the seeds from :func:`qsdp.codecs.rng.derive_seed`), so
for the same inputs, ``comm_id`` and call count they return the same bits as the real
collectives on a real process group (a test checks this).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..codecs.rng import derive_seed
from ..comm.difference import replica_layout
from ..comm.reduce_scatter import destination_major, grad_codec, pipeline_slices_bounds
from ..comm.topology import Topology
from ..comm.weight_codec import weight_codec
from ..comm.wire import RowCodec, sum_rows
from ..config import QuantConfig


def flat_rows(tensors: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    """FSDP2's flat layout of one parameter group: ``[world, n]``, row ``r`` the concatenation of
    rank ``r``'s dim-0 chunk of every tensor, each chunk ``ceil(dim0 / world)`` rows long and
    zero-padded (torch's ``chunk_cat``, which builds the reduce-scatter input; the sharded
    parameters have the same layout). Same dtype as the tensors."""
    parts = []
    for t in tensors:
        t = t.detach()
        d0 = t.shape[0] if t.dim() else 1
        flat = t.reshape(d0, -1)
        pad = -(-d0 // world) * world - d0
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
        parts.append(flat.reshape(world, -1))
    return torch.cat(parts, dim=1)


def reduce_scatter(grads: torch.Tensor, cfg: QuantConfig, ranks_per_node: int, comm_id: int,
                   call: int) -> torch.Tensor:
    """Every rank's output of the group's gradient reduce-scatter with ``op=AVG``.

    grads: float ``[world (source rank), world (destination), s]``: source ``r``'s
        ``input_tensor`` viewed as FSDP2 hands it, ``[world, s]``.
    ranks_per_node: ``M`` (the world is ``D = world // M`` nodes); comm_id: the group's index
        in ``quantize_comms`` order (the root's group is 0); call: the collective's call count
        (1 for its first call), which picks the rounding seeds.
    Returns float32 ``[world, s]``: row ``r`` is what rank ``r`` receives.
    """
    world, _, s = grads.shape
    g = cfg.grads
    if g.mode == "plain" or not cfg.quantizes_shard(s):
        return sum_rows(grads.float()) / world
    m, d = ranks_per_node, world // ranks_per_node

    def seed(rank: int, *parts: int) -> int:
        return derive_seed(cfg.seed, comm_id, call, rank, *parts)

    if g.mode == "one_level" or d == 1 or m == 1:
        bits = g.bits if g.mode == "one_level" else (g.bits_intra if d == 1 else g.bits_inter)
        codec = grad_codec(g, bits, grads.dtype)
        sent = torch.stack([codec.encode(grads[r], seed=seed(r, 3)) for r in range(world)])
        # all-to-all: destination j receives row j of every source, in source order
        total = torch.stack([codec.decode_sum(sent[:, j], s, finish=True) for j in range(world)])
    else:
        total = _two_hops(grads, cfg, m, d, seed)
    return total / world


def _two_hops(grads: torch.Tensor, cfg: QuantConfig, m: int, d: int, seed) -> torch.Tensor:
    """``QuantizedReduceScatter._two_hops`` for every rank at once (rank ``n * m + l`` is local
    rank ``l`` of node ``n``), one rounding slice at a time: whether the collectives send the
    slices in exchanges of their own or side by side in one (``pipeline_slices="auto"`` on
    gloo) moves the same bytes."""
    g = cfg.grads
    world, _, s = grads.shape
    hop1 = grad_codec(g, g.bits_intra, grads.dtype)
    hop2 = grad_codec(g, g.bits_inter, torch.float32)
    lp = hop1.padded_len(s)
    out = torch.empty(world, lp, dtype=torch.float32, device=grads.device)
    order = Topology.contiguous(d, m).exchange_index(grads.device)
    for k, (a, b) in enumerate(pipeline_slices_bounds(lp, hop1, g.rounding_slices, g.pipeline_min_slice)):
        # hop 1: rows (l, n) of source r, destination-major; local rank l of r's node gets rows
        # [l * d, (l + 1) * d) of every local peer, in local-rank order
        sent = [hop1.encode(destination_major(grads[r], order, a, b), seed=seed(r, 4, k)) for r in range(world)]
        partial: list[torch.Tensor] = []
        for r in range(world):
            node, local = divmod(r, m)
            recv = torch.cat([sent[node * m + j][local * d:(local + 1) * d] for j in range(m)])
            partial.append(hop1.decode_sum_encode(recv, b - a, sources=m, codec=hop2, seed=seed(r, 5, k)))
        # hop 2: among the ranks of local rank l, node n' gets row n' of every node's partial sum
        for r in range(world):
            node, local = divmod(r, m)
            recv2 = torch.cat([partial[n * m + local][node:node + 1] for n in range(d)])
            out[r, a:b] = hop2.decode_sum(recv2, b - a, finish=True)
    return out[:, :s]


def direct_gather(rows: torch.Tensor, cfg: QuantConfig, comm_id: int, version: int) -> torch.Tensor:
    """What every rank's ``QuantizedAllGather`` (or the plain gather) puts in its output:
    ``[world, n]`` in ``rows``' dtype. rows: ``[world, n]``, row ``r`` rank ``r``'s shard (in the
    parameter dtype); version: the gather's shard version (1 after the first change)."""
    world, n = rows.shape
    if cfg.weights.mode == "plain" or not cfg.quantizes_shard(n):
        return rows.clone()
    codec = weight_codec(cfg.weights)
    sent = torch.cat([codec.encode(rows[r:r + 1], seed=derive_seed(cfg.seed, comm_id, version, r, 1))
                      for r in range(world)])
    return codec.decode_into(sent, n, torch.empty_like(rows))


def difference_applies(cfg: QuantConfig, ranks_per_node: int, world: int, numel: int) -> bool:
    """Whether a group's weight-difference gather quantizes anything (on one node, node
    replicas gather exactly; small shards travel plain)."""
    layout = replica_layout(cfg.weights.replica, world // ranks_per_node, ranks_per_node)
    return cfg.weights.mode == "difference" and layout != "exact" and cfg.quantizes_shard(numel)


def difference_gather(rows: torch.Tensor, replica: torch.Tensor, cfg: QuantConfig, comm_id: int,
                      version: int) -> None:
    """One ``DifferenceAllGather`` update of every rank's changed shard: ``replica`` (``[world,
    n]``, the parameter dtype; every holder's copy of each row is the same) gets ``+=
    dequantize(quantize(rows - replica))`` row by row, in place. version: the update count (1
    for the first difference after the exact first gather)."""
    world, n = rows.shape
    codec: RowCodec = weight_codec(cfg.weights)
    sent = torch.cat([
        codec.encode_difference(rows[r:r + 1], replica[r:r + 1],
                                seed=derive_seed(cfg.seed, comm_id, version, r, 2))
        for r in range(world)])
    codec.decode_into(sent, n, replica, add=True)
