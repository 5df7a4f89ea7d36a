"""``qsdp bench host-time``: the host's time per collective of each preset, beside FSDP2's own.

On tiny shards the arithmetic of a collective is negligible and what is left is the host's
work: the Python of the comm object, its torch calls and the collectives themselves. Local
ranks (``--nodes`` x ``--ranks-per-node``, 2 x 2 by default, gloo on CPUs, started by
:func:`qsdp.launch.launch_local`) call every collective a preset runs through the comm objects'
public constructors and FSDP2's custom comm interface (``__call__``), each beside FSDP2's own
unquantized collective of the same group, size and dtype (``all_gather_into_tensor``,
``reduce_scatter_tensor`` or, across HSDP replicas, ``all_reduce``, as
:mod:`qsdp.comm.collectives` names them), in the same process, interleaved in rounds that call
each once with every rank starting together (:func:`qsdp.bench.comm_calls.interleaved_median_seconds`).
A rank's figure is its median over ``--repeats`` rounds; the result's the median over the ranks.

The collectives (those a preset's config quantizes, and ``fsdp``'s comm objects, whose
unquantized calls are FSDP2's own plus the metering around them):

* ``gather``: the plain weight all-gather (``fsdp``); ``direct_gather``: a quantized one
  (``qsdp``, ``zeropp``);
* ``difference_update``: a weight-difference gather whose shard changed (the agreement, the
  difference's exchange among the replica's holders and the fill); ``difference_fill``: one whose
  shard did not (the fill alone) (``sdp4bit``);
* ``reduce_scatter`` (``fsdp``), ``one_level_reduce_scatter`` (``qsdp``),
  ``two_level_reduce_scatter`` (``zeropp``, ``sdp4bit``), all with ``op=AVG``;
* ``hsdp_all_reduce``: the quantized all-reduce across the replicas (``hsdp4``, ``sdp4bit``):
  the ``--nodes`` ranks of one local index. Beside it, in the same rounds, its two collectives
  alone (``exchanges_us``, ``exchanges_ratio`` to FSDP2's all-reduce): the all-to-all and the
  all-gather of buffers of its encoded rows' sizes, the floor of its host time on this host.

The shards have ``--numel`` elements per rank (4096: a few quantization groups), and
``grads.pipeline_min_slice`` is lowered to one codec unit so that a two-level reduce-scatter
rounds a tiny shard in as many slices as it rounds a large group (8 for ``sdp4bit``). On gloo
the slices of ``pipeline_slices="auto"`` travel in one exchange per hop, and the codecs are
the torch reference: the host's work here is that of the CPU path, not of the GPU's fused one.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Sequence

from qsdp.text_table import aligned
from qsdp.usage import UsageParser, save_path

from .report import emit, meta

__all__ = ["PRESETS", "COLLECTIVES", "collectives_of", "measure", "format_table", "main"]

PRESETS = ("fsdp", "qsdp", "zeropp", "sdp4bit", "hsdp4")
COLLECTIVES = ("gather", "direct_gather", "difference_update", "difference_fill", "reduce_scatter",
               "one_level_reduce_scatter", "two_level_reduce_scatter", "hsdp_all_reduce")
# What each is compared with: FSDP2's unquantized collective of the same group.
BASELINE = {"gather": "all_gather", "direct_gather": "all_gather", "difference_update": "all_gather",
            "difference_fill": "all_gather", "reduce_scatter": "reduce_scatter",
            "one_level_reduce_scatter": "reduce_scatter", "two_level_reduce_scatter": "reduce_scatter",
            "hsdp_all_reduce": "all_reduce"}
NUMEL = 4096
REPEATS = 51
QUICK_REPEATS = 5


def _config(preset: str):
    from qsdp.config import resolve_config

    cfg = resolve_config(preset)
    g = cfg.grads
    if g.mode != "two_level":
        return cfg
    # A tiny shard rounded in the slices of a large group (see the module doc).
    return resolve_config(cfg, {"grads.pipeline_min_slice": math.lcm(g.group_size, g.hadamard_block or 1)})


def collectives_of(preset: str, nodes: int, ranks_per_node: int) -> tuple[str, ...]:
    """The collectives of :data:`COLLECTIVES` measured for ``preset`` on ``nodes`` x
    ``ranks_per_node`` ranks (see the module doc)."""
    cfg = _config(preset)
    w, g, h = cfg.weights.mode, cfg.grads.mode, cfg.hsdp.mode
    out = []
    if w == "direct":
        out.append("direct_gather")
    elif w == "difference":
        out += ["difference_update", "difference_fill"]
    elif preset == "fsdp":
        out.append("gather")
    if g == "one_level" or (g == "two_level" and (nodes == 1 or ranks_per_node == 1)):
        out.append("one_level_reduce_scatter")
    elif g == "two_level":
        out.append("two_level_reduce_scatter")
    elif preset == "fsdp":
        out.append("reduce_scatter")
    if h == "quantized" and nodes > 1:
        out.append("hsdp_all_reduce")
    return tuple(out)


# --------------------------------------------------------------------------- one rank


def _calls(name: str, cfg, topo, comm_id: int, n: int, dtype) -> dict[str, Callable[[], None]]:
    """``{"qsdp": the comm object's call, "fsdp2": FSDP2's own collective of the same group and
    sizes}``, and for a quantized HSDP all-reduce ``"exchanges"``: its two collectives alone."""
    import torch
    import torch.distributed as dist

    from qsdp.comm.all_gather import DifferenceAllGather, PlainAllGather, QuantizedAllGather
    from qsdp.comm.collectives import all_gather_flat, reduce_scatter_flat
    from qsdp.comm.hsdp import ReplicaAllReduce
    from qsdp.comm.reduce_scatter import PlainReduceScatter, QuantizedReduceScatter
    from qsdp.comm.versions import ChangeTracker

    world, rank, group = topo.world_size, topo.rank, topo.group
    gen = torch.Generator().manual_seed(comm_id * 1000 + rank)
    if BASELINE[name] == "all_gather":
        shard = torch.randn(n, generator=gen).to(dtype)
        out = torch.empty(world * n, dtype=dtype)
        mine = out[rank * n:(rank + 1) * n]
        base_in, base_out = shard.clone(), torch.empty(world * n, dtype=dtype)
        comm = {"gather": lambda: PlainAllGather(cfg, topo, comm_id),
                "direct_gather": lambda: QuantizedAllGather(cfg, topo, comm_id),
                # a comm on its own takes every gather as a change; a tracker told of no optimizer
                # step takes none (after the exact first gather, every call only fills)
                "difference_update": lambda: DifferenceAllGather(cfg, topo, comm_id),
                "difference_fill": lambda: DifferenceAllGather(cfg, topo, comm_id, ChangeTracker())}[name]()

        def call() -> None:
            mine.copy_(shard)  # FSDP2 copies the shard into the gathered buffer before it calls
            comm(out, mine, group)

        return {"qsdp": call, "fsdp2": lambda: all_gather_flat(base_out, base_in, group)}
    if BASELINE[name] == "reduce_scatter":
        grad = torch.randn(world * n, generator=gen)
        out, base_out = torch.empty(n), torch.empty(n)
        rs = (PlainReduceScatter if name == "reduce_scatter" else QuantizedReduceScatter)(cfg, topo, comm_id)
        return {"qsdp": lambda: rs(out, grad, group, dist.ReduceOp.AVG),
                "fsdp2": lambda: reduce_scatter_flat(base_out, grad, dist.ReduceOp.SUM, group)}
    x = torch.randn(n, generator=gen)
    ar = ReplicaAllReduce(cfg, topo.inter_group, comm_id)
    total = torch.empty(n)

    def plain_all_reduce() -> None:
        total.copy_(x)
        dist.all_reduce(total, group=topo.inter_group)

    calls = {"qsdp": lambda: ar(x), "fsdp2": plain_all_reduce}
    if cfg.quantizes_shard(n):
        calls["exchanges"] = _replica_exchanges(cfg, topo.inter_group, n)
    return calls


def _replica_exchanges(cfg, group, n: int) -> Callable[[], None]:
    """The two collectives of the quantized HSDP all-reduce of ``n`` elements alone, on buffers
    of its encoded rows' sizes: the all-to-all of every replica's chunks, the all-gather of the
    requantized sums. The all-reduce cannot cost less than these on this host."""
    import torch
    import torch.distributed as dist

    from qsdp.comm.collectives import all_gather_flat
    from qsdp.comm.hsdp import chunk_len, hsdp_codec

    codec, replicas = hsdp_codec(cfg.hsdp), group.size()
    row = codec.row_nbytes(chunk_len(n, replicas, codec))
    send, mine = torch.zeros(replicas, row, dtype=torch.uint8), torch.zeros(row, dtype=torch.uint8)
    recv, gathered = torch.empty_like(send), torch.empty(replicas * row, dtype=torch.uint8)

    def exchanges() -> None:
        dist.all_to_all_single(recv, send, group=group)
        all_gather_flat(gathered, mine, group)

    return exchanges


def _rank(job: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """One rank of :func:`measure` (under :func:`qsdp.launch.launch_local`): this rank's medians
    in seconds, ``{preset: {collective: {"qsdp": s, "fsdp2": s}}}``."""
    import torch
    import torch.distributed as dist

    from qsdp.comm.topology import build_topology
    from .comm_calls import interleaved_median_seconds

    torch.set_num_threads(1)  # every rank one core's worth, as the other benchmarks' ranks run
    dist.init_process_group("gloo")
    try:
        topo = build_topology(ranks_per_node=job["ranks_per_node"])
        dtype = getattr(torch, job["param_dtype"])
        fns: dict[tuple[str, str, str], Callable[[], None]] = {}
        comm_id = 0
        for preset in job["presets"]:
            cfg = _config(preset)
            for name in collectives_of(preset, topo.nodes, topo.ranks_per_node):
                comm_id += 1
                for who, fn in _calls(name, cfg, topo, comm_id, job["numel"], dtype).items():
                    fns[preset, name, who] = fn
        seconds = interleaved_median_seconds(fns, torch.device("cpu"), job["repeats"], barrier=True)
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (preset, name, who), s in seconds.items():
            out.setdefault(preset, {}).setdefault(name, {})[who] = s
        return out
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the result


def measure(presets: Sequence[str] = PRESETS, *, nodes: int = 2, ranks_per_node: int = 2, numel: int = NUMEL,
            repeats: int = REPEATS, param_dtype: str = "float32") -> dict[str, Any]:
    """Every preset's collectives on ``nodes`` x ``ranks_per_node`` local gloo ranks: per preset
    and collective the host's microseconds per call (``qsdp_us``), FSDP2's own collective's
    (``fsdp2_us``) and their ratio (``ratio``), medians over the ranks of each rank's median."""
    from qsdp.config import resolve_config
    from qsdp.launch import launch_local

    for p in presets:
        resolve_config(p)  # a bad name fails before any process starts
    if nodes < 2 or ranks_per_node < 2:
        raise ValueError(f"nodes={nodes}, ranks_per_node={ranks_per_node}: both must be at least 2 "
                         "(a two-level reduce-scatter and an HSDP all-reduce need both levels)")
    if numel < 1 or repeats < 1:
        raise ValueError(f"numel={numel} and repeats={repeats} must be positive")
    job = {"presets": list(presets), "ranks_per_node": ranks_per_node, "numel": numel, "repeats": repeats,
           "param_dtype": param_dtype}
    per_rank = list(launch_local(_rank, nodes * ranks_per_node, job).values())
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for preset in presets:
        rows[preset] = {}
        for name in per_rank[0].get(preset, {}):
            ours = statistics.median(r[preset][name]["qsdp"] for r in per_rank) * 1e6
            theirs = statistics.median(r[preset][name]["fsdp2"] for r in per_rank) * 1e6
            row = rows[preset][name] = {"qsdp_us": ours, "fsdp2_us": theirs, "baseline": BASELINE[name],
                                        "ratio": ours / theirs}
            if "exchanges" in per_rank[0][preset][name]:
                row["exchanges_us"] = statistics.median(r[preset][name]["exchanges"] for r in per_rank) * 1e6
                row["exchanges_ratio"] = row["exchanges_us"] / theirs
    ratios = [c["ratio"] for p in rows.values() for c in p.values()]
    return {"nodes": nodes, "ranks_per_node": ranks_per_node, "numel": numel, "repeats": repeats,
            "param_dtype": param_dtype, "backend": "gloo", "threads_per_rank": 1, "goal_ratio": 2.0,
            "worst_ratio": max(ratios) if ratios else None, "presets": rows}


