"""``qsdp bench guard``: what the accuracy guard costs, in bytes (byte meter) and step time.

Training steps of the ``tiny`` GPT in 4 local processes as 2 nodes x 2 ranks (gloo; with ``--hsdp``
on FSDP2's native HSDP mesh, sharded inside each node, as ``qsdp train --hsdp``), per preset
with a guard every ``--every`` steps whose limits no group can reach (what a round costs does
not depend on its verdict, and a move would change the steps after it). Every step is timed
between barriers and metered on its own; a step is classed by the part of a round it runs:

* ``gradients``: the guarded step (an exact fp32 reduce-scatter of every group beside its own);
* ``weights``: the next one (its first gathers compare this rank's row with its shard);
* ``decide``: the one after (one all-reduce of the round's sums, one host read);
* ``plain``: every other step, which runs exactly as without a guard (the same bytes: checked).

Bytes per step averaged over a run guarded every ``K`` steps: ``(round's extra bytes) / K`` on top
of a plain step's, stated for ``K`` = the default and for ``--every``.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import qsdp
from qsdp.guard import DEFAULT_EVERY, GuardConfig
from qsdp.launch import launch_local
from qsdp.text_table import aligned
from qsdp.usage import UsageParser, save_path

from .report import emit, meta
from .workload import _sharded_gpt

PHASES = ("plain", "gradients", "weights", "decide")
# A guard that measures and never moves a group.
NEVER = dict(weight_limit=math.inf, grad_limit=math.inf)


def run_rounds(preset: str, every: int, rounds: int, ranks_per_node: int, model_name: str, seq_len: int,
               batch_size: int, hsdp: bool = False) -> dict[str, Any]:
    """On each rank of a launched world: the steps of ``rounds`` guard rounds (after a warm-up
    round's worth of steps), each step's phase, wall time and bytes per meter kind (in all, and
    between the nodes)."""
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    vocab = 256
    if hsdp and not dist.is_initialized():  # (FSDP2 starts the default group itself on a 1-D mesh)
        dist.init_process_group("gloo")
    mesh = qsdp.hsdp_groups(ranks_per_node=ranks_per_node, device_type="cpu").mesh if hsdp else None
    model, _ = _sharded_gpt(model_name, vocab, seq_len, dev, "float32", mesh)
    handle = qsdp.quantize_comms(model, preset, overrides={"local_world_size": ranks_per_node},
                                 guard=GuardConfig(every=every, **NEVER))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    steps = []
    for step in range(every * (rounds + 1)):
        phase = handle.guard.upcoming()
        dist.barrier()
        handle.comm_stats(reset=True)
        started = time.perf_counter()
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        seconds = time.perf_counter() - started
        stats = handle.comm_stats(reset=True)
        if step >= every:  # the first round's steps warm up
            steps.append({"phase": phase, "seconds": seconds,
                          "bytes": {k: stats[k]["total"]["bytes"] for k in stats},
                          "inter_bytes": {k: stats[k]["inter"]["bytes"] for k in stats}})
    return {"preset": preset, "steps": steps, "escalations": len(handle.guard.escalations)}


def summarize(rank0: dict[str, Any], every: int) -> dict[str, Any]:
    """Per phase, the median step time and bytes per kind; the round's extra bytes and time, and
    the bytes per step averaged over ``every`` and over the default K."""
    by_phase: dict[str, list[dict[str, Any]]] = {p: [s for s in rank0["steps"] if s["phase"] == p] for p in PHASES}
    out: dict[str, Any] = {"phases": {}}
    for p, steps in by_phase.items():
        if not steps:
            continue
        total = [sum(s["bytes"].values()) for s in steps]
        out["phases"][p] = {"steps": len(steps), "median_time_s": statistics.median(s["seconds"] for s in steps),
                            "bytes": statistics.median(total),
                            "guard_bytes": statistics.median(s["bytes"].get("guard", 0) for s in steps)}
    plain = out["phases"]["plain"]
    plain_bytes = [sum(s["bytes"].values()) for s in by_phase["plain"]]
    out["plain_steps_same_bytes"] = len(set(plain_bytes)) == 1
    extra_bytes = sum(out["phases"][p]["bytes"] - plain["bytes"] for p in PHASES[1:] if p in out["phases"])
    extra_time = sum(out["phases"][p]["median_time_s"] - plain["median_time_s"] for p in PHASES[1:]
                     if p in out["phases"])
    out["round_extra_bytes"] = extra_bytes
    out["round_extra_time_s"] = extra_time
    inter = {p: statistics.median(sum(s["inter_bytes"].values()) for s in steps) for p, steps in by_phase.items() if steps}
    out["round_extra_inter_bytes"] = sum(inter[p] - inter["plain"] for p in PHASES[1:] if p in inter)
    for k in sorted({every, DEFAULT_EVERY}):
        out[f"bytes_per_step_every_{k}_vs_unguarded"] = (plain["bytes"] + extra_bytes / k) / plain["bytes"]
        if inter["plain"]:
            out[f"inter_bytes_per_step_every_{k}_vs_unguarded"] = \
                (inter["plain"] + out["round_extra_inter_bytes"] / k) / inter["plain"]
        out[f"time_per_step_every_{k}_vs_unguarded"] = (plain["median_time_s"] + extra_time / k) / plain["median_time_s"]
    out["guarded_step_time_vs_plain"] = out["phases"]["gradients"]["median_time_s"] / plain["median_time_s"]
    out["escalations"] = rank0["escalations"]
    return out


def measure(presets: list[str], every: int, rounds: int, nproc: int = 4, ranks_per_node: int = 2,
            model: str = "tiny", seq_len: int = 64, batch_size: int = 8, hsdp: bool = False) -> dict[str, Any]:
    """Every preset's rounds in a launched world of ``nproc`` ranks (``hsdp``: on FSDP2's native
    HSDP mesh); the JSON-ready result."""
    for p in presets:
        qsdp.resolve_config(p)  # a bad name fails before anything is launched
    out: dict[str, Any] = {"nodes": nproc // ranks_per_node, "ranks_per_node": ranks_per_node, "model": model,
                           "seq_len": seq_len, "batch_size": batch_size, "every": every, "rounds": rounds,
                           "default_every": DEFAULT_EVERY, "hsdp": hsdp, "presets": {}}
    for p in presets:
        rank0 = launch_local(run_rounds, nproc, p, every, rounds, ranks_per_node, model, seq_len, batch_size, hsdp)[0]
        out["presets"][p] = summarize(rank0, every)
    return out


def format_table(result: dict[str, Any]) -> str:
    k, d = result["every"], result["default_every"]
    rows = [("preset", "plain step", "guarded step", "weights step", "decide step", "round +bytes",
             f"bytes/step K={d}", f"bytes/step K={k}", f"inter-node K={d}", f"time/step K={d}")]
    for p, r in result["presets"].items():
        ph = r["phases"]
        ms = lambda name: f"{1e3 * ph[name]['median_time_s']:.0f} ms" if name in ph else "-"  # noqa: E731
        rows.append((p, ms("plain"), ms("gradients"), ms("weights"), ms("decide"),
                     f"{r['round_extra_bytes'] / 1e6:.2f} MB", f"{r[f'bytes_per_step_every_{d}_vs_unguarded']:.4f}x",
                     f"{r[f'bytes_per_step_every_{k}_vs_unguarded']:.4f}x",
                     _ratio(r.get(f"inter_bytes_per_step_every_{d}_vs_unguarded")),
                     f"{r[f'time_per_step_every_{d}_vs_unguarded']:.3f}x"))
    layout = " (HSDP)" if result.get("hsdp") else ""
    head = (f"{result['nodes']} nodes x {result['ranks_per_node']} ranks{layout}, model {result['model']}, a guard round every "
            f"{k} steps, {result['rounds']} rounds (medians; bytes from the byte meter, rank 0)")
    return "\n".join([head, *aligned(rows)])


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}x"


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(prog="qsdp bench guard", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["sdp4bit", "qsdp", "zeropp"])
    parser.add_argument("--every", type=int, default=5, help="a round every this many steps (default 5)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds measured after one warm-up round (default 4)")
    parser.add_argument("--hsdp", action="store_true",
                        help="FSDP2's native HSDP mesh: sharded inside each node, replicas across the nodes")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    args = parser.parse_args(argv)
    if args.every < 4:
        parser.error(f"--every={args.every} must be at least 4 (a round spans 3 steps; one plain step between)")
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds} must be at least 1")
    result = measure(args.presets, args.every, args.rounds, hsdp=args.hsdp)
    result["meta"] = meta("guard", argv, "cpu (gloo)")
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)


if __name__ == "__main__":
    raise SystemExit(main())
