"""Checkpoints of a training run with ``torch.distributed.checkpoint`` (DCP).

Layout under the run directory::

    checkpoints/
      step_00000200/          one complete checkpoint (DCP files, trainer.json, comms.json, digests.json)
      step_00000400/
      latest                  text file: the name of the newest complete checkpoint

A checkpoint holds, through DCP, the sharded model and optimizer state (from
``torch.distributed.checkpoint.state_dict.get_state_dict``, so DCP reshards it into any FSDP2
layout of the same model; the optimizer's flattened, keyed by parameter:
:mod:`qsdp.train.parts`), the weight-difference replicas as one tensor per row of each FSDP
group's gathered buffer, keyed by the module's path and the group (a digest of the world size
and the group's global ranks: ``qsdp_replicas.{path}:g{digest}:row{row}``, the path of a rank's
second model part ``part1/{path}``; a row held by several ranks of a group is written once, the
rows of two groups of a dp x tp mesh or of two pipeline stages are kept apart) and, per rank, a
small blob of that rank's comm counters (one state a model part) and RNG state (plain tensors
and numbers, read with ``torch.load(weights_only=True)``). Beside them, written by rank 0:
``trainer.json``, the step and what the run was (model, config, world size, data position,
cumulative bytes on the wire), readable without torch; ``comms.json``, the checkpoint format
(:data:`FORMAT`; another is refused in one line), the layout (world size, shard group size,
HSDP replicas, model parts a rank when more than one) and the comm counters' maximum over every
rank and part, stored once; ``digests.json``, the digest of every other file
(:mod:`qsdp.train.integrity`).

A rank holding several model parts (pipeline stages) passes lists of the parts, their
optimizers and their handles. Every collective of a save or load has the same length on every
rank that takes part: the replicas' agreement runs over each FSDP group's own ranks (its shard
group, then its HSDP replicas), the rest over the world.

A load first checks that every file listed in ``digests.json`` is there with its size, that
the list leaves none out, and the digests of the small files read before the load (the ranks
share the hashing); then loads, hashing each payload as DCP reads it
(:mod:`qsdp.train.digest_reader`) and agreeing on the digests before any loaded value is used,
reading every non-tensor item and DCP's ``.metadata`` as plain data only
(:mod:`qsdp.train.plain_data`: nothing in a checkpoint runs code); then checks that the model
and optimizer state are finite; a damaged checkpoint is one :class:`CheckpointError` naming the
file (or item, or tensor) and the previous complete checkpoint, raised on every rank together
(what a rank checks alone is agreed in one all-reduce first). Any other failure keeps its type.

Loaded into the same layout, everything is restored and the run continues bit for bit (with
other ranks per node too: a rank loads the rows its nodes make it hold); each rank reads its
own blob only. Loaded into another layout (world size, shard group or HSDP replicas), the
replicas of the old one are never used: every weight-difference gather re-establishes its
replica from the loaded weights with exact values. The comm counters (which, with the seed and
the rank, pick every stochastic rounding) continue after the largest value any rank of the old
layout reached (``comms.json``, no rank blob read), so no rank repeats a rounding stream used
before; the RNG state stays the one the job seeded.

A save writes into ``step_XXXXXXXX.tmp``, waits until every rank has finished, renames the
directory and only then replaces ``latest`` (temp file + ``os.replace``). A save interrupted at
any point leaves ``latest`` on the previous complete checkpoint; leftover ``.tmp`` directories
are never read and are removed by the next save. Rotation (``keep``) never removes the newest
checkpoint whose state was finite when saved.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from qsdp.config import config_diff

from .digest_reader import DigestingReader
from .digest_writer import DigestingWriter
from .files import atomic_write, fsync_dir
from .integrity import (
    DIGEST_FILE,
    DigestMismatch,
    NotShared,
    agree_on_digests,
    hashed_while_loading,
    nonfinite_state,
    read_digests,
    state_verified,
    verify_digests,
    write_digests,
)
from .parts import ModelParts, merged
from .plain_data import PlainDataLoadPlanner, PlainDataReader, UnsafeItem, refusal_reason
from .save_items import plain_items, unsavable_item

__all__ = [
    "CheckpointError", "PeerLoadError", "CHECKPOINT_DIR", "LATEST_FILE", "META_FILE", "COMMS_FILE",
    "checkpoint_root", "step_dirname", "latest_checkpoint", "named_checkpoint", "complete_checkpoints",
    "read_meta", "save_checkpoint", "load_checkpoint", "make_latest",
]

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
META_FILE = "trainer.json"
COMMS_FILE = "comms.json"
_REQUIRED = (".metadata", META_FILE, COMMS_FILE, DIGEST_FILE)
_NAMED = _REQUIRED[:2]  # what a run's checks read before the load checks the rest
_STEP_RE = re.compile(r"^step_(\d{8,})$")
# comms.json "format": 2 keys the optimizer state (param_groups included) by parameter, so the
# pipeline stages of a job save theirs side by side, and holds every model part's comm state.
FORMAT = 2


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and the problem."""


