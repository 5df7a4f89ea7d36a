"""``python -m benchmarks.checkpoint_io``: what a checkpoint's digests cost, at save and at load.

Launches ``--nproc`` local workers (gloo on CPU) holding an FSDP2 model of ``--gb`` gigabytes of
checkpoint (fp32 weights and Adam's two moments: 12 bytes a parameter, in square linear layers
of ``--dim``), then, ``--repeats`` times in turn, on every rank:

- ``save``: DCP's save of the model and optimizer state, through qsdp's
  :class:`~qsdp.train.digest_writer.DigestingWriter` (every file hashed as it is written) and
  :func:`~qsdp.train.integrity.write_digests` (gathered to rank 0, which lists the directory once
  and writes ``digests.json``), against DCP's own ``FileSystemWriter``. The digesting writer
  hands DCP's bytes to the OS in 1 MiB pieces, hashing each right after it is written;
  ``save_pieces``, DCP's writer cutting its writes the same way without hashing, isolates what
  the hash costs (``overhead_pct["save_vs_pieces"]``) from what the cut does to the writes;
- ``load``: what :func:`~qsdp.train.checkpoint.load_checkpoint` does:
  :func:`~qsdp.train.integrity.verify_digests` (sizes, unlisted files, the digest of every file
  but the payloads), DCP's load through :class:`~qsdp.train.digest_reader.DigestingReader`
  (each payload hashed as DCP reads it, with qsdp's plain-data planner) and
  :func:`~qsdp.train.integrity.agree_on_digests`, against the same load without digests: DCP's
  load through the reader the digesting one extends
  (:class:`~qsdp.train.plain_data.PlainDataReader`, with the same planner; named by
  ``load_without_digests`` in the result). ``load_dcp``, DCP's
  own reader and planner, shows what reading the checkpoint as plain data costs apart from the
  digests (``plain_data_pct``).

``--algorithm sha256`` measures the digests qsdp wrote before ``xxh3-128-64k`` (SHA-256 of each
file as it is written; at load, every file hashed before DCP reads it).

Each time is the slowest rank's (a barrier before and after). In each repeat each kind saves,
loads and deletes its checkpoint before the next kind saves (a save that finds another
checkpoint still in the page cache takes more CPU time); the kinds take turns going first, and
``load`` and ``load_dcp`` change order every repeat. The median over the repeats is reported
with ``overhead_pct`` = digests / without - 1; ``cpu_s`` / ``cpu_overhead_pct`` do the same with
the CPU seconds of every rank's process (all its threads) summed: on a machine shared with other
work, wall times swing with the others' load, the CPU time the digests add much less. The files
are written with fsync (DCP's default) and read back from the page cache, as a resume soon after
a save reads them. ``--cold`` (root only) adds ``load_cold`` and ``load_digests_cold``: the same
two loads once the kernel has dropped its page cache (all of it, the machine's: there is no
other way to empty it of one file for certain), reading the checkpoint from storage as a resume
on another machine, or long after the save, does; each kind's first load after its save.
``load_phases``: the load with digests in its three parts, on each rank
(medians over the repeats of the slowest rank's wall time and of the CPU seconds of all ranks):
``verify`` (``digests.json`` read, :func:`~qsdp.train.integrity.verify_digests`), ``read``
(DCP's load, the payloads hashed as they are read, the blocks no read held whole read again) and
``agree`` (:func:`~qsdp.train.integrity.agree_on_digests`). Also reported: ``reread_pct``, the
share of the payloads the load read again apart from DCP's reads (blocks no read held whole),
and ``hash_gb_per_s``, one core's speed of each hash over 256 MiB in memory on this machine, and
``hash_in_cache_gb_per_s``, one core's speed of ``xxh3-128-64k`` as a load hashes (each piece of
a read right after it arrives, in the cache); ``hash_share_pct`` turns both into what one hash
of every byte adds to the load's CPU time, in cache and from memory: where the load's
``cpu_overhead_pct`` lies between them says how much of the hashing runs at memory speed.

``--json`` prints one JSON object; ``--save FILE`` also writes it with ``meta`` (command, torch
version, date, device, and the machine's 1-minute load average before and after: hashing is CPU
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from benchmarks._cli import run_script
from qsdp.train.digest_writer import PIECE, write_in_pieces

PROG = "python -m benchmarks.checkpoint_io"
__all__ = ["main"]
_PHASES = ("verify", "read", "agree")  # the parts of a load with digests, timed on each rank
# What the load without digests runs: the reader the digesting one extends, and the same planner.
_WITHOUT = "PlainDataReader, PlainDataLoadPlanner"


class _PieceStream:
    """A stream DCP writes through, writing what it is given in the pieces the digesting writer
    writes, hashing nothing."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def write(self, data: Any) -> int:
        return write_in_pieces(self.raw, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class _PieceFileSystem(FileSystem):
    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            yield _PieceStream(raw) if "w" in mode else raw


def _piece_writer(path: Path) -> FileSystemWriter:
    """DCP's writer writing in :data:`~qsdp.train.digest_writer.PIECE`-byte pieces, without
    digests: what the digests cost at save apart from the way the writes are cut."""
    writer = FileSystemWriter(path)
    writer.fs = _PieceFileSystem()
    return writer


def _timed(fn: Any) -> tuple[float, float]:
    """Seconds ``fn()`` took on the slowest rank, and the CPU seconds it took on all ranks (every
    thread of each rank's process: the hashing threads too)."""
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    used = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(used)
    return float(wall.item()), float(used.item())


_DROP_CACHES = "/proc/sys/vm/drop_caches"


def _drop_page_cache() -> None:
    """Collective: rank 0 has the kernel drop every clean page of its page cache (the machine's,
    every process's: ``--cold`` only), so that the next load reads the checkpoint from storage,
    as a resume on a machine that did not write it, or long after, does."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.sync()
        with open(_DROP_CACHES, "w") as f:
            f.write("1")
    dist.barrier()


def _hash_speeds(nbytes: int = 256 << 20) -> dict[str, float]:
    """GB/s of each hash over ``nbytes`` in memory, fed in 1 MiB pieces, on one core (best of 3)."""
    import hashlib
    import zlib

    from qsdp.train.integrity import new_hasher

    data = memoryview(os.urandom(1 << 20) * (nbytes >> 20))
    kinds: dict[str, Any] = {
        "sha256": lambda: hashlib.sha256(), "blake2b": lambda: hashlib.blake2b(),
        "xxh3-128-64k": lambda: new_hasher("xxh3-128-64k"),
    }
    speeds = {}
    for name, make in kinds.items():
        best = math.inf
        for _ in range(3):
            start, h = time.perf_counter(), make()
            for i in range(0, nbytes, 1 << 20):
                h.update(data[i:i + (1 << 20)])
            h.hexdigest()
            best = min(best, time.perf_counter() - start)
        speeds[name] = nbytes / best / 1e9
    best = math.inf
    for _ in range(3):  # zlib's CRC-32, for comparison (32 bits: a weaker check)
        start, crc = time.perf_counter(), 0
        for i in range(0, nbytes, 1 << 20):
            crc = zlib.crc32(data[i:i + (1 << 20)], crc)
        best = min(best, time.perf_counter() - start)
    speeds["crc32"] = nbytes / best / 1e9
    return speeds


def _in_cache_speed(nbytes: int = 256 << 20) -> float:
    """GB/s of ``xxh3-128-64k`` as a load hashes: one piece of a read (a slice of
    :mod:`qsdp.train.digest_reader`) fed to a :class:`~qsdp.train.block_digest.BlockDigest` at a
    time, still in the CPU's cache; the same buffer at every offset of an ``nbytes`` file (best of 3)."""
    from qsdp.train import digest_reader
    from qsdp.train.block_digest import BlockDigest

    piece = memoryview(os.urandom(digest_reader._SLICE))
    best = math.inf
    for _ in range(3):
        start, digest = time.perf_counter(), BlockDigest(nbytes)
        for offset in range(0, nbytes, piece.nbytes):
            digest.feed(offset, piece)
        digest.hexdigest()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _worker(gb: float, dim: int, repeats: int, root: str, algorithm: str, cold: bool) -> dict[str, Any] | None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from qsdp.train.digest_reader import DigestingReader
    from qsdp.train.digest_writer import DigestingWriter
    from qsdp.train.integrity import agree_on_digests, hashed_while_loading, read_digests, verify_digests, write_digests
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
    kinds = ["save", "save_digests", "save_pieces", "load", "load_digests", "load_dcp"]
    times: dict[str, list[float]] = {k: [] for k in kinds + (["load_cold", "load_digests_cold"] if cold else [])}
    cpu_times: dict[str, list[float]] = {k: [] for k in times}
    reread = torch.zeros(2, dtype=torch.float64)  # payload bytes read again, payload bytes
    # Each repeat's load with digests, on this rank: wall and CPU seconds of verify, read, agree.
    phases = torch.zeros(repeats, 2, len(_PHASES), dtype=torch.float64)
    size = 0  # bytes of a checkpoint, measured on rank 0
    for r in range(repeats):
        plain, hashed, pieces = (Path(root) / f"{kind}{r}" for kind in ("plain", "digests", "pieces"))

        def save_digests() -> None:
            writer = DigestingWriter(hashed, algorithm=algorithm)
            dcp.save(state, storage_writer=writer)
            write_digests(hashed, True, writer.digests, algorithm)

        def load_digests(r: int = r, record: bool = True) -> None:
            marks = [(time.perf_counter(), time.process_time())]
            digests = read_digests(hashed)
            during = hashed_while_loading(digests)
            verify_digests(hashed, cpu, during_load=during)
            marks.append((time.perf_counter(), time.process_time()))
            reader = DigestingReader(str(hashed), {name: digests["files"][name] for name in during})
            dcp.load(state, storage_reader=reader, planner=PlainDataLoadPlanner())
            marks.append((time.perf_counter(), time.process_time()))
            agree_on_digests(digests, reader.bad, cpu)
            marks.append((time.perf_counter(), time.process_time()))
            if not record:
                return
            for i in range(len(_PHASES)):
                phases[r, 0, i] = marks[i + 1][0] - marks[i][0]
                phases[r, 1, i] = marks[i + 1][1] - marks[i][1]
            reread[0] += reader.reread
            reread[1] += sum(digests["files"][name]["bytes"] for name in reader.owned)

        def load() -> None:  # the same reader and planner, no digests
            dcp.load(state, storage_reader=PlainDataReader(str(plain)), planner=PlainDataLoadPlanner())

        # Each kind saves, loads and deletes its checkpoint before the next kind saves: a save
        # that found another's gigabyte still in the page cache took up to 0.4 s more CPU time.
        without = [("save", lambda: dcp.save(state, checkpoint_id=str(plain))), ("load", load),
                   ("load_dcp", lambda: dcp.load(state, checkpoint_id=str(plain)))]
        without = without if r % 2 == 0 else [without[0], without[2], without[1]]
        with_digests = [("save_digests", save_digests), ("load_digests", load_digests)]
        if cold:  # right after the save, at the same distance from it for both kinds; it fills the cache again
            without.insert(1, ("load_cold", load))
            with_digests.insert(1, ("load_digests_cold", lambda: load_digests(record=False)))
        blocks = [(without, plain), (with_digests, hashed),
                  ([("save_pieces", lambda: dcp.save(state, storage_writer=_piece_writer(pieces)))], pieces)]
        for runs, directory in blocks[r % 3:] + blocks[:r % 3]:  # each kind first in every third repeat
            for kind, fn in runs:
                if kind.endswith("_cold"):
                    _drop_page_cache()
                wall, cpu_s = _timed(fn)
                times[kind].append(wall)
                cpu_times[kind].append(cpu_s)
            dist.barrier()
            if rank == 0:
                if directory == plain:
                    size = sum(f.stat().st_size for f in plain.iterdir())
                shutil.rmtree(directory)
            dist.barrier()
    dist.all_reduce(reread)
    walls, cpus = phases[:, 0].clone(), phases[:, 1].clone()
    dist.all_reduce(walls, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpus)
    dist.destroy_process_group()
    if rank:
        return None
    return {"checkpoint_bytes": size, "layers": layers, "dim": dim, "algorithm": algorithm,
            "load_without_digests": _WITHOUT,
            "reread_pct": 100 * float(reread[0] / reread[1]) if reread[1] else 0.0, "times_s": times,
            "cpu_s": cpu_times,
            "load_phases_s": {name: {"wall": walls[:, i].tolist(), "cpu": cpus[:, i].tolist()}
                              for i, name in enumerate(_PHASES)}}


def _overhead(med: dict[str, float]) -> dict[str, float]:
    pairs = {"save": ("save_digests", "save"), "save_vs_pieces": ("save_digests", "save_pieces"),
             "load": ("load_digests", "load"), "load_cold": ("load_digests_cold", "load_cold")}
    return {name: 100 * (med[digests] / med[without] - 1) for name, (digests, without) in pairs.items()
            if without in med}


def _summary(raw: dict[str, Any]) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in raw["times_s"].items()}
    cpu = {k: statistics.median(v) for k, v in raw["cpu_s"].items()}
    return {**raw, "median_s": med, "overhead_pct": _overhead(med),
            "median_cpu_s": cpu, "cpu_overhead_pct": _overhead(cpu),
            "plain_data_pct": {"wall": 100 * (med["load"] / med["load_dcp"] - 1),
                               "cpu": 100 * (cpu["load"] / cpu["load_dcp"] - 1)},
            "load_phases": {name: {k: statistics.median(v) for k, v in kinds.items()}
                            for name, kinds in raw["load_phases_s"].items()}}


