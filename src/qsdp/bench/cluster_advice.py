"""The advisor against the emulated cluster: what the performance model predicts for each row
of a ``qsdp bench cluster --rates`` sweep, beside what was measured.

The model's inputs are measured on the machine, apart from the sweep's own step times, by
:func:`measure_inputs`: the same number of ranks as the emulation (``nodes x ranks_per_node``
processes at once, so they share the CPUs or the GPU as the emulated ranks do) each

* run forward, backward and the optimizer step of the bench's model and batch under FSDP2 as
  the bench wraps it, on a group of its own (no peers): the compute time, FSDP2's hooks and
  copies included;
* all-gather inside its node's group (gloo, the bench's device: CUDA tensors go through the
  host): the intra-node bandwidth per rank from a large gather and the per-collective latency
  from a one-element gather;
* time the codec steps on the device (quantize, Hadamard quantize, dequantize-accumulate):
  the codec speeds, GB/s of the fp32 side (on 1M elements), and the fixed cost of one codec
  call (the intercept of calls on 16K and 64K elements);
* time every step of the comm objects each preset of the sweep runs, as :mod:`qsdp.comm` runs it
  with that preset's config (plain, quantized and weight-difference gathers, a replica's fill,
  the difference gathers' agreement, plain, one-level and two-level reduce-scatters), on the
  local ranks laid out as the emulation's nodes, on a small and a larger shard: a fixed cost per
  collective and a cost per element (:mod:`qsdp.bench.comm_calls`).

:func:`predict_rows` then prices every row with the performance model (:func:`predict_step_s`):
the collectives of the step (:func:`qsdp.perfmodel.step_collectives`: the bytes the comm objects
send, for the bench model's FSDP2 groups, the root gathered once and each block twice) as gloo
runs them (all-gathers as rings, the plain reduce-scatter as a ring all-reduce, all-to-alls
direct), one after the other on the host between the compute
(:func:`qsdp.perfmodel.synchronous_step`): each costs its comm step's measured host time for its
elements, and waits for the shaped link where the ``tbf`` bucket (its burst, refilled at the
row's rate while the host works) cannot pass its inter-node bytes at once. The link is the row's
rate per node and direction, of which the TCP payload share of an Ethernet frame is usable; an
unlimited veth adds nothing to the host's work. Each row gets the predicted speedup over
``fsdp`` at its rate, the error ``predicted / measured - 1``, the preset the advisor picks at
that rate (``qsdp advise``'s rule: a quantized preset only when predicted at least the margin
faster than ``fsdp``) and the fastest preset measured there.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import torch

from qsdp.perfmodel import Collective, Hardware, step_collectives, synchronous_step
from qsdp.train.model import MODEL_SIZES, default_vocab

from . import netns
from .comm_calls import fit_calls, measure_call_seconds, median_seconds
from .report import BENCH_PRESETS


# The codec steps of qsdp bench codecs that stand for the model's three kernel speeds.
CODEC_STEPS = {"quantize": "quantize_stochastic", "hadamard_quantize": "hadamard_quantize",
               "dequantize": "dequantize_accumulate"}
PICK_TOLERANCE = 0.05  # a pick within 5% of the fastest measured step counts as right
# The qdisc shapes Ethernet frames: of a 1514-byte frame (MTU 1500), TCP over IPv4 with
# timestamps carries 1448 bytes of payload, which is what the byte meter counts.
TCP_PAYLOAD_FRACTION = 1448 / 1514


@dataclass(frozen=True)
class ModelInputs:
    """What the performance model is given about the emulated cluster (all measured)."""

    compute_s: float  # forward + backward + optimizer step of one rank, all ranks running at once
    intra_gbps: float  # GB/s one rank receives in an all-gather inside its node
    latency_us: float  # one ring step (or peer) of a collective
    kernels: dict[str, float]  # GB/s of the fp32 side: quantize, hadamard_quantize, dequantize
    codec_call_us: float = 0.0  # fixed cost of one codec call, on top of its bytes over the speed
    # Host cost of one step of each comm object (qsdp.perfmodel.CALLS) a preset runs, measured
    # whole with that preset's config, {preset: {step: value}}: fixed us per collective and ns
    # per element it carries.
    call_us: dict[str, dict[str, float]] = field(default_factory=dict)
    call_ns_per_element: dict[str, dict[str, float]] = field(default_factory=dict)


def _compute_seconds(job: Mapping[str, Any], device: torch.device, solo) -> float:
    """One step of the bench's model and batch under FSDP2 as the bench wraps it (a group per
    block and the root, its mixed precision), on ``solo``, a group of this rank alone: the step's
    own work, FSDP2's hooks and copies included, without a peer to wait for."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from qsdp.train.model import make_gpt, transformer_blocks

    torch.manual_seed(0)
    vocab = default_vocab(job["model"])
    model = make_gpt(job["model"], vocab, job["seq_len"]).to(device)
    mesh = DeviceMesh.from_group(solo, device.type)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if job["param_dtype"] == "bfloat16" else MixedPrecisionPolicy())
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (job["batch_size"], job["seq_len"] + 1), device=device)

    def step():
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()

    return median_seconds(step, device, repeats=5)