def checkpoint_root(out: str | os.PathLike) -> Path:
    return Path(out) / CHECKPOINT_DIR


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def _missing(path: Path, required: tuple[str, ...] = _REQUIRED) -> str | None:
    """The first of the ``required`` files of a checkpoint that ``path`` lacks, or ``None``."""
    return next((name for name in required if not (path / name).is_file()), None)


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every checkpoint under ``root`` (a ``checkpoints/`` directory)
    with all of its files and a state that was finite when saved, oldest first. Its files'
    digests are not read here: :func:`load_checkpoint` checks them."""
    root = Path(root)
    if not root.is_dir():
        return []
    # A link is never a checkpoint of this run: rotation would delete what it points to.
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and not p.is_symlink() and (m := _STEP_RE.match(p.name))]
    return sorted((s, p) for s, p in found if _missing(p) is None and state_verified(p))


def _previous(root: Path, before: int | None) -> str:
    """The end of a message about a checkpoint that cannot be used: the newest complete one
    before step ``before`` (any step: ``None``), and how to resume from it."""
    older = [p for s, p in complete_checkpoints(root) if before is None or s < before]
    if not older:
        return "; no earlier complete checkpoint is left"
    name = older[-1].name
    return f"; the previous complete checkpoint is {name} (qsdp train: --resume-from {name})"


def _step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def _require_complete(path: Path, required: tuple[str, ...] = _REQUIRED) -> Path:
    if path.is_symlink():
        raise CheckpointError(f"checkpoint {path} is a symbolic link: qsdp reads only the run's own checkpoint "
                              f"directories{_previous(path.parent, None)}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist{_previous(path.parent, _step_of(path))}")
    missing = _missing(path, required)
    if missing is not None:
        raise CheckpointError(f"checkpoint {path} is incomplete: {missing} is missing"
                              f"{_previous(path.parent, _step_of(path))}")
    return path


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    """The directory ``checkpoints/latest`` names, or ``None`` if there is no ``latest`` and no
    complete checkpoint.

    Raises CheckpointError if ``latest`` names something that is not a complete checkpoint, and
    if ``latest`` is missing while complete checkpoints are there (naming the newest): a run
    that starts afresh there would rotate them away.
    """
    root = checkpoint_root(out)
    latest = root / LATEST_FILE
    if latest.is_symlink():
        raise CheckpointError(f"{latest} is a symbolic link: qsdp writes it as a file naming a checkpoint of the run "
                              f"and follows no link inside {root}{_previous(root, None)}")
    if not latest.is_file():
        complete = complete_checkpoints(root)
        if complete:
            name = complete[-1][1].name
            raise CheckpointError(f"{latest} is missing, but {root} holds complete checkpoints (newest {name}): "
                                  f"resume from it with --resume-from {name}")
        return None
    name = latest.read_text(encoding="utf-8").strip()
    if not _STEP_RE.match(name):
        # At most a short, escaped excerpt: the file may hold anything.
        raise CheckpointError(f"{latest} names {name[:40]!r}{'...' if len(name) > 40 else ''}, not a checkpoint "
                              "directory (step_XXXXXXXX)"
                              f"{_previous(root, None)}")
    path = root / name
    if not path.is_dir():
        raise CheckpointError(f"{latest} names {name}, which does not exist{_previous(root, _step_of(path))}")
    return _require_complete(path, _NAMED)


def named_checkpoint(out: str | os.PathLike, name: str) -> Path:
    """The complete checkpoint ``name`` (``step_XXXXXXXX``, or a path to one) of the run in
    ``out``; CheckpointError naming the problem otherwise."""
    path = Path(name)
    if len(path.parts) == 1:
        if not _STEP_RE.match(name):
            raise CheckpointError(f"--resume-from {name!r} is not a checkpoint name (step_XXXXXXXX under "
                                  f"{checkpoint_root(out)})")
        path = checkpoint_root(out) / name
    elif not path.is_dir():  # a path elsewhere: the run's own checkpoints are what is left to say
        raise CheckpointError(f"--resume-from {name[:80]!r} is not a checkpoint directory"
                              f"{_previous(checkpoint_root(out), None)}")
    return _require_complete(path, _NAMED)


def make_latest(path: str | os.PathLike) -> None:
    """Make the checkpoint directory ``path`` its run's ``latest`` (atomically; rank 0 only):
    a run resumed from an older checkpoint continues from it after a restart too."""
    path = Path(path)
    atomic_write(path.parent / LATEST_FILE, lambda f: f.write(f"{path.name}\n".encode()))


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``trainer.json`` of a checkpoint directory."""
    return _read_json(Path(path) / META_FILE)


