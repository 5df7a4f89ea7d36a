"""``python -m benchmarks.soak``: train for a long time and check that memory stays flat and steps do not slow down.

Launches ``--nproc`` local workers (torch's elastic launcher, gloo on CPU or NCCL with one GPU a
worker, as ``qsdp train``) that train a GPT (``tiny`` by default) with the chosen preset
(``sdp4bit`` by default) on the default corpus, exactly as the training loop does (FSDP2 +
qsdp comms, AdamW, gradient clipping, the non-finite gradient check) but for ``--minutes``
of wall time instead of a number of steps, with a constant learning rate after a short warmup.

Every ``--sample-every`` steps each worker reads its resident set size (``VmRSS`` of
``/proc/self/status``; where there is no ``/proc``, the peak RSS from ``getrusage``, which can
only grow) and its mean step time over those steps; one all-reduce brings every worker's sample
to rank 0 (and rank 0's decision to stop to everyone). Reported, over the samples after the
warm-up (``--warmup-minutes``, default 20 % of the run, at most 5 minutes: allocator pools,
caches and the first weight-difference gathers settle there):

- ``memory.slope_mb_per_hour``: the largest over the workers of the least-squares slope of RSS
  (MB) against time (hours); ``memory.flat`` says whether it is at most ``--max-slope``
  (MB/hour, default 10). A slope from a window of a few minutes is noisy (one page-cache or
  allocator step of a few MB is hundreds of MB/hour over 20 seconds): judge ``flat`` on runs of
  tens of minutes.
- ``step_time.drift_pct``: the median step time of the last quarter of the window against the
  first quarter, in percent, and ``step_time.slope_pct_per_hour`` (least squares, relative to
  the mean).

``--json`` prints one JSON object; ``--save FILE`` also writes it with ``meta`` (command, torch
version, date, device).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import qsdp
from qsdp.config import ConfigError, resolve_config
from qsdp.launch import launch_local
from qsdp.train.args import DEVICES, TrainArgs
from qsdp.train.data import DataError
from qsdp.train.launcher import quiet_elastic_logs
from qsdp.train.model import MODEL_SIZES
from qsdp.train.preflight import prepare_dataset
from qsdp.train.runtime import init_process_group, rank0_first, run_device
from qsdp.results import emit
from qsdp.train.trainer import build_model, clip_grads, make_optimizer
from qsdp.usage import save_path

from ._cli import run_script

PROGRAM = "python -m benchmarks.soak"

DEFAULT_PRESET = "sdp4bit"
MIB = 1024 * 1024


def rss_mb() -> tuple[float, str]:
    """This process's resident set size in MB and where it was read (``VmRSS`` or ``maxrss``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / MIB, "VmRSS"
    except OSError:
        pass
    import resource  # POSIX only: imported where it is needed

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return (peak / MIB if sys.platform == "darwin" else peak / 1024), "maxrss"


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Slope of the least-squares line through (xs, ys); ``None`` with fewer than 2 distinct xs."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


# --------------------------------------------------------------------------- the worker


