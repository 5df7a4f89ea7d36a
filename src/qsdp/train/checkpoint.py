"""Checkpoints of a training run with ``torch.distributed.checkpoint`` (DCP).

Layout under the run directory::

    checkpoints/
      step_00000200/          one complete checkpoint (DCP files + trainer.json)
      step_00000400/
      latest                  text file: the name of the newest complete checkpoint

A checkpoint holds, through DCP, the sharded model and optimizer state (from
``torch.distributed.checkpoint.state_dict.get_state_dict``, so DCP reshards it into any FSDP2
layout of the same model), the weight-difference replicas as one tensor per row of each group's
gathered buffer (``qsdp_replicas.ag{group}_w{world}_row{row}``: a row held by several ranks is
written once) and, per rank, a small blob of that rank's comm counters, RNG state and the layout
(world size, shard group size, HSDP replicas); ``trainer.json`` holds the step and what the
run was (model, config, world size, data position, cumulative bytes on the wire), readable
without torch.

Loaded into the same layout, everything is restored and the run continues bit for bit (with
other ranks per node too: a rank loads the rows its nodes make it hold). Loaded into another
layout (world size, shard group or HSDP replicas), the replicas of the old one are never used:
every weight-difference gather re-establishes its replica from the loaded weights with exact
values. The comm counters (which, with the seed and the rank, pick every stochastic rounding)
continue after the largest value any rank of the old layout reached, so no rank repeats a
rounding stream used before; the RNG state stays the one the job seeded.

A save writes into ``step_XXXXXXXX.tmp``, waits until every rank has finished, renames the
directory and only then replaces ``latest`` (temp file + ``os.replace``). A save interrupted at
any point leaves ``latest`` on the previous complete checkpoint; leftover ``.tmp`` directories
are never read and are removed by the next save.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .files import atomic_write, fsync_dir

__all__ = [
    "CheckpointError", "CHECKPOINT_DIR", "LATEST_FILE", "META_FILE",
    "checkpoint_root", "step_dirname", "latest_checkpoint", "read_meta",
    "save_checkpoint", "load_checkpoint",
]

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
META_FILE = "trainer.json"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and the problem."""


def checkpoint_root(out: str | os.PathLike) -> Path:
    return Path(out) / CHECKPOINT_DIR


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    """The directory ``checkpoints/latest`` names, or ``None`` if there is no ``latest``.

    Raises CheckpointError if ``latest`` names something that is not a complete checkpoint.
    """
    root = checkpoint_root(out)
    latest = root / LATEST_FILE
    if not latest.is_file():
        return None
    name = latest.read_text(encoding="utf-8").strip()
    if not _STEP_RE.match(name):
        raise CheckpointError(f"{latest} names {name!r}, not a checkpoint directory (step_XXXXXXXX)")
    path = root / name
    for required in (".metadata", META_FILE):
        if not (path / required).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {required} is missing")
    return path


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``trainer.json`` of a checkpoint directory."""
    p = Path(path) / META_FILE
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {p}: {e}") from None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def _layout(handle: Any) -> dict[str, int]:
    """What a rank's comm state and replica rows belong to (the same on every rank): the ranks
    and the shard group whose rows the replicas hold. Not the nodes: a row's replica holds the
    same values whichever ranks hold it (:mod:`qsdp.comm.difference`)."""
    return {"world_size": dist.get_world_size(), "shard_group": handle.topology.world_size,
            "replicas": getattr(handle, "replicas", 1)}


def _same_layout(stored: dict[str, Any], handle: Any) -> bool:
    """Whether a rank blob was written by this layout (a blob without one: by the world size)."""
    if "layout" in stored:
        return stored["layout"] == _layout(handle)
    return stored.get("world_size") == dist.get_world_size()


def _rank_blob(handle: Any) -> bytes:
    """This rank's comm counters, RNG state and layout, serialized (a few KB)."""
    buf = io.BytesIO()
    torch.save({"comms": handle.state_dict(), "rng": _rng_state(), "world_size": dist.get_world_size(),
                "layout": _layout(handle)}, buf)
    return buf.getvalue()


def _continued_counters(states: list[Any]) -> Any:
    """The comm state that continues every rank's of ``states`` on another layout: each counter
    the largest any rank reached (the next rounding streams are new to every rank), each
    "changed since the last gather" flag set (the next gather starts a new version)."""
    first = states[0]
    if isinstance(first, dict):
        return {k: _continued_counters([s[k] for s in states if k in s]) for k in first}
    if isinstance(first, bool):
        return True
    if isinstance(first, int):
        return max(states)
    return first


def _replica_key(group: int, world: int, row: int) -> str:
    return f"ag{group}_w{world}_row{row}"


def _replica_state(handle: Any) -> dict[str, torch.Tensor]:
    """Every weight-difference replica row this rank holds, keyed by group and row."""
    world = dist.get_world_size()
    return {
        _replica_key(i, world, row): values
        for i, ag in enumerate(handle.all_gathers) if ag.holds_replicas()
        for row, values in ag.replica_rows().items()
    }