def _read_json(p: Path) -> dict[str, Any]:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {p}: {e}") from None


def _pg_device() -> torch.device:
    """The device the default process group's tensors live on."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def _layout(handles: list[Any]) -> dict[str, Any]:
    """What a rank's comm state and replica rows belong to: the ranks, the shard group whose
    rows the replicas hold, the HSDP replicas and, for several model parts a rank (pipeline
    stages), how many. Not the nodes: a row's replica holds the same values whichever ranks hold
    it (:mod:`qsdp.comm.difference`)."""
    groups = [h.topology.world_size for h in handles]
    replicas = [getattr(h, "replicas", 1) for h in handles]
    layout: dict[str, Any] = {"world_size": dist.get_world_size(),
                              "shard_group": groups[0] if len(set(groups)) == 1 else groups,
                              "replicas": replicas[0] if len(set(replicas)) == 1 else replicas}
    if len(handles) > 1:
        layout["parts"] = len(handles)
    return layout


def _same_everywhere(mine: bool, device: torch.device) -> bool:
    """Collective over the world: whether ``mine`` holds on every rank (one all-reduce)."""
    flag = torch.tensor([int(mine)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _rank_blob(handles: list[Any]) -> bytes:
    """This rank's comm counters (one state a model part) and RNG state, serialized (a few KB
    of plain tensors and numbers: :func:`torch.load` reads it with ``weights_only=True``)."""
    buf = io.BytesIO()
    torch.save({"comms": [h.state_dict(replicas=False) for h in handles], "rng": _rng_state()}, buf)
    return buf.getvalue()


def _unpack(blob: bytes, device: torch.device) -> dict[str, Any]:
    """A rank blob; anything but tensors and plain numbers (a pickle that would run code) is
    refused by ``weights_only=True`` (``pickle.UnpicklingError``)."""
    if not isinstance(blob, bytes):
        raise pickle.UnpicklingError(f"a {type(blob).__name__}, not bytes")
    unpacked = torch.load(io.BytesIO(blob), map_location=device, weights_only=True) if blob else {}
    if not isinstance(unpacked, dict):
        raise pickle.UnpicklingError(f"a {type(unpacked).__name__}, not a dict")
    return unpacked


def _continued_counters(states: list[Any]) -> Any:
    """The comm state that continues every one of ``states`` (of ranks, of model parts) on
    another layout: each counter the largest any of them reached (the next rounding streams are
    new to every rank), each "changed since the last gather" flag set (the next gather starts a
    new version); a group any of them has is kept (stages hold different numbers of groups)."""
    first = states[0]
    if isinstance(first, dict):
        keys = dict.fromkeys(k for s in states if isinstance(s, dict) for k in s)
        return {k: _continued_counters([s[k] for s in states if isinstance(s, dict) and k in s]) for k in keys}
    if isinstance(first, bool):
        return True
    if isinstance(first, int):
        return max(states)
    return first


def _leaves(tree: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _leaves(tree[k], (*path, str(k)))]
    return [(path, tree)]


def _counters_everywhere(handles: list[Any], device: torch.device) -> Any:
    """Collective over the world: the comm state that continues every rank's and every model
    part's (:func:`_continued_counters`), from one all-reduce of the counters where every rank's
    state has the same fields (one small check of fixed length first), else from an all-gather
    of the states (stages with different numbers of groups)."""
    state = _continued_counters([h.state_dict(replicas=False) for h in handles])
    ints = [(p, v) for p, v in _leaves(state) if isinstance(v, int) and not isinstance(v, bool)]
    fields = int.from_bytes(hashlib.sha256(repr([p for p, _ in ints]).encode()).digest()[:7], "big")
    check = torch.tensor([len(ints), -len(ints), fields, -fields], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    most, least, most_fields, least_fields = check.tolist()
    if most != -least or most_fields != -least_fields:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, state)
        return _continued_counters(everyone)
    if ints:
        values = torch.tensor([v for _, v in ints], dtype=torch.int64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        largest = dict(zip([p for p, _ in ints], values.tolist()))
    else:
        largest = {}

    def continued(tree: Any, path: tuple[str, ...] = ()) -> Any:
        if isinstance(tree, dict):
            return {k: continued(v, (*path, str(k))) for k, v in tree.items()}
        return largest.get(path, tree)

    return continued(state)


def _group_id(handle: Any) -> str:
    """A short digest of the world size and the global ranks of the handle's shard group: the
    rows of two groups (the dp groups of a dp x tp mesh, two pipeline stages) never share a key."""
    ranks = dist.get_process_group_ranks(handle.topology.group)
    return hashlib.sha256(f"{dist.get_world_size()}:{ranks}".encode()).hexdigest()[:12]


def _replica_key(path: str, group: str, row: int) -> str:
    return f"{path}:g{group}:row{row}"


def _replica_groups(model: torch.nn.Module, handle: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(module path, all-gather)`` of every FSDP group whose gather keeps replica rows; the
    path of a rank's second and later model parts starts with ``prefix`` (``part1/``...), since
    two parts may have modules of one path (each its root)."""
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    modules = getattr(handle, "modules", [])
    return [(prefix + (names.get(id(modules[i]), f"<group {i}>") if i < len(modules) else f"<group {i}>"), ag)
            for i, ag in enumerate(handle.all_gathers) if ag.holds_replicas()]