def _soak_worker(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """One worker of the soak (top level: the spawn start method pickles it). Returns rank 0's
    samples, ``None`` on the other ranks."""

    args = TrainArgs(preset=cfg["preset"], model=cfg["model"], batch_size=cfg["batch_size"],
                     seq_len=cfg["seq_len"], data=cfg["data"], lr=cfg["lr"], steps=1,
                     device=cfg["device"], cache_dir=cfg["cache_dir"], progress=False)
    init_process_group(args)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = run_device(args, created_group=True)
        ds, _ = rank0_first(lambda: prepare_dataset(args), rank)
        model, dtype_name = build_model(args, ds.vocab_size, device)
        handle = qsdp.quantize_comms(model, args.preset)
        optimizer = make_optimizer(model, args)
        warmup_steps = 20
        duration = cfg["minutes"] * 60.0
        every = cfg["sample_every"]
        samples: list[dict[str, Any]] = []
        rss_source = rss_mb()[1]
        dist.barrier()
        t_start = time.perf_counter()
        window: list[float] = []
        skipped = 0
        step = 0
        while True:
            step += 1
            t0 = time.perf_counter()
            lr = args.lr * min(1.0, step / warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = ds.batch(step - 1, rank, world, args.batch_size, args.seq_len)
            x, y = x.to(device), y.to(device)
            _, loss = model(x, y)
            loss.backward()
            if handle.nonfinite_gradients():
                skipped += 1
            else:
                clip_grads(model, args.grad_clip)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            window.append(time.perf_counter() - t0)
            if step % every:
                continue
            elapsed = time.perf_counter() - t_start
            qsdp.comm_stats(reset=True)  # as the training loop does when it logs
            # One all-reduce: [rss, mean step time, loss] per rank, and rank 0's stop flag.
            vec = torch.zeros(3 * world + 1, dtype=torch.float64, device=device)
            vec[3 * rank: 3 * rank + 3] = torch.tensor(
                [rss_mb()[0], sum(window) / len(window), float(loss.detach())], dtype=torch.float64)
            if rank == 0:
                vec[-1] = float(elapsed >= duration)
            dist.all_reduce(vec)
            window.clear()
            vals = vec.tolist()
            if rank == 0:
                samples.append({
                    "t_s": round(elapsed, 3), "step": step,
                    "rss_mb": [round(vals[3 * r], 3) for r in range(world)],
                    "step_time_s": [vals[3 * r + 1] for r in range(world)],
                    "loss": sum(vals[3 * r + 2] for r in range(world)) / world,
                })
            if vals[-1]:
                break
        if rank != 0:
            return None
        return {"samples": samples, "steps": step, "duration_s": time.perf_counter() - t_start,
                "nonfinite_skipped": skipped, "rss_source": rss_source, "param_dtype": dtype_name,
                "device": _device_label(device), "backend": str(dist.get_backend()),
                "n_params": sum(p.numel() for p in model.parameters())}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _device_label(device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads/worker)"


# --------------------------------------------------------------------------- analysis


def analyse(samples: list[dict[str, Any]], warmup_s: float, max_slope: float) -> dict[str, Any]:
    """Memory slope and step-time drift over the samples taken after ``warmup_s``."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    world = len(samples[0]["rss_mb"]) if samples else 0
    hours = [s["t_s"] / 3600.0 for s in after]
    slopes = [least_squares_slope(hours, [s["rss_mb"][r] for s in after]) for r in range(world)]
    known = [v for v in slopes if v is not None]
    slope = max(known) if known else None
    memory = {
        "slope_mb_per_hour": slope,
        "slope_mb_per_hour_per_worker": slopes,
        "max_slope_mb_per_hour": max_slope,
        "flat": (slope <= max_slope) if slope is not None else None,
        "rss_mb_first": after[0]["rss_mb"] if after else None,
        "rss_mb_last": after[-1]["rss_mb"] if after else None,
        "rss_mb_max": [max(s["rss_mb"][r] for s in after) for r in range(world)] if after else None,
        "growth_mb": ([round(after[-1]["rss_mb"][r] - after[0]["rss_mb"][r], 3) for r in range(world)]
                      if after else None),
        "rss_mb_at_start": samples[0]["rss_mb"] if samples else None,
    }
    times = [statistics.fmean(s["step_time_s"]) for s in after]
    step_time: dict[str, Any] = {"median_s": statistics.median(times) if times else None,
                                 "first_quarter_median_s": None, "last_quarter_median_s": None,
                                 "drift_pct": None, "slope_pct_per_hour": None}
    if len(times) >= 4:
        q = len(times) // 4
        first, last = statistics.median(times[:q]), statistics.median(times[-q:])
        step_time.update(first_quarter_median_s=first, last_quarter_median_s=last,
                         drift_pct=100.0 * (last / first - 1.0))
    ts = least_squares_slope(hours, times)
    if ts is not None and times:
        step_time["slope_pct_per_hour"] = 100.0 * ts / statistics.fmean(times)
    return {"samples_after_warmup": len(after),
            "window_s": (after[-1]["t_s"] - after[0]["t_s"]) if len(after) > 1 else 0.0,
            "memory": memory, "step_time": step_time}


def measure(minutes: float, preset: str = DEFAULT_PRESET, nproc: int = 2, model: str = "tiny",
            batch_size: int = 8, seq_len: int = 64, lr: float = 1e-3, sample_every: int = 10,
            warmup_minutes: float | None = None, max_slope: float = 10.0, data: str | None = None,
            device: str | None = None, cache_dir: str | None = None) -> dict[str, Any]:
    """Run the soak and return the result (without ``meta``)."""

    if warmup_minutes is None:
        warmup_minutes = min(5.0, 0.2 * minutes)
    cfg = {"preset": preset, "model": model, "batch_size": batch_size, "seq_len": seq_len,
           "lr": lr, "data": data, "device": device, "cache_dir": cache_dir, "minutes": minutes,
           "sample_every": sample_every}
    env_threads = "OMP_NUM_THREADS" not in os.environ
    if env_threads:  # as `qsdp train`: the machine's cores shared by the workers
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    try:
        with quiet_elastic_logs():
            run = launch_local(_soak_worker, nproc, cfg)[0]
    finally:
        if env_threads:
            os.environ.pop("OMP_NUM_THREADS", None)
    samples = run.pop("samples")
    return {
        "preset": preset, "nproc": nproc, "model": model, "batch_size": batch_size,
        "seq_len": seq_len, "lr": lr, "minutes": minutes, "warmup_s": warmup_minutes * 60.0,
        "sample_every": sample_every, **run,
        **analyse(samples, warmup_minutes * 60.0, max_slope),
        "samples": samples,
    }


def format_report(result: dict[str, Any]) -> str:
    m, st = result["memory"], result["step_time"]

    def num(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    lines = [
        f"soak: {result['preset']}, {result['nproc']} workers, model {result['model']}, "
        f"{result['steps']} steps in {result['duration_s'] / 60:.1f} min "
        f"({result['samples_after_warmup']} samples after a {result['warmup_s'] / 60:.1f} min warm-up)",
        f"memory (RSS, {result['rss_source']}): slope {num(m['slope_mb_per_hour'], '+.2f')} MB/hour "
        f"(max over workers; limit {m['max_slope_mb_per_hour']:g}): "
        + {True: "flat", False: "GROWING", None: "too few samples"}[m["flat"]],
        f"  RSS after warm-up {m['rss_mb_first']} MB -> last {m['rss_mb_last']} MB",
        f"step time: median {num(st['median_s'] and 1000 * st['median_s'], '.1f')} ms, drift "
        f"{num(st['drift_pct'], '+.1f')}% (last vs first quarter), "
        f"slope {num(st['slope_pct_per_hour'], '+.1f')}%/hour",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="wall time of training (default 30)")
    parser.add_argument("--preset", default=DEFAULT_PRESET, help=f"communication preset (default {DEFAULT_PRESET})")
    parser.add_argument("--nproc", type=int, default=2, help="local workers, 2 or 4 (default 2)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data", default=None, metavar="FILE.txt", help="text to train on (default: the embedded corpus)")
    parser.add_argument("--sample-every", type=int, default=10, metavar="N", help="steps between samples (default 10)")
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="samples before this are left out of the slopes (default 20%% of --minutes, at most 5)")
    parser.add_argument("--max-slope", type=float, default=10.0, metavar="MB_PER_HOUR",
                        help="memory counts as flat up to this RSS slope (default 10 MB/hour)")
    parser.add_argument("--device", default=None, choices=DEVICES)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    args = parser.parse_args(argv)
    if not (args.minutes > 0 and args.minutes == args.minutes and args.minutes != float("inf")):
        parser.error(f"--minutes must be a positive number, got {args.minutes}")
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.sample_every < 1:
        parser.error(f"--sample-every must be at least 1, got {args.sample_every}")
    if args.warmup_minutes is not None and not 0 <= args.warmup_minutes < args.minutes:
        parser.error(f"--warmup-minutes must be in [0, --minutes), got {args.warmup_minutes}")

    try:
        resolve_config(args.preset)
    except ConfigError as e:
        parser.error(str(e))
    if args.model not in MODEL_SIZES:
        parser.error(f"unknown model {args.model!r}; allowed: {', '.join(MODEL_SIZES)}")

    try:  # the corpus and its token cache, once, before the workers start
        prepare_dataset(TrainArgs(data=args.data, seq_len=args.seq_len))
    except DataError as e:
        parser.error(str(e))

    try:
        result = measure(args.minutes, args.preset, args.nproc, args.model, args.batch_size,
                         args.seq_len, args.lr, args.sample_every, args.warmup_minutes,
                         args.max_slope, args.data, args.device)
    except ChildFailedError as e:
        rank, failure = min(e.failures.items())
        print(f"{PROGRAM}: worker rank {rank} failed: {failure.message or failure.exitcode}",
              file=sys.stderr)
        return 1
    result["meta"] = {
        "command": PROGRAM + " " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__, "device": result["device"],
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
    }
    return emit(result, as_json=args.json, save=args.save, format_text=format_report)


if __name__ == "__main__":
    raise SystemExit(run_script(main, PROGRAM))