def _gather_seconds(numel: int, group, device: torch.device, repeats: int) -> float:
    import torch.distributed as dist

    from qsdp.comm.collectives import all_gather_flat

    size = dist.get_world_size(group)
    chunk = torch.ones(numel, dtype=torch.float32, device=device)
    out = torch.empty(size * numel, dtype=torch.float32, device=device)
    dist.barrier()
    return median_seconds(lambda: all_gather_flat(out, chunk, group), device, repeats)


def _codec_speeds(device: torch.device, n: int, n_small: int) -> tuple[dict[str, float], float]:
    """GB/s of every codec step on ``n`` elements, and the fixed seconds of one call: the
    intercept of the times of calls on ``n_small`` and ``4 * n_small`` elements (small enough to
    stay in cache, where the per-element time is lower than at ``n``), the median over the steps."""
    from .codecs import workload

    speeds, fixed = {}, []
    for name, step_name in CODEC_STEPS.items():
        t_big = median_seconds(workload(step_name, n, device.type)[0], device, repeats=3)
        t1 = median_seconds(workload(step_name, n_small, device.type)[0], device, repeats=9)
        t4 = median_seconds(workload(step_name, 4 * n_small, device.type)[0], device, repeats=9)
        speeds[name] = 4 * n / t_big / 1e9
        fixed.append(max(0.0, t1 - (t4 - t1) / 3))
    return speeds, statistics.median(fixed)