def _prefix(k: int) -> str:
    """The key prefix of a rank's model part ``k``: none for the first, so that a rank of one
    part keys its rows as before."""
    return f"part{k}/" if k else ""


def _replica_state(parts: list[torch.nn.Module], handles: list[Any]) -> dict[str, torch.Tensor]:
    """Every weight-difference replica row this rank holds, keyed by model part, module, group
    and row."""
    return {_replica_key(path, _group_id(handle), row): values
            for k, (model, handle) in enumerate(zip(parts, handles))
            for path, ag in _replica_groups(model, handle, _prefix(k))
            for row, values in ag.replica_rows().items()}


def _agreed_found(keys: list[dict[int, str]], stored: dict[str, Any], handle: Any,
                  device: torch.device) -> list[bool]:
    """Per replica-holding FSDP group of ``handle``, whether the checkpoint has every row of it
    on every rank that gathers it: its shard group, and the HSDP replicas of that group, whose
    gathers must stay identical (an all-reduce over each, of one flag a group: the same length
    on every rank that holds the model part)."""
    found = [bool(k) and all(f"qsdp_replicas.{key}" in stored for key in k.values()) for k in keys]
    # On the process group's device: an NCCL group cannot all-reduce a CPU tensor.
    flags = torch.tensor([int(f) for f in found], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=handle.topology.group)
    replicate = getattr(handle, "replicate_group", None)
    if replicate is not None:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=replicate)
    return [bool(f) for f in flags.tolist()]