def _hash_share(result: dict[str, Any]) -> dict[str, float]:
    """What hashing every byte of the checkpoint once costs, in CPU seconds, as a share of the
    load's without digests: at the in-cache speed and at the speed over memory. The load's
    measured ``cpu_overhead_pct`` against these two says where its hashing runs."""
    load_cpu, nbytes = result["median_cpu_s"]["load"], result["checkpoint_bytes"]
    speeds = {"in_cache": result["hash_in_cache_gb_per_s"], "from_memory": result["hash_gb_per_s"]["xxh3-128-64k"]}
    return {k: 100 * nbytes / (v * 1e9) / load_cpu for k, v in speeds.items()}


def _text(result: dict[str, Any]) -> str:
    m, o, c = result["median_s"], result["overhead_pct"], result["cpu_overhead_pct"]
    speeds = ", ".join(f"{k} {v:.2f}" for k, v in result["hash_gb_per_s"].items())
    share, plain = result["hash_share_pct"], result["plain_data_pct"]
    phases = ", ".join(f"{k} {v['wall'] * 1e3:.1f} ms (CPU {v['cpu'] * 1e3:.1f} ms)"
                       for k, v in result["load_phases"].items())
    return (f"checkpoint of {result['checkpoint_bytes'] / 1e9:.2f} GB on {result['nproc']} ranks, "
            f"{result['algorithm']} digests, median of {len(result['times_s']['save'])}:\n"
            f"  save: {m['save']:.2f} s without digests, {m['save_digests']:.2f} s with ({o['save']:+.1f}%; "
            f"CPU time {c['save']:+.1f}%)\n"
            f"  save through DCP's writer in the same {PIECE >> 20} MiB pieces, not hashed: {m['save_pieces']:.2f} s "
            f"(the hash adds {o['save_vs_pieces']:+.1f}%; CPU time {c['save_vs_pieces']:+.1f}%)\n"
            f"  load: {m['load']:.2f} s without digests, {m['load_digests']:.2f} s with ({o['load']:+.1f}%; "
            f"CPU time {c['load']:+.1f}%; {result['reread_pct']:.1f}% of the payloads read again)\n"
            + (f"  load from storage (page cache dropped before each): {m['load_cold']:.2f} s without digests, "
               f"{m['load_digests_cold']:.2f} s with ({o['load_cold']:+.1f}%; CPU time {c['load_cold']:+.1f}%)\n"
               if "load_cold" in m else "")
            + f"  load with digests, slowest rank (CPU of all ranks): {phases}\n"
            f"  DCP's own reader and planner: {m['load_dcp']:.2f} s (the plain-data reading costs "
            f"{plain['wall']:+.1f}%; CPU time {plain['cpu']:+.1f}%)\n"
            f"  one core hashes (GB/s): {speeds}; xxh3-128-64k as a load hashes, in cache: "
            f"{result['hash_in_cache_gb_per_s']:.1f}\n"
            f"  hashing every byte once would add {share['in_cache']:.1f}% to the load's CPU time in cache, "
            f"{share['from_memory']:.1f}% from memory")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description="What a checkpoint's digests cost, at save and at load.")
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default 1)")
    p.add_argument("--dim", type=int, default=2048, help="width of the square layers (default 2048)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads of each kind (default 3)")
    p.add_argument("--algorithm", choices=["xxh3-128-64k", "sha256"], default="xxh3-128-64k",
                   help="the digests measured (default xxh3-128-64k, what a save writes; sha256: qsdp's before it)")
    p.add_argument("--cold", action="store_true",
                   help="also load from storage: the machine's page cache dropped before each such load "
                        f"(writes {_DROP_CACHES}: needs root, and slows every other process's next reads)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", default=None, metavar="FILE")
    args = p.parse_args(argv)
    if not (0 < args.gb <= 1e3) or args.dim < 1 or args.nproc < 1 or args.repeats < 1:
        p.error("--gb must be in (0, 1000], --dim, --nproc and --repeats positive")
    if args.cold and not os.access(_DROP_CACHES, os.W_OK):
        p.error(f"--cold drops the page cache through {_DROP_CACHES}, which this user cannot write (it needs root)")
    from qsdp.launch import launch_local
    from qsdp.results import emit, meta

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    root = tempfile.mkdtemp(prefix="qsdp-ckpt-io-", dir=args.dir)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        raw = launch_local(_worker, args.nproc, args.gb, args.dim, args.repeats, root, args.algorithm, args.cold)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {**_summary(raw), "nproc": args.nproc, "hash_gb_per_s": _hash_speeds(),
              "hash_in_cache_gb_per_s": _in_cache_speed()}
    result["hash_share_pct"] = _hash_share(result)
    # Other processes on the machine slow both kinds, hashing (CPU) more than fsync (disk).
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result["meta"] = meta("checkpoint_io", list(argv) if argv is not None else sys.argv[1:], "cpu (gloo)",
                          program=PROG, load_average_1min=[load_before, load_after])
    return emit(result, as_json=args.json, save=args.save, format_text=_text)


if __name__ == "__main__":
    sys.exit(run_script(main, PROG))