def _probe(job: Mapping[str, Any], nodes: int, ranks_per_node: int) -> dict[str, Any]:
    """One rank of :func:`measure_inputs` (under :func:`qsdp.launch.launch_local`)."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # as the bench's ranks run
    local = int(os.environ["LOCAL_RANK"])
    if job["device"] == "cuda":
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        groups = [dist.new_group(list(range(d * ranks_per_node, (d + 1) * ranks_per_node)))
                  for d in range(nodes)]
        node_group = groups[rank // ranks_per_node]
        solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
        compute_s = _compute_seconds(job, device, solo)
        dist.barrier()
        big, small = job["gather_numel"], 1
        t_big = _gather_seconds(big, node_group, device, repeats=5)
        t_small = _gather_seconds(small, node_group, device, repeats=20)
        dist.barrier()
        kernels, call_s = _codec_speeds(device, job["codec_numel"], job["codec_small_numel"])
        dtype = torch.bfloat16 if job["param_dtype"] == "bfloat16" else torch.float32
        comm_calls = measure_call_seconds(ranks_per_node, device, dtype, job["presets"])
        return {"compute_s": compute_s, "t_big": t_big, "t_small": t_small, "kernels": kernels, "call_s": call_s,
                "comm_calls": comm_calls}
    finally:
        dist.destroy_process_group()


def measure_inputs(nodes: int, ranks_per_node: int, *, model: str, seq_len: int, batch_size: int,
                   device: str = "cpu", param_dtype: str = "float32", gather_mb: float = 16.0,
                   codec_elements: int = 1 << 20, codec_small_elements: int = 1 << 14,
                   presets: Sequence[str] = BENCH_PRESETS) -> ModelInputs:
    """The :class:`ModelInputs` of the emulated cluster, measured by ``nodes * ranks_per_node``
    local processes at once (medians over the ranks); ``gather_mb`` MB per rank in the bandwidth
    gather, ``codec_elements`` per codec step for the speeds, ``codec_small_elements`` (and four
    times that) for the fixed cost of a call."""
    from qsdp.launch import launch_local

    if model not in MODEL_SIZES:
        raise ValueError(f"model {model!r}; known: {', '.join(MODEL_SIZES)}")
    if ranks_per_node < 2:
        raise ValueError("the intra-node bandwidth needs at least 2 ranks per node")
    job = {"model": model, "seq_len": seq_len, "batch_size": batch_size, "device": device,
           "param_dtype": param_dtype, "gather_numel": int(gather_mb * 1e6 / 4), "codec_numel": codec_elements,
           "codec_small_numel": codec_small_elements, "presets": list(presets)}
    res = list(launch_local(_probe, nodes * ranks_per_node, job, nodes, ranks_per_node).values())
    m = ranks_per_node
    latency = statistics.median(r["t_small"] for r in res) / (m - 1)
    # A ring all-gather: (m - 1) steps, each one chunk in and one latency.
    wire = [max(r["t_big"] - (m - 1) * latency, 1e-9) for r in res]
    intra = (m - 1) * job["gather_numel"] * 4 / statistics.median(wire) / 1e9
    kernels = {k: statistics.median(r["kernels"][k] for r in res) for k in CODEC_STEPS}
    calls = {p: {k: [statistics.median(r["comm_calls"][p][k][i] for r in res) for i in range(2)] for k in steps}
             for p, steps in res[0]["comm_calls"].items()}
    call_us, call_ns = fit_calls(calls, nodes, ranks_per_node, 2 if param_dtype == "bfloat16" else 4)
    return ModelInputs(compute_s=statistics.median(r["compute_s"] for r in res), intra_gbps=intra,
                       latency_us=latency * 1e6, kernels=kernels,
                       codec_call_us=statistics.median(r["call_s"] for r in res) * 1e6,
                       call_us=call_us, call_ns_per_element=call_ns)


def emulated_hardware(inputs: ModelInputs, rate_mbit: float, ranks_per_node: int, qdisc: str = "tbf",
                      preset: str | None = None) -> Hardware:
    """The measured cluster as the model's :class:`~qsdp.perfmodel.Hardware`: a rank's share of
    its node's link (``rate_mbit`` per direction, of which :data:`TCP_PAYLOAD_FRACTION` is
    payload; 0, not limited: infinite, the host's copy at the intra-node bandwidth is all) and of
    its token bucket (``qdisc`` ``tbf``; ``netem`` has none), the measured intra-node bandwidth
    and per-step latency (both links), the measured fixed cost of a codec call and of each comm
    step of ``preset`` (none: every collective priced by its parts); host-staged (gloo on the
    host: the codecs and every copy share the CPUs); compute and the kernels are given as times
    and speeds, so its FLOP/s are unused."""
    inter = (rate_mbit / 8e3 * TCP_PAYLOAD_FRACTION / ranks_per_node if rate_mbit > 0
             else math.inf)  # not shaped: the host's copy (at intra_gbps) is all there is
    # The bucket the emulation's shaper gives a node's link (netns.tbf_burst_bytes), in frame bytes.
    burst = (netns.tbf_burst_bytes(rate_mbit * 1e6 / 8) * TCP_PAYLOAD_FRACTION / ranks_per_node
             if rate_mbit > 0 and qdisc == "tbf" else 0.0)
    return Hardware(name="emulated", gpus_per_node=ranks_per_node, tflops=1.0, mfu=1.0, hbm_gbps=1.0,
                    intra_gbps=inputs.intra_gbps, inter_gbps=inter, intra_latency_us=inputs.latency_us,
                    inter_latency_us=inputs.latency_us, codec_call_us=inputs.codec_call_us, host_staged=True,
                    call_us=dict(inputs.call_us.get(preset, {})),
                    call_ns_per_element=dict(inputs.call_ns_per_element.get(preset, {})),
                    inter_burst_bytes=burst)


def bench_shards(model: str, seq_len: int, world: int) -> list[int]:
    """Per-rank shards of the bench's FSDP2 groups (the root, then one per block), as
    ``fully_shard`` cuts them: every parameter's first dimension padded to the world size. Built
    on the meta device: shapes only."""
    from qsdp.train.model import make_gpt, transformer_blocks

    with torch.device("meta"):
        gpt = make_gpt(model, default_vocab(model), seq_len)
    blocks = [list(b.parameters()) for b in transformer_blocks(gpt)]
    in_blocks = {id(p) for ps in blocks for p in ps}
    root = [p for p in gpt.parameters() if id(p) not in in_blocks]

    def shard(params) -> int:
        return sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0]) for p in params)

    return [shard(root)] + [shard(ps) for ps in blocks]


def gloo_collectives(collectives: Sequence[Collective]) -> list[Collective]:
    """The step's collectives as gloo runs them: an all-gather is a ring (each node's boundary
    carries ``P - 1`` chunks, not the ``M * (P - M)`` the meter counts: the veth's byte counter
    of the quantized gathers says so); the plain reduce-scatter is a ring all-reduce (twice a
    ring's chunks and steps; the veth's counter of ``fsdp`` says so); all-to-alls are direct."""
    return [dataclasses.replace(c, algo="ring_allreduce") if c.algo == "ring" and c.kind == "grads" else c
            for c in collectives]


def predict_step_s(preset: str, inputs: ModelInputs, rate_mbit: float, *, nodes: int, ranks_per_node: int,
                   model: str, seq_len: int, batch_size: int, param_dtype: str, qdisc: str = "tbf") -> float:
    """The model's step time of ``preset`` for the bench's job on the emulated cluster: the
    measured compute and the collectives of :func:`qsdp.perfmodel.step_collectives` for the
    bench's FSDP2 groups (:func:`bench_shards`; FSDP2 keeps the root gathered from forward to
    backward, so it gathers once, the blocks twice) as gloo runs them, one after the other on
    the host with the shaped link's waits: :func:`qsdp.perfmodel.synchronous_step`."""
    hw = emulated_hardware(inputs, rate_mbit, ranks_per_node, qdisc, preset)
    shards = bench_shards(model, seq_len, nodes * ranks_per_node)
    colls = step_collectives(preset, shards, nodes, ranks_per_node, gathers=[1] + [2] * (len(shards) - 1),
                             param_bytes=2 if param_dtype == "bfloat16" else 4, grad_bytes=4,
                             host_staged=hw.host_staged)
    colls = gloo_collectives(colls)
    return synchronous_step(inputs.compute_s, colls, hw, nodes, ranks_per_node, inputs.kernels)["step_s"]