def format_table(result: dict[str, Any]) -> str:
    lines: list[Sequence[str]] = [("preset", "collective", "qsdp us", "FSDP2 us", "FSDP2's", "ratio",
                                   "its collectives alone")]
    for preset, colls in result["presets"].items():
        for name, c in colls.items():
            alone = f"{c['exchanges_us']:.0f} us, {c['exchanges_ratio']:.2f}x" if "exchanges_us" in c else "-"
            lines.append((preset, name, f"{c['qsdp_us']:.0f}", f"{c['fsdp2_us']:.0f}", c["baseline"],
                          f"{c['ratio']:.2f}x", alone))
    head = (f"host time per call, {result['nodes']} x {result['ranks_per_node']} gloo ranks on CPUs, "
            f"{result['numel']} {result['param_dtype']} elements per rank; medians of {result['repeats']} "
            f"interleaved rounds (median over ranks)")
    worst = result["worst_ratio"]
    tail = "" if worst is None else f"worst ratio {worst:.2f}x (goal: at most {result['goal_ratio']:g}x FSDP2's)"
    return "\n".join([head, *aligned(lines, rule=True), tail])


def _parser():
    from .report import description

    p = UsageParser(prog="qsdp bench host-time", description=description(__doc__))
    p.add_argument("--presets", nargs="+", default=list(PRESETS), help="presets or variants (default: %(default)s)")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="local ranks per emulated node (default 2)")
    p.add_argument("--numel", type=int, default=NUMEL, help=f"elements of each rank's shard (default {NUMEL})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"rounds of calls, one of each collective per round (default {REPEATS}; --quick {QUICK_REPEATS})")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the weight gathers' dtype (gradients reduce in float32, as FSDP2's)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_REPEATS} rounds: a check that it runs, not a figure")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    from qsdp.config import ConfigError

    repeats = a.repeats if a.repeats is not None else (QUICK_REPEATS if a.quick else REPEATS)
    try:
        result = measure(a.presets, nodes=a.nodes, ranks_per_node=a.ranks_per_node, numel=a.numel,
                         repeats=repeats, param_dtype=a.param_dtype)
    except (ValueError, ConfigError) as e:
        parser.error(str(e))
    result["meta"] = meta("host-time", argv, f"cpu (gloo, {a.nodes * a.ranks_per_node} local ranks)")
    return emit(result, as_json=a.json, save=a.save, format_text=format_table)


if __name__ == "__main__":
    raise SystemExit(main())
