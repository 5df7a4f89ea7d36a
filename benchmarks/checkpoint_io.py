"""``python -m benchmarks.checkpoint_io``: what a checkpoint's digests cost, at save and at load.

Launches ``--nproc`` local workers (gloo on CPU) holding an FSDP2 model of ``--gb`` gigabytes of
checkpoint (fp32 weights and Adam's two moments: 12 bytes a parameter, in square linear layers
of ``--dim``), then, ``--repeats`` times in turn, on every rank:

- ``save``: DCP's save of the model and optimizer state, through qsdp's
  :class:`~qsdp.train.digest_writer.DigestingWriter` (every file hashed as it is written) and
  :func:`~qsdp.train.integrity.write_digests` (gathered to rank 0, which lists the directory once
  and writes ``digests.json``), against DCP's own ``FileSystemWriter``;
- ``load``: :func:`~qsdp.train.integrity.verify_digests` (every file hashed again, shared by the
  ranks) then DCP's load through qsdp's plain-data reader and planner, against DCP's own load.

Each time is the slowest rank's (a barrier before and after); every other repeat runs the kinds
with digests first. The median over the repeats is reported with ``overhead_pct`` = digests / without - 1. The files are written with fsync (DCP's
default) and read back from the page cache, as a resume soon after a save reads them.

``--json`` prints one JSON object; ``--save FILE`` also writes it with ``meta`` (command, torch
version, date, device, and the machine's 1-minute load average before and after: SHA-256 is CPU
work, so on a machine busy with other processes the digests' share grows).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmarks._cli import run_script

PROG = "python -m benchmarks.checkpoint_io"
__all__ = ["main"]


def _timed(fn: Any) -> float:
    """Seconds ``fn()`` took on the slowest rank."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def _worker(gb: float, dim: int, repeats: int, root: str) -> dict[str, Any] | None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from qsdp.train.digest_writer import DigestingWriter
    from qsdp.train.integrity import verify_digests, write_digests
    from qsdp.train.plain_data import PlainDataLoadPlanner, PlainDataReader

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = max(1, math.ceil(gb * 1e9 / (12 * dim * dim)))
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():  # Adam's moments exist after one step
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    cpu = torch.device("cpu")
    times: dict[str, list[float]] = {k: [] for k in ("save", "save_digests", "load", "load_digests")}
    for r in range(repeats):
        plain, hashed = Path(root) / f"plain{r}", Path(root) / f"digests{r}"

        def save_digests() -> None:
            writer = DigestingWriter(hashed)
            dcp.save(state, storage_writer=writer)
            write_digests(hashed, True, writer.digests)

        def load_digests() -> None:
            verify_digests(hashed, cpu)
            dcp.load(state, storage_reader=PlainDataReader(str(hashed)), planner=PlainDataLoadPlanner())

        runs = [("save", lambda: dcp.save(state, checkpoint_id=str(plain))), ("save_digests", save_digests),
                ("load", lambda: dcp.load(state, checkpoint_id=str(plain))), ("load_digests", load_digests)]
        if r % 2:  # every other repeat with digests first: neither kind always follows the other
            runs = [runs[1], runs[0], runs[3], runs[2]]
        for kind, fn in runs:
            times[kind].append(_timed(fn))
        dist.barrier()
        if rank == 0:
            size = sum(f.stat().st_size for f in plain.iterdir())
            shutil.rmtree(plain)
            shutil.rmtree(hashed)
        dist.barrier()
    dist.destroy_process_group()
    if rank:
        return None
    return {"checkpoint_bytes": size, "layers": layers, "dim": dim, "times_s": times}


def _summary(raw: dict[str, Any]) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in raw["times_s"].items()}
    return {**raw, "median_s": med,
            "overhead_pct": {"save": 100 * (med["save_digests"] / med["save"] - 1),
                             "load": 100 * (med["load_digests"] / med["load"] - 1)}}


def _text(result: dict[str, Any]) -> str:
    m, o = result["median_s"], result["overhead_pct"]
    return (f"checkpoint of {result['checkpoint_bytes'] / 1e9:.2f} GB on {result['nproc']} ranks, median of "
            f"{len(result['times_s']['save'])}:\n"
            f"  save: {m['save']:.2f} s without digests, {m['save_digests']:.2f} s with ({o['save']:+.1f}%)\n"
            f"  load: {m['load']:.2f} s without digests, {m['load_digests']:.2f} s with ({o['load']:+.1f}%)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description="What a checkpoint's digests cost, at save and at load.")
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default 1)")
    p.add_argument("--dim", type=int, default=2048, help="width of the square layers (default 2048)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads of each kind (default 3)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", default=None, metavar="FILE")
    args = p.parse_args(argv)
    if not (0 < args.gb <= 1e3) or args.dim < 1 or args.nproc < 1 or args.repeats < 1:
        p.error("--gb must be in (0, 1000], --dim, --nproc and --repeats positive")
    from qsdp.launch import launch_local
    from qsdp.results import emit, meta

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    root = tempfile.mkdtemp(prefix="qsdp-ckpt-io-", dir=args.dir)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        raw = launch_local(_worker, args.nproc, args.gb, args.dim, args.repeats, root)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {**_summary(raw), "nproc": args.nproc}
    # Other processes on the machine slow both kinds, hashing (CPU) more than fsync (disk).
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result["meta"] = meta("checkpoint_io", list(argv) if argv is not None else sys.argv[1:], "cpu (gloo)",
                          program=PROG, load_average_1min=[load_before, load_after])
    return emit(result, as_json=args.json, save=args.save, format_text=_text)


if __name__ == "__main__":
    sys.exit(run_script(main, PROG))