def predict_rows(result: dict[str, Any], inputs: ModelInputs, margin: float = 0.05) -> dict[str, Any]:
    """Add to every row of a sweep ``result`` the predicted step and speedup, the error, the
    advisor's pick and the fastest measured preset at its rate; returns the summary (also put
    in ``result["advisor"]``): mean |error| over the quantized rows and the picks' outcome."""
    shape = {k: result[k] for k in ("nodes", "ranks_per_node", "model", "seq_len", "batch_size", "param_dtype")}
    by_rate: dict[float, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        by_rate.setdefault(row["rate_mbit"], []).append(row)
    picks = []
    for rate, rows in by_rate.items():
        pred = {r["preset"]: predict_step_s(r["preset"], inputs, rate, qdisc=r.get("qdisc", "tbf"), **shape)
                for r in rows}
        base = pred.get("fsdp")
        fastest = min(rows, key=lambda r: r["step_time_s"])
        best = min(pred, key=pred.get)
        pick = best if base is None or best == "fsdp" or base / pred[best] >= 1 + margin else "fsdp"
        measured_pick = next(r for r in rows if r["preset"] == pick)
        ok = measured_pick["step_time_s"] <= (1 + PICK_TOLERANCE) * fastest["step_time_s"]
        picks.append({"rate_mbit": rate, "pick": pick, "fastest_measured": fastest["preset"], "pick_ok": ok,
                      "pick_slower_by": measured_pick["step_time_s"] / fastest["step_time_s"] - 1})
        for r in rows:
            r["predicted_step_s"] = pred[r["preset"]]
            r["predicted_speedup"] = base / pred[r["preset"]] if base else None
            measured = r.get("speedup_vs_fsdp")
            r["prediction_error"] = (r["predicted_speedup"] / measured - 1
                                     if r["predicted_speedup"] and measured else None)
            r["advisor_pick"], r["fastest_measured"] = pick, fastest["preset"]
    errors = [abs(r["prediction_error"]) for r in result["rows"]
              if r["preset"] != "fsdp" and r.get("prediction_error") is not None]
    summary = {"inputs": asdict(inputs), "margin": margin, "pick_tolerance": PICK_TOLERANCE,
               "mean_abs_error": statistics.mean(errors) if errors else None,
               "max_abs_error": max(errors) if errors else None,
               "picks": picks, "picks_ok": sum(p["pick_ok"] for p in picks), "rates": len(picks),
               "model": "measured FSDP2 compute + the step's collectives (bench model's FSDP2 groups, as gloo runs "
                        "them) one after the other on the host, each at its comm step's measured fixed and "
                        "per-element cost, waiting for the shaped link where the tbf bucket cannot pass its "
                        "inter-node bytes; inputs measured on this machine apart from the sweep"}
    result["advisor"] = summary
    return summary
