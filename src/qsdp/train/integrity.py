"""What makes a checkpoint trustworthy before it is used: a digest of every file, written when
the save is complete and checked before any loaded value is used, and a check that the model and
optimizer state are finite.

``digests.json`` (in the checkpoint directory)::

    {"algorithm": "xxh3-128-64k", "state_finite": true,
     "files": {".metadata": {"xxh3-128-64k": "...", "bytes": 1234}, "__0_0.distcp": {...}, ...}}

Every file of the checkpoint but ``digests.json`` itself is listed, its digest under the name of
the algorithm. ``xxh3-128-64k`` (:mod:`qsdp.train.block_digest`) is what a save writes
(``sha256`` where the ``xxhash`` package is missing); a list of qsdp before it (``"sha256"``,
SHA-256 of each file) is still read and verified, by a full read of every file before the
load. The digests guard against damage (a changed, truncated, missing or unlisted file), not
against someone who rewrites files and list together.

At save, each rank hashes the DCP files it writes while writing them (no extra read:
:mod:`qsdp.train.digest_writer`) and sends the digests to rank 0, which alone lists the
directory, once: it hashes what no rank reported (``trainer.json``, ``comms.json``, written by
itself), checks that it sees every file every rank wrote (storage that is not shared is found at
the first save, naming the rank and the path), and writes the list.

At load, :func:`verify_digests` runs before anything is read: every listed file is there with
its size, rank 0 lists the directory once (a file the list leaves out is refused: it could be
damaged unseen), and the small files read before the load (``.metadata``, the JSON files) are
hashed, split round-robin over the ranks. The DCP payloads (``*.distcp``) are hashed while DCP
reads them (:mod:`qsdp.train.digest_reader`) and agreed on by :func:`agree_on_digests` right
after the load, before any loaded value is used. Each agreement is one all-reduce on the first
file that is missing, has another size or another digest, so every rank raises the same error.

``state_finite``: whether every floating-point tensor of the saved model and optimizer state was
finite. Rotation keeps the newest checkpoint where it is ``true`` (:mod:`qsdp.train.checkpoint`).

Not detected: a consistent rewrite (files and ``digests.json`` changed together), and a state
that was already wrong but finite when it was saved.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .block_digest import ALGORITHM, AVAILABLE, SequentialDigest, file_block_digest

__all__ = ["DIGEST_FILE", "ALGORITHM", "WRITTEN", "new_hasher", "DigestMismatch", "NotShared", "file_digest",
           "write_digests", "read_digests", "verify_digests", "hashed_while_loading", "agree_on_digests",
           "nonfinite_state", "state_verified"]

DIGEST_FILE = "digests.json"
_CHUNK = 1 << 20
# Why a file failed, in the order an all-reduce MIN prefers them; the last one names the algorithm.
_REASONS = ("is missing", "cannot be read", "has another size than at save", "does not match its digest")
MISSING, UNREADABLE, RESIZED, MISMATCH = range(4)  # indices into _REASONS


def _sha256(path: str | os.PathLike) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


# Every algorithm a digest list may name that can be verified here: what a save writes, and
# what qsdp wrote before it (and writes where xxhash is missing).
_ALGORITHMS = {**({ALGORITHM: file_block_digest} if AVAILABLE else {}), "sha256": _sha256}
WRITTEN = ALGORITHM if AVAILABLE else "sha256"  # what a save writes


def new_hasher(algorithm: str = WRITTEN) -> Any:
    """An object with ``update(bytes)`` and ``hexdigest()`` computing ``algorithm`` of the bytes
    fed front to back."""
    return SequentialDigest() if algorithm == ALGORITHM else hashlib.new(algorithm)


class DigestMismatch(Exception):
    """A checkpoint file that is not the one written at save; ``file`` names it."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(f"{file} {reason}")
        self.file, self.reason = file, reason


def file_digest(path: str | os.PathLike, algorithm: str = WRITTEN) -> tuple[str, int]:
    """``(digest hex, size in bytes)`` of a file with ``algorithm`` (``"xxh3-128-64k"`` or
    ``"sha256"``; by default what a save writes)."""
    return _ALGORITHMS[algorithm](path)


class NotShared(Exception):
    """Rank 0 does not see a file another rank wrote into the checkpoint: the ranks' storage is
    not one shared directory. The message names the rank, the file and where it went."""