def _load_replicas(path: Path, stored: dict[str, Any], handle: Any, device: torch.device) -> None:
    """Load the rows this rank's replicas hold where the checkpoint has every one of them on
    every rank (one all-reduce agrees on it); other groups re-establish theirs exactly."""
    world = dist.get_world_size()
    groups = [(i, ag) for i, ag in enumerate(handle.all_gathers) if ag.holds_replicas()]
    keys = {i: {row: _replica_key(i, world, row) for row in ag.rows} for i, ag in groups}
    found = [bool(keys[i]) and all(f"qsdp_replicas.{k}" in stored for k in keys[i].values()) for i, _ in groups]
    # On the process group's device: an NCCL group cannot all-reduce a CPU tensor.
    everywhere = torch.tensor([int(f) for f in found] or [0], dtype=torch.int32, device=device)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    wanted: dict[str, torch.Tensor] = {}
    for (i, _), ok in zip(groups, everywhere.tolist()):
        for k in keys[i].values() if ok else ():
            md = stored[f"qsdp_replicas.{k}"]
            wanted[k] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
    if wanted:
        dcp.load({"qsdp_replicas": wanted}, checkpoint_id=str(path))
    for (i, ag), ok in zip(groups, everywhere.tolist()):
        ag.load_replica_rows({row: wanted[k] for row, k in keys[i].items()} if ok else None)



def save_checkpoint(
    out: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    handle: Any,
    meta: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Save a checkpoint of ``step`` (collective: every rank calls it); returns its directory,
    ``out/checkpoints/step_XXXXXXXX``, which :func:`latest_checkpoint` then names.

    ``out`` is the run directory; ``handle`` is the :class:`qsdp.QuantizedComms` of the model;
    ``meta`` (JSON-able, the same on every rank: what your loop needs back, e.g. its data
    position) is written to ``trainer.json`` with ``step`` added. After the new checkpoint is
    ``latest``, all but the newest ``keep`` checkpoints are removed (``keep <= 0`` keeps all).
    """
    rank = dist.get_rank()
    root = checkpoint_root(out)
    name = step_dirname(step)
    final, tmp = root / name, root / (name + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):  # an earlier save that never finished
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "qsdp_replicas": _replica_state(handle),
             "rank_state": {str(rank): _rank_blob(handle)}}
    dcp.save(state, checkpoint_id=str(tmp))
    if rank == 0:
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            json.dump({**meta, "step": step}, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
    # Every rank's shards are on disk before the checkpoint gets its final name.
    dist.barrier()
    if rank == 0:
        if final.exists():  # a checkpoint of the same step from a run that did not reach `latest`
            old = root / (name + ".old.tmp")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(root)
        atomic_write(root / LATEST_FILE, lambda f: f.write(f"{name}\n".encode()))
        if keep > 0:
            steps = sorted(
                (int(m.group(1)), p) for p in root.iterdir()
                if p.is_dir() and (m := _STEP_RE.match(p.name))
            )
            for s, p in steps[:-keep]:
                if s != step:
                    shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


def _short(e: BaseException) -> str:
    """One line for a DCP failure (its own message is every rank's traceback)."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (exc, _) = min(e.failures.items())
        detail = str(exc) or "the file is truncated or corrupt"
        return f"rank {rank}: {type(exc).__name__}: {detail}".splitlines()[0]
    return f"{type(e).__name__}: {e}".splitlines()[0]


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    handle: Any,
    device: torch.device,
) -> dict[str, Any]:
    """Load the checkpoint in ``path`` into ``model``, ``optimizer``, the comm state of
    ``handle`` and the RNGs (collective); returns its ``trainer.json`` dict: the ``meta`` given to
    :func:`save_checkpoint` plus ``step``.

    ``path`` is one checkpoint's directory (``latest_checkpoint(out)``, or any
    ``out/checkpoints/step_XXXXXXXX``), not the run directory ``out``. ``device`` is where this
    rank's comm state and weight-difference replicas go, the device of the process group's
    tensors: ``cpu`` with gloo, this rank's ``cuda`` device with NCCL. Call it after
    ``fully_shard`` and ``quantize_comms``, before the first forward.
    """
    path = Path(path)
    if not (path / META_FILE).exists() and checkpoint_root(path).is_dir():
        raise CheckpointError(f"{path} is a run directory, not a checkpoint: pass latest_checkpoint({str(path)!r}) "
                              f"(a directory under {checkpoint_root(path)})")
    meta = read_meta(path)
    rank = dist.get_rank()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    try:
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        old_ranks = sorted(int(k.split(".", 1)[1]) for k in stored if k.startswith("rank_state."))
        # Rank 0's blob says the checkpoint's layout to every rank alike; this rank's own, if
        # the layout is the same, its counters and RNG.
        state["rank_state"] = {str(r): b"" for r in {0, rank} if r in old_ranks}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        blobs = {int(r): _unpack(b, device) for r, b in state["rank_state"].items()}
        if 0 in blobs and _same_layout(blobs[0], handle) and rank in blobs:
            handle.load_state_dict(blobs[rank]["comms"])  # after the parameters: see its doc
            _set_rng_state(blobs[rank]["rng"])
            _load_replicas(path, stored, handle, device)
        else:
            _continue_on_another_layout(path, old_ranks, handle, device)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        raise CheckpointError(f"cannot load checkpoint {path}: {_short(e)}") from None
    return meta


def _unpack(blob: bytes, device: torch.device) -> dict[str, Any]:
    return torch.load(io.BytesIO(blob), map_location=device, weights_only=False) if blob else {}


def _continue_on_another_layout(path: Path, old_ranks: list[int], handle: Any, device: torch.device) -> None:
    """The comm state after a load into another layout: counters past every old rank's (all
    of their blobs read, a few KB each), replicas re-established exactly at the next gather."""
    if old_ranks:
        blobs: dict[str, Any] = {"rank_state": {str(r): b"" for r in old_ranks}}
        dcp.load(blobs, checkpoint_id=str(path))
        states = [_unpack(b, device).get("comms") for b in blobs["rank_state"].values()]
        states = [s for s in states if s]
        if states:
            handle.load_state_dict(_continued_counters(states))
    handle.reset_replicas()
    for ag in handle.all_gathers:
        if ag.holds_replicas():
            ag.load_replica_rows(None)