def _load_replicas(path: Path, stored: dict[str, Any], parts: list[torch.nn.Module], handles: list[Any],
                   device: torch.device) -> None:
    """Load the rows this rank's replicas hold where the checkpoint has every one of them on
    every rank of their group (:func:`_agreed_found`); other groups re-establish theirs exactly."""
    plan = []
    for k, (model, handle) in enumerate(zip(parts, handles)):
        group = _group_id(handle)
        groups = _replica_groups(model, handle, _prefix(k))
        keys = [{row: _replica_key(name, group, row) for row in ag.rows} for name, ag in groups]
        found = _agreed_found(keys, stored, handle, device) if groups else []
        plan += [(ag, k_, ok) for (_, ag), k_, ok in zip(groups, keys, found)]
    wanted: dict[str, torch.Tensor] = {}
    for _, k, ok in plan:
        for key in k.values() if ok else ():
            md = stored[f"qsdp_replicas.{key}"]
            wanted[key] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
    # DCP's load is collective over the world: every rank calls it when any rank has rows to read.
    if not _same_everywhere(not wanted, device):
        _dcp_load({"qsdp_replicas": wanted}, path)
    for ag, k, ok in plan:
        ag.load_replica_rows({row: wanted[key] for row, key in k.items()} if ok else None)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _rotate(root: Path, step: int, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints, never the one of ``step`` nor the newest
    whose state was finite when saved (the one a damaged newer checkpoint falls back to)."""
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name)))
    verified = next((s for s, p in reversed(steps) if _missing(p) is None and state_verified(p)), None)
    for s, p in steps[:-keep]:
        if s not in (step, verified):
            shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(
    out: str | os.PathLike,
    step: int,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    handle: Any,
    meta: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Save a checkpoint of ``step`` (collective: every rank calls it); returns its directory,
    ``out/checkpoints/step_XXXXXXXX``, which :func:`latest_checkpoint` then names.

    ``out`` is the run directory; ``handle`` is the :class:`qsdp.QuantizedComms` of the model.
    A rank holding several model parts (pipeline stages) passes lists of them, of their
    optimizers and of their handles, in one order (:class:`qsdp.train.parts.ModelParts`); the
    stages keep the whole model's parameter names, as torchtitan's do.
    ``meta`` (JSON-able, the same on every rank: what your loop needs back, e.g. its data
    position) is written to ``trainer.json`` with ``step`` added. After the new checkpoint is
    ``latest``, all but the newest ``keep`` checkpoints are removed (``keep <= 0`` keeps all),
    except the newest one whose state was finite when saved.
    """
    job = ModelParts.of(model, optimizer, handle)
    parts, handles = job.parts, job.handles
    rank, device = dist.get_rank(), _pg_device()
    root = checkpoint_root(out)
    name = step_dirname(step)
    final, tmp = root / name, root / (name + ".tmp")
    finite = nonfinite_state(parts, job.optimizers, device) is None
    comms = {"format": FORMAT, "layout": _layout(handles), "continued": _counters_everywhere(handles, device),
             "configs": _configs(handles)}
    model_sds, optim_sds = job.state_dicts()
    state = plain_items({"model": merged(model_sds), "optim": merged(optim_sds),
                         "qsdp_replicas": _replica_state(parts, handles), "rank_state": {str(rank): _rank_blob(handles)}})
    # Before anything is written, on every rank: what this save would write, a load can read.
    problem = _json_problem(meta) or unsavable_item(state)
    _agree(None if problem is None else f"cannot save checkpoint {name}: {problem}", device)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):  # an earlier save that never finished
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    writer = DigestingWriter(tmp)  # hashes each file as it writes it
    dcp.save(state, checkpoint_id=str(tmp), storage_writer=writer)
    if rank == 0:
        _write_json(tmp / META_FILE, {**meta, "step": step})
        _write_json(tmp / COMMS_FILE, comms)
    _agree_metadata_readable(tmp, rank, device)
    # Collective: every rank's files are on disk and hashed before the checkpoint gets its name,
    # and rank 0 sees them all (else every rank raises: a checkpoint rank 0 would name but not hold).
    try:
        write_digests(tmp, finite, writer.digests)
    except NotShared as e:
        shutil.rmtree(tmp, ignore_errors=True)  # this rank's view of it: nothing is left behind
        raise CheckpointError(str(e)) from None
    dist.barrier()
    if rank == 0:
        _publish(tmp, final, step, keep)
    dist.barrier()
    return final