def write_digests(directory: str | os.PathLike, state_finite: bool, written: dict[str, dict[str, Any]],
                  algorithm: str = WRITTEN) -> None:
    """Collective, after every file of the checkpoint in ``directory`` was written: write
    ``digests.json`` on rank 0. ``written``: the files this rank wrote, with their digests
    (``{algorithm: hex, "bytes": n}``, hashed as they were written:
    :class:`qsdp.train.digest_writer.DigestingWriter`). Rank 0 alone lists the directory, once;
    it hashes the files no rank reported (its own JSON files) and checks that it sees every file
    every rank wrote: :class:`NotShared` on every rank otherwise, and no digest list is written."""
    directory, rank = Path(directory), dist.get_rank()
    parts: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object((str(directory), written), parts if rank == 0 else None, dst=0)
    verdict: list[Any] = [None]
    if rank == 0:
        names = {e.name for e in os.scandir(directory) if e.is_file() and e.name != DIGEST_FILE}
        files: dict[str, Any] = {}
        for r, (where, entries) in enumerate(parts):
            unseen = sorted(set(entries) - names)
            if unseen and verdict[0] is None:
                verdict[0] = (f"the checkpoint's storage is not shared: rank 0 does not see {unseen[0]}, which rank "
                              f"{r} wrote into {Path(where) / unseen[0]}; every rank must save into one directory "
                              "that all of them share (--out on a file system every node mounts)")
            files.update(entries)
        if verdict[0] is None:
            for name in sorted(names - files.keys()):  # rank 0's own JSON files, or another writer's
                digest, size = file_digest(directory / name, algorithm)
                files[name] = {algorithm: digest, "bytes": size}
            with open(directory / DIGEST_FILE, "w", encoding="utf-8") as f:
                json.dump({"algorithm": algorithm, "state_finite": bool(state_finite),
                           "files": dict(sorted(files.items()))}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise NotShared(verdict[0])


def read_digests(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``digests.json`` of a checkpoint; ValueError/OSError when unreadable or malformed
    (or of an algorithm this qsdp does not know)."""
    data = json.loads((Path(directory) / DIGEST_FILE).read_text(encoding="utf-8"))
    files = data.get("files") if isinstance(data, dict) else None
    algorithm = data.get("algorithm") if isinstance(data, dict) else None
    if algorithm == ALGORITHM and not AVAILABLE:
        raise ValueError(f"{DIGEST_FILE} lists {ALGORITHM} digests, which need the xxhash package: pip install xxhash")
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"{DIGEST_FILE} names no digest algorithm this qsdp knows "
                         f"({str(algorithm)[:40]!r}; known: {', '.join(sorted(_ALGORITHMS))})")
    if (not isinstance(files, dict)
            or not all(isinstance(e, dict) and isinstance(e.get(algorithm), str) and isinstance(e.get("bytes"), int)
                       for e in files.values())):
        raise ValueError(f"{DIGEST_FILE} is not a {algorithm} digest list")
    return data


def state_verified(directory: str | os.PathLike) -> bool:
    """Whether a checkpoint has a digest list saying its state was finite when saved."""
    try:
        return read_digests(directory).get("state_finite") is True
    except (OSError, ValueError):
        return False


def hashed_while_loading(digests: dict[str, Any]) -> frozenset[str]:
    """The files of a digest list whose digests are checked while DCP reads them (the
    ``.distcp`` payloads, when the algorithm hashes blocks in any order); the rest, and every
    file of a ``sha256`` list, :func:`verify_digests` hashes before the load."""
    if digests["algorithm"] != ALGORITHM:
        return frozenset()
    return frozenset(name for name in digests["files"] if name.endswith(".distcp"))


def _check_file(path: Path, entry: dict[str, Any], algorithm: str, hash_it: bool) -> int | None:
    """The index in ``_REASONS`` of what is wrong with ``path``, or ``None``."""
    if not path.is_file():
        return MISSING
    try:
        size = path.stat().st_size
        digest = file_digest(path, algorithm)[0] if hash_it and size == entry["bytes"] else None
    except OSError:
        return UNREADABLE
    if size != entry["bytes"]:
        return RESIZED
    return None if not hash_it or digest == entry[algorithm] else MISMATCH


def _raise_first(names: Sequence[str], worst: int, algorithm: str, device: torch.device,
                 unlisted: list[Any] | None = None) -> None:
    """Collective: one all-reduce MIN of ``worst`` (``index * len(_REASONS) + reason`` of this
    rank's first bad file, ``len(names) * len(_REASONS)`` for a file the list leaves out,
    anything above for none); every rank raises the same :class:`DigestMismatch`."""
    unlisted_code = len(names) * len(_REASONS)
    code = torch.tensor([worst], dtype=torch.int64, device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MIN)
    found = int(code.item())
    if found < unlisted_code:
        index, reason = divmod(found, len(_REASONS))
        text = _REASONS[reason] + (f" ({algorithm}) written at save" if reason == MISMATCH else "")
        raise DigestMismatch(names[index], text)
    if found == unlisted_code:
        unlisted = unlisted if unlisted is not None else [None]
        dist.broadcast_object_list(unlisted, src=0)
        raise DigestMismatch(str(unlisted[0])[:80], f"is not listed in {DIGEST_FILE}, which lists every file of a checkpoint")


def verify_digests(directory: str | os.PathLike, device: torch.device, during_load: Collection[str] = ()) -> None:
    """Collective: raise :class:`DigestMismatch` on every rank when a file listed in
    ``digests.json`` is missing, has another size or another digest (each rank hashes every
    ``world``-th file), or when the directory holds a file the list leaves out (rank 0 lists the
    directory, once): a list that omits a file would let that file be damaged unseen. The files
    in ``during_load`` (:func:`hashed_while_loading`) are checked for presence and size only:
    their digests are checked as DCP reads them. One all-reduce on ``device`` (and a broadcast
    of the unlisted name where there is one). ``digests.json`` must be readable."""
    directory = Path(directory)
    digests = read_digests(directory)
    files, algorithm = digests["files"], digests["algorithm"]
    names = sorted(files)
    rank, world = dist.get_rank(), dist.get_world_size()
    worst = len(names) * len(_REASONS) + 1  # "nothing wrong" sorts after everything
    unlisted: list[Any] = [None]
    if rank == 0:
        extra = sorted(e.name for e in os.scandir(directory) if e.name != DIGEST_FILE and e.name not in files)
        if extra:
            unlisted[0], worst = extra[0], len(names) * len(_REASONS)
    for index in range(rank, len(names), world):
        reason = _check_file(directory / names[index], files[names[index]], algorithm, names[index] not in during_load)
        if reason is not None:
            worst = min(worst, index * len(_REASONS) + reason)
            break
    _raise_first(names, worst, algorithm, device, unlisted)


def agree_on_digests(digests: dict[str, Any], bad: tuple[str, int] | None, device: torch.device) -> None:
    """Collective, after a load that hashed the payloads while reading them: raise
    :class:`DigestMismatch` on every rank naming the first payload a rank found bad (``bad``:
    this rank's first, ``(name, index in _REASONS)``, or ``None``). One all-reduce."""
    names = sorted(digests["files"])
    worst = len(names) * len(_REASONS) + 1
    if bad is not None:
        worst = names.index(bad[0]) * len(_REASONS) + bad[1]
    _raise_first(names, worst, digests["algorithm"], device)


def _local(tensor: Any) -> torch.Tensor | None:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local if isinstance(local, torch.Tensor) and local.is_floating_point() else None


def nonfinite_state(model: torch.nn.Module | Sequence[torch.nn.Module],
                    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
                    device: torch.device) -> str | None:
    """Collective: ``None`` when every floating-point tensor of this model's parameters (of
    every model part, for a list of them: a rank's pipeline stages) and optimizer state (of
    every optimizer, for a list) is finite on every rank, else where the first non-finite one is
    (``"rank R: NAME"``, the same string on every rank). One host read and one all-reduce when
    all is finite."""
    names, flags = [], []
    parts = [model] if isinstance(model, torch.nn.Module) else list(model)
    optimizers = [o for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]) if o is not None]
    for name, param in (item for part in parts for item in part.named_parameters()):
        tensors = [(name, param)]
        for opt in optimizers:
            tensors += [(f"{name} (optimizer {key})", v) for key, v in opt.state.get(param, {}).items()]
        for label, tensor in tensors:
            local = _local(tensor.detach() if isinstance(tensor, torch.Tensor) else tensor)
            if local is not None and local.numel():
                names.append(label)
                flags.append(torch.isfinite(local).all().logical_not().to(device))
    bad = [names[i] for i, f in enumerate(torch.stack(flags).tolist()) if f] if flags else []
    count = torch.tensor([len(bad)], dtype=torch.int64, device=device)
    dist.all_reduce(count)
    if not int(count.item()):
        return None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bad[0] if bad else None)
    rank, first = next((r, b) for r, b in enumerate(everyone) if b is not None)
    return f"rank {rank}: {first}"
