"""``python -m benchmarks.host_profile``: where one rank's step spends its host time.

Builds the step of ``qsdp bench codec-share`` (:class:`qsdp.bench.codec_share.OneRankStep`: one
rank of 2 x 4 trained in one process by FSDP2 with the comm objects ``quantize_comms`` attaches)
for each preset, runs three warm-up steps, then writes into ``--out``, per preset:

- ``<preset>-syncs.txt``: every host-device synchronization of one step with the stack that made
  it (``torch.cuda.set_sync_debug_mode``; CUDA only);
- ``<preset>-ops.txt``: the torch profiler's operators and ranges of two steps by self CPU time
  and by count (``cudaLaunchKernel`` and ``cuLaunchKernelEx`` count the launches; each comm call
  is a range ``qsdp.comm.<class>``, each collective ``qsdp.wire``);
- ``<preset>-cprofile.txt``: Python's profile of two steps by own and by cumulative time.

On a GPU the step's wall time over its GPU time (``codec-share``'s ``wall_over_step``) says that
the host is late; these files say where. On the CPU the same files describe the reference path.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from qsdp.bench.codec_share import OneRankStep, ShareSpec
from qsdp.bench.one_rank import ranged_comms


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def sync_stacks(state: OneRankStep) -> Counter:
    """The host-device synchronizations of one CUDA step, each with the stack that made it."""
    stacks: Counter = Counter()

    def record(message, *_args, **_kwargs):
        stacks[f"{str(message)[:120]}\n{''.join(traceback.format_stack(limit=14)[:-2])}"] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            state.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    torch.cuda.synchronize()
    return stacks


def profile_preset(spec: ShareSpec, preset: str, out: Path) -> float:
    """Write the three files of ``preset``; returns one step's wall time in ms."""
    with OneRankStep(spec, preset) as state:
        return _profile(state, preset, out)


def _profile(state: OneRankStep, preset: str, out: Path) -> float:
    spec = state.spec
    for _ in range(spec.warmup):
        state.step()
    _sync(spec.device)
    started = time.perf_counter()
    state.step()
    _sync(spec.device)
    wall_ms = (time.perf_counter() - started) * 1e3
    stacks = sync_stacks(state) if spec.device == "cuda" else Counter()
    lines = [f"{sum(stacks.values())} synchronizations in one step, {len(stacks)} distinct"]
    lines += [f"==== x{n}\n{stack}" for stack, n in stacks.most_common(25)]
    (out / f"{preset}-syncs.txt").write_text("\n".join(lines) + "\n")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if spec.device == "cuda" else [])
    with ranged_comms(state.handle), profile(activities=activities) as prof:
        state.step()
        state.step()
        _sync(spec.device)
    table = prof.key_averages()
    (out / f"{preset}-ops.txt").write_text(table.table(sort_by="self_cpu_time_total", row_limit=45)
                                           + table.table(sort_by="count", row_limit=30))
    python = cProfile.Profile()
    python.enable()
    state.step()
    state.step()
    _sync(spec.device)
    python.disable()
    text = io.StringIO()
    stats = pstats.Stats(python, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(70)
    (out / f"{preset}-cprofile.txt").write_text(text.getvalue())
    return wall_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_profile", description=__doc__.split("\n")[0])
    parser.add_argument("presets", nargs="*", default=["sdp4bit", "fsdp"])
    parser.add_argument("--model", default="gpt2-125m")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True, help="folder for the files")
    args = parser.parse_args(argv)
    spec = ShareSpec(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, device=args.device,
                     warmup=3, steps=3)
    spec.validate()
    args.out.mkdir(parents=True, exist_ok=True)
    for preset in args.presets:
        print(f"{preset}: one step {profile_preset(spec, preset, args.out):.1f} ms wall", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