def _json_problem(meta: Any) -> str | None:
    """Why ``meta`` cannot be ``trainer.json`` (naming the first key that is not JSON), or ``None``."""
    if not isinstance(meta, dict):
        return f"meta must be a dict of JSON values, got a {type(meta).__name__}"
    try:
        json.dumps(meta, sort_keys=True, allow_nan=False)
        return None
    except (TypeError, ValueError) as e:
        for key, value in meta.items():
            try:
                json.dumps(value, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as inner:
                return f"meta[{key!r}] is not JSON ({type(value).__module__}.{type(value).__qualname__}: {inner})"
        return f"meta is not JSON ({e})"


def _agree_metadata_readable(tmp: Path, rank: int, device: torch.device) -> None:
    """Collective: rank 0 reads the ``.metadata`` just written back with the restricted reader a
    load uses; one it refuses (a torch whose DCP names classes this qsdp does not know) fails
    the save on every rank, and nothing is left, rather than every later load of the run."""
    problem = None
    if rank == 0:
        try:
            PlainDataReader(str(tmp)).read_metadata()
        except UnsafeItem as e:
            problem = f"cannot save checkpoint {tmp.name[:-len('.tmp')]}: a load could not read it back: {e}"
            shutil.rmtree(tmp, ignore_errors=True)
    _agree(problem, device)


def _publish(tmp: Path, final: Path, step: int, keep: int) -> None:
    """Rank 0, once every rank's files are written and hashed: give the checkpoint its name,
    make it ``latest``, rotate."""
    root = final.parent
    if final.exists():  # a checkpoint of the same step from a run that did not reach `latest`
        old = root / (final.name + ".old.tmp")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(root)
    make_latest(final)
    if keep > 0:
        _rotate(root, step, keep)


def _short(e: BaseException) -> str:
    """One line for a DCP failure (its own message is every rank's traceback)."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (exc, _) = min(e.failures.items())
        detail = str(exc) or "the file is truncated or corrupt"
        return f"rank {rank}: {type(exc).__name__}: {detail}".splitlines()[0]
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _agree(problem: str | None, device: torch.device) -> None:
    """Collective over the world: when any rank found ``problem`` (a checkpoint that cannot be
    used, as that rank sees it), every rank raises one :class:`CheckpointError` with the lowest
    such rank's message (naming the rank where not every rank found the same). One all-reduce
    when no rank found anything: no rank raises while the others wait in a later collective.
    Without a process group (a misuse the load would meet later) the problem is raised as is."""
    if not dist.is_initialized():
        if problem is not None:
            raise CheckpointError(problem)
        return
    flag = torch.tensor([int(problem is not None)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    found = [(r, p) for r, p in enumerate(everyone) if p is not None]
    rank, first = found[0]
    if len(found) < len(everyone) or len({p for _, p in found}) > 1:
        first = f"rank {rank}: {first}"
    raise CheckpointError(first)


def _local_problem(check: Any) -> str | None:
    """``check()``'s :class:`CheckpointError` message, or ``None`` when it passed."""
    try:
        check()
    except CheckpointError as e:
        return str(e)
    return None


def _verify_before_load(path: Path, device: torch.device) -> dict[str, Any]:
    """Collective: ``path`` is a complete checkpoint whose every file is there with the size
    written at save, whose digest list leaves none out, and whose small files (read before the
    load) match their digests; the payloads' digests are checked as DCP reads them
    (:func:`_dcp_load`). Otherwise every rank raises the same :class:`CheckpointError` naming
    the file and the previous complete checkpoint. What a rank checks alone (the files are there,
    the digest list is readable) is agreed before the digests' all-reduce, so a rank that does
    not see the checkpoint (storage not shared) makes every rank raise, none wait for the
    timeout. Returns the digest list."""
    read: list[Any] = []

    def visible() -> None:
        if not (path / META_FILE).exists() and checkpoint_root(path).is_dir():
            raise CheckpointError(f"{path} is a run directory, not a checkpoint: pass "
                                  f"latest_checkpoint({str(path)!r}) (a directory under {checkpoint_root(path)})")
        _require_complete(path)
        try:
            read[:] = [read_digests(path)]
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path / DIGEST_FILE}: {e}"
                                  f"{_previous(path.parent, _step_of(path))}") from None

    _agree(_local_problem(visible), device)
    with _digest_errors(path):
        verify_digests(path, device, during_load=hashed_while_loading(read[0]))
    return read[0]


@contextmanager
def _digest_errors(path: Path) -> Iterator[None]:
    """A :class:`DigestMismatch` as the load reports it: damage is a :class:`CheckpointError`
    naming the file and the previous complete checkpoint; a file that cannot be read is an I/O
    error, not damage (it keeps its kind, a restart retries it)."""
    try:
        yield
    except DigestMismatch as e:
        if e.reason == "cannot be read":
            raise OSError(f"checkpoint {path}: {e}") from None
        raise CheckpointError(f"checkpoint {path} is damaged: {e}{_previous(path.parent, _step_of(path))}") from None


