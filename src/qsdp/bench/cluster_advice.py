"""The advisor against the emulated cluster: what the performance model predicts for each row
of a ``qsdp bench cluster --rates`` sweep, beside what was measured.

The model's inputs are measured on the machine, apart from the sweep's own step times, by
:func:`measure_inputs`: the same number of ranks as the emulation (``nodes x ranks_per_node``
processes at once, so they share the CPUs or the GPU as the emulated ranks do) each

* run forward, backward and the optimizer step of the bench's model and batch alone (no
  collectives): the compute time;
* all-gather inside its node's group (gloo, the bench's device: CUDA tensors go through the
  host): the intra-node bandwidth per rank from a large gather and the per-collective latency
  from a one-element gather;
* time the codec steps on the device (quantize, Hadamard quantize, dequantize-accumulate):
  the codec speeds, GB/s of the fp32 side (on 1M elements), and the fixed cost of one codec
  call (the intercept of calls on 16K and 64K elements).

:func:`predict_rows` then prices every row with the performance model (:func:`predict_step_s`):
the measured compute plus :func:`qsdp.perfmodel.comm_time` of the step's collectives
(:func:`qsdp.perfmodel.step_collectives`, the bytes the comm objects send), as gloo runs them
(all-gathers as rings, the plain reduce-scatter as a ring all-reduce, all-to-alls direct), on
host-staged hardware: the codecs (bytes over the speed plus the fixed cost per call), the
copies of every byte sent (at the intra-node bandwidth) and the latency of every step are the
host's, serial with the compute; the link's own time (the row's rate per node and direction, of
which the TCP payload share of an Ethernet frame is usable; an unlimited veth adds nothing to
the host's copy) runs alongside the host (prefetched gathers, asynchronous reduce-scatters):
:func:`qsdp.perfmodel.host_staged_step`. The shape is the bench's model. Each row gets the predicted speedup over
``fsdp`` at its rate, the error ``predicted / measured - 1``, the preset the advisor picks at
that rate (``qsdp advise``'s rule: a quantized preset only when predicted at least the margin
faster than ``fsdp``) and the fastest preset measured there.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import torch

from qsdp.perfmodel import (Collective, Hardware, ShapeSetup, comm_time, host_staged_step, shard_sizes,
                            step_collectives)
from qsdp.train.model import MODEL_SIZES, default_vocab


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _compute_seconds(job: Mapping[str, Any], device: torch.device) -> float:
    from qsdp.train.model import make_gpt

    torch.manual_seed(0)
    vocab = default_vocab(job["model"])
    model = make_gpt(job["model"], vocab, job["seq_len"]).to(device)
    if job["param_dtype"] == "bfloat16":
        model = model.to(torch.bfloat16)  # FSDP2's mixed precision computes in the param dtype
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (job["batch_size"], job["seq_len"] + 1), device=device)

    def step():
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()

    return _median_seconds(step, device, repeats=3)


def _gather_seconds(numel: int, group, device: torch.device, repeats: int) -> float:
    import torch.distributed as dist

    from qsdp.comm.collectives import all_gather_flat

    size = dist.get_world_size(group)
    chunk = torch.ones(numel, dtype=torch.float32, device=device)
    out = torch.empty(size * numel, dtype=torch.float32, device=device)
    dist.barrier()
    return _median_seconds(lambda: all_gather_flat(out, chunk, group), device, repeats)


def _codec_speeds(device: torch.device, n: int, n_small: int) -> tuple[dict[str, float], float]:
    """GB/s of every codec step on ``n`` elements, and the fixed seconds of one call: the
    intercept of the times of calls on ``n_small`` and ``4 * n_small`` elements (small enough to
    stay in cache, where the per-element time is lower than at ``n``), the median over the steps."""
    from .codecs import workload

    speeds, fixed = {}, []
    for name, step_name in CODEC_STEPS.items():
        t_big = _median_seconds(workload(step_name, n, device.type)[0], device, repeats=3)
        t1 = _median_seconds(workload(step_name, n_small, device.type)[0], device, repeats=9)
        t4 = _median_seconds(workload(step_name, 4 * n_small, device.type)[0], device, repeats=9)
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
        compute_s = _compute_seconds(job, device)
        dist.barrier()
        big, small = job["gather_numel"], 1
        t_big = _gather_seconds(big, node_group, device, repeats=5)
        t_small = _gather_seconds(small, node_group, device, repeats=20)
        dist.barrier()
        kernels, call_s = _codec_speeds(device, job["codec_numel"], job["codec_small_numel"])
        return {"compute_s": compute_s, "t_big": t_big, "t_small": t_small, "kernels": kernels, "call_s": call_s}
    finally:
        dist.destroy_process_group()


def measure_inputs(nodes: int, ranks_per_node: int, *, model: str, seq_len: int, batch_size: int,
                   device: str = "cpu", param_dtype: str = "float32", gather_mb: float = 16.0,
                   codec_elements: int = 1 << 20, codec_small_elements: int = 1 << 14) -> ModelInputs:
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
           "codec_small_numel": codec_small_elements}
    res = list(launch_local(_probe, nodes * ranks_per_node, job, nodes, ranks_per_node).values())
    m = ranks_per_node
    latency = statistics.median(r["t_small"] for r in res) / (m - 1)
    # A ring all-gather: (m - 1) steps, each one chunk in and one latency.
    wire = [max(r["t_big"] - (m - 1) * latency, 1e-9) for r in res]
    intra = (m - 1) * job["gather_numel"] * 4 / statistics.median(wire) / 1e9
    kernels = {k: statistics.median(r["kernels"][k] for r in res) for k in CODEC_STEPS}
    return ModelInputs(compute_s=statistics.median(r["compute_s"] for r in res), intra_gbps=intra,
                       latency_us=latency * 1e6, kernels=kernels,
                       codec_call_us=statistics.median(r["call_s"] for r in res) * 1e6)


def emulated_hardware(inputs: ModelInputs, rate_mbit: float, ranks_per_node: int) -> Hardware:
    """The measured cluster as the model's :class:`~qsdp.perfmodel.Hardware`: a rank's share of
    its node's link (``rate_mbit`` per direction, of which :data:`TCP_PAYLOAD_FRACTION` is
    payload; 0, not limited: infinite, the host's copy at the intra-node bandwidth is all), the
    measured intra-node bandwidth and per-step latency (both links), the measured fixed cost of
    a codec call; host-staged (gloo on the host: the codecs and every copy share the CPUs);
    compute and the kernels are given as times and speeds, so its FLOP/s are unused."""
    inter = (rate_mbit / 8e3 * TCP_PAYLOAD_FRACTION / ranks_per_node if rate_mbit > 0
             else math.inf)  # not shaped: the host's copy (at intra_gbps) is all there is
    return Hardware(name="emulated", gpus_per_node=ranks_per_node, tflops=1.0, mfu=1.0, hbm_gbps=1.0,
                    intra_gbps=inputs.intra_gbps, inter_gbps=inter, intra_latency_us=inputs.latency_us,
                    inter_latency_us=inputs.latency_us, codec_call_us=inputs.codec_call_us, host_staged=True)


def gloo_collectives(collectives: Sequence[Collective]) -> list[Collective]:
    """The step's collectives as gloo runs them: an all-gather is a ring (each node's boundary
    carries ``P - 1`` chunks, not the ``M * (P - M)`` the meter counts: the veth's byte counter
    of the quantized gathers says so); the plain reduce-scatter is a ring all-reduce (twice a
    ring's chunks and steps; the veth's counter of ``fsdp`` says so); all-to-alls are direct."""
    return [dataclasses.replace(c, algo="ring_allreduce") if c.algo == "ring" and c.kind == "grads" else c
            for c in collectives]


def predict_step_s(preset: str, inputs: ModelInputs, rate_mbit: float, *, nodes: int, ranks_per_node: int,
                   model: str, seq_len: int, batch_size: int, param_dtype: str) -> float:
    """The model's step time of ``preset`` for the bench's job on the emulated cluster: the
    measured compute plus the collectives of :func:`qsdp.perfmodel.step_collectives` as gloo
    runs them, priced by :func:`qsdp.perfmodel.comm_time` (host: copies, latency, codec; the
    link apart), host and link overlapped by :func:`qsdp.perfmodel.host_staged_step`."""
    setup = ShapeSetup("custom", "emulated", nodes * ranks_per_node, 1, 1, seq_len=seq_len, micro_batch=batch_size,
                       layout="layer", zero3=True, vocab_size=default_vocab(model), **MODEL_SIZES[model])
    hw = emulated_hardware(inputs, rate_mbit, ranks_per_node)
    colls = step_collectives(preset, shard_sizes(setup), nodes, ranks_per_node, zero3=True,
                             param_bytes=2 if param_dtype == "bfloat16" else 4, grad_bytes=4)
    colls = gloo_collectives(colls)
    ct = comm_time(colls, hw, nodes, ranks_per_node, inputs.kernels)
    host = inputs.compute_s + ct["weights"] + ct["grads"] + ct["control"]
    return host_staged_step(host, ct["link"], len(colls))


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
        pred = {r["preset"]: predict_step_s(r["preset"], inputs, rate, **shape) for r in rows}
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
               "model": "measured compute + qsdp.perfmodel.comm_time of the step's collectives as gloo runs "
                        "them (ring gathers, all-reduce reduce-scatter, direct all-to-alls), host-staged "
                        "(codecs with a fixed cost per call, copies and latency on the host, serial), the "
                        "link alongside the host; inputs measured on this "
                        "machine apart from the sweep"}
    result["advisor"] = summary
    return summary