def _read_descriptions(path: Path, device: torch.device,
                       handles: list[Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Collective: ``trainer.json``, ``comms.json`` and DCP's metadata of the (verified)
    checkpoint, each read by every rank; a rank that cannot read one, a format this qsdp does
    not read, comms of another config than ``handles``' or a ``.metadata`` that is not plain
    data makes every rank raise together."""
    read: list[Any] = []

    def describe() -> None:
        meta, comms = read_meta(path), _read_json(path / COMMS_FILE)
        _require_format(path, comms, handles)
        try:
            stored = PlainDataReader(str(path)).read_metadata().state_dict_metadata
        except UnsafeItem as e:
            raise CheckpointError(f"checkpoint {path}: {e}{_previous(path.parent, _step_of(path))}") from None
        except OSError as e:
            raise CheckpointError(f"cannot read {path / '.metadata'}: {e}") from None
        read[:] = [meta, comms, stored]

    _agree(_local_problem(describe), device)
    return read[0], read[1], read[2]


class PeerLoadError(RuntimeError):
    """Raised on the ranks whose own part of a checkpoint load went well when another rank's
    failed for a reason that is not the checkpoint's (an I/O error, out of memory, a bug): a
    consequence; that rank raises its own error, with its type and traceback."""


def _dcp_load(state: dict[str, Any], path: Path, digests: dict[str, Any] | None = None,
              device: torch.device | None = None) -> None:
    """``dcp.load`` reading every non-tensor item and the metadata as plain data only
    (:mod:`qsdp.train.plain_data`), hashing the payloads as it reads them when given the
    checkpoint's ``digests`` (:mod:`qsdp.train.digest_reader`; a ``sha256`` list was verified
    in full before; a later load of the same checkpoint reads files already verified). A
    failure is, on every rank: a :class:`CheckpointError` naming the file when a payload does
    not match its digest (agreed in one all-reduce after the load, failed or not, before any
    loaded value is used; it comes before DCP's own error, which damage may have caused), when
    the checkpoint is at fault (an item that is not plain data) or does not fit the state
    (DCP's planning: a missing key, another shape); otherwise, the failing rank's own error on
    that rank, with its type (an I/O error, out of memory: retried by a restart), and a
    :class:`PeerLoadError` naming it on the others."""
    payloads = hashed_while_loading(digests) if digests is not None else frozenset()
    reader = DigestingReader(str(path), {name: digests["files"][name] for name in payloads} if digests else {})
    failed: CheckpointException | None = None
    try:
        dcp.load(state, storage_reader=reader, planner=PlainDataLoadPlanner())
    except CheckpointException as e:  # raised on every rank: each reaches the agreement below
        failed = e
    if digests is not None and payloads:
        assert device is not None
        with _digest_errors(path):
            agree_on_digests(digests, reader.bad, device)
    if failed is not None:
        _raise_load_failure(failed, path)


def _raise_load_failure(e: CheckpointException, path: Path) -> None:
    """DCP's failure of a load whose files matched their digests, as :func:`_dcp_load` says."""
    failures = sorted(e.failures.items())
    unsafe = [exc for _, (exc, _) in failures if isinstance(exc, UnsafeItem)]
    if unsafe:
        raise CheckpointError(f"checkpoint {path}: {unsafe[0]}{_previous(path.parent, _step_of(path))}") from None
    if e.args and e.args[0] == "plan":
        raise CheckpointError(f"checkpoint {path} does not fit the state loaded into it: {_short(e)}") from None
    own = e.failures.get(dist.get_rank())
    if own is not None:
        error = own[0]
        error.add_note(f"while loading checkpoint {path} (rank {dist.get_rank()})")
        raise error from None
    raise PeerLoadError(f"cannot load checkpoint {path}: {_short(e)}") from None


def _blob_problem(blob: bytes, handles: list[Any], device: torch.device) -> tuple[dict[str, Any], str | None]:
    """This rank's blob unpacked, or why it cannot be used (not plain data, another shape)."""
    try:
        unpacked = _unpack(blob, device)
    except pickle.UnpicklingError as e:
        return {}, f"its rank blob is not plain data ({refusal_reason(e)}); refused: unpickling it could run code"
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except (RuntimeError, ValueError, EOFError) as e:  # in memory: the bytes' own fault
        return {}, f"its rank blob cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    comms, rng = unpacked.get("comms"), unpacked.get("rng")
    if (not isinstance(comms, list) or len(comms) != len(handles) or not isinstance(rng, dict)
            or not isinstance(rng.get("torch"), torch.Tensor) or "python" not in rng):
        return {}, "its rank blob is not one comm state a model part and an RNG state"
    return unpacked, None


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
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
    ``fully_shard`` and ``quantize_comms``, before the first forward. Several model parts a rank
    (pipeline stages): lists of the parts, their optimizers and their handles, as
    :func:`save_checkpoint` took.

    Every file is checked against the digests written at save: its presence and size, and the
    digests of the small files, before DCP reads anything; the payloads' digests as DCP reads
    them, agreed on every rank before this returns or uses any loaded value (a damaged payload
    may leave the model and optimizer partly overwritten: load another checkpoint into them).
    Every non-tensor item (the rank blobs, optimizer ``param_groups`` entries) and DCP's
    metadata are read as plain data only, never by a full unpickler; after the load, the model
    and optimizer state are checked finite. A checkpoint that fails any of these, like a missing
    file, is a :class:`CheckpointError` on every rank naming the file (or item, or tensor) and
    the previous complete checkpoint. Anything else (an I/O error, out of memory, a collective's
    error) keeps its type on the rank where it happened (:class:`PeerLoadError` on the others
    where it happened inside DCP's load).
    """
    path = Path(path)
    job = ModelParts.of(model, optimizer, handle)
    parts, handles = job.parts, job.handles
    digests = _verify_before_load(path, device)
    meta, comms, stored = _read_descriptions(path, device, handles)
    rank = dist.get_rank()
    keys = job.state_dicts()
    state: dict[str, Any] = {"model": merged(keys[0]), "optim": merged(keys[1])}
    # Only this rank's own blob, and only where every rank's counters and RNG continue as
    # they were (agreed: the replicas' groups must all load, or all re-establish).
    own = _same_everywhere(comms.get("layout") == _layout(handles) and f"rank_state.{rank}" in stored, device)
    if own:
        state["rank_state"] = {str(rank): b""}
    _dcp_load(state, path, digests, device)
    job.load_state_dicts(state["model"], state["optim"], keys)
    where = nonfinite_state(parts, job.optimizers, device)
    if where is not None:
        raise CheckpointError(f"checkpoint {path} holds non-finite values ({where})"
                              f"{_previous(path.parent, _step_of(path))}")
    if own:
        blob, problem = _blob_problem(state["rank_state"][str(rank)], handles, device)
        _agree(problem and f"checkpoint {path}: {problem}{_previous(path.parent, _step_of(path))}", device)
        for h, comm_state in zip(handles, blob["comms"], strict=True):
            h.load_state_dict(comm_state)  # after the parameters: see its doc
        _set_rng_state(blob["rng"])
        _load_replicas(path, stored, parts, handles, device)
    else:
        _continue_on_another_layout(comms.get("continued"), handles)
    return meta


def _configs(handles: list[Any]) -> list[dict[str, Any]]:
    """Each model part's comm config, without what a resume may change (the ranks per node)
    or what does not change the comms (the name)."""
    return [{k: v for k, v in h.config.to_dict().items() if k not in ("local_world_size", "name")} for h in handles]


def _require_config(path: Path, comms: dict[str, Any], handles: list[Any]) -> None:
    """The comms loading a checkpoint must run the config that saved it (their state and
    replicas belong to it): one :class:`CheckpointError` naming the fields that differ. A
    checkpoint that does not record its config is not checked."""
    saved = comms.get("configs")
    if saved is None or len(saved) != len(handles):
        return
    for theirs, mine in zip(saved, _configs(handles)):
        diff = config_diff(theirs, mine)
        if diff:
            fields = ", ".join(f"{k}: checkpoint {a!r} != now {b!r}" for k, a, b in diff[:4])
            raise CheckpointError(f"checkpoint {path} was saved by comms of another config ({fields}); "
                                  "quantize_comms with the config that saved it before loading")


def _require_format(path: Path, comms: dict[str, Any], handles: list[Any]) -> None:
    """A checkpoint of another format is one :class:`CheckpointError` (every rank reads the same
    ``comms.json``), never a load that reads its keys another way; so is one saved by comms of
    another config (:func:`_require_config`)."""
    found = comms.get("format", 1)
    if found != FORMAT:
        raise CheckpointError(f"checkpoint {path} is in checkpoint format {found}, this qsdp reads format {FORMAT} "
                              "(optimizer state keyed by parameter): resume it with the qsdp that wrote it")
    _require_config(path, comms, handles)


def _continue_on_another_layout(continued: Any, handles: list[Any]) -> None:
    """The comm state after a load into another layout: counters past every old rank's and
    model part's (their maximum, stored once in ``comms.json``), replicas re-established exactly
    at the next gather."""
    for handle in handles:
        if continued:
            handle.load_state_dict(continued)
        handle.reset_replicas()
        for ag in handle.all_gathers:
            if ag.holds_replicas():
                ag.load_replica_rows(None)
