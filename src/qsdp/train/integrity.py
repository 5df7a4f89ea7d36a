"""What makes a checkpoint trustworthy before it is loaded: a SHA-256 digest of every file,
written when the save is complete and checked before anything is read, and a check that the
model and optimizer state are finite.

``digests.json`` (in the checkpoint directory)::

    {"algorithm": "sha256", "state_finite": true,
     "files": {".metadata": {"sha256": "...", "bytes": 1234}, "__0_0.distcp": {...}, ...}}

Every file of the checkpoint but ``digests.json`` itself is listed. Each rank hashes the DCP
files it writes while writing them (no extra read: :mod:`qsdp.train.digest_writer`) and sends
the digests to rank 0, which alone lists the directory, once: it hashes what no rank reported
(``trainer.json``, ``comms.json``, written by itself), checks that it sees every file every rank
wrote (storage that is not shared is found at the first save, naming the rank and the path), and
writes the list. At load, the files are split
round-robin over the ranks, each rank hashes its part, rank 0 lists the directory once (a file
the list leaves out is refused: it could be damaged unseen), and one all-reduce agrees on the
first file that is missing, has another size or another digest, so every rank raises the same
error.

``state_finite``: whether every floating-point tensor of the saved model and optimizer state was
finite. Rotation keeps the newest checkpoint where it is ``true`` (:mod:`qsdp.train.checkpoint`).

Not detected: a consistent rewrite (files and ``digests.json`` changed together), and a state
that was already wrong but finite when it was saved.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["DIGEST_FILE", "DigestMismatch", "NotShared", "file_digest", "write_digests", "read_digests", "verify_digests",
           "nonfinite_state", "state_verified"]

DIGEST_FILE = "digests.json"
_CHUNK = 1 << 20
# Why a file failed, in the order an all-reduce MIN prefers them.
_REASONS = ("is missing", "cannot be read", "has another size than at save",
            "does not match its digest (sha256) written at save")


class DigestMismatch(Exception):
    """A checkpoint file that is not the one written at save; ``file`` names it."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(f"{file} {reason}")
        self.file, self.reason = file, reason


def file_digest(path: str | os.PathLike) -> tuple[str, int]:
    """``(sha256 hex, size in bytes)`` of a file, read in 1 MiB chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


class NotShared(Exception):
    """Rank 0 does not see a file another rank wrote into the checkpoint: the ranks' storage is
    not one shared directory. The message names the rank, the file and where it went."""


def write_digests(directory: str | os.PathLike, state_finite: bool, written: dict[str, dict[str, Any]]) -> None:
    """Collective, after every file of the checkpoint in ``directory`` was written: write
    ``digests.json`` on rank 0. ``written``: the files this rank wrote, with their digests
    (hashed as they were written: :class:`qsdp.train.digest_writer.DigestingWriter`). Rank 0
    alone lists the directory, once; it hashes the files no rank reported (its own JSON files)
    and checks that it sees every file every rank wrote: :class:`NotShared` on every rank
    otherwise, and no digest list is written."""
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
                digest, size = file_digest(directory / name)
                files[name] = {"sha256": digest, "bytes": size}
            with open(directory / DIGEST_FILE, "w", encoding="utf-8") as f:
                json.dump({"algorithm": "sha256", "state_finite": bool(state_finite),
                           "files": dict(sorted(files.items()))}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise NotShared(verdict[0])


def read_digests(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``digests.json`` of a checkpoint; ValueError/OSError when unreadable or malformed."""
    data = json.loads((Path(directory) / DIGEST_FILE).read_text(encoding="utf-8"))
    files = data.get("files") if isinstance(data, dict) else None
    if (not isinstance(files, dict) or data.get("algorithm") != "sha256"
            or not all(isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("bytes"), int)
                       for e in files.values())):
        raise ValueError(f"{DIGEST_FILE} is not a sha256 digest list")
    return data


def state_verified(directory: str | os.PathLike) -> bool:
    """Whether a checkpoint has a digest list saying its state was finite when saved."""
    try:
        return read_digests(directory).get("state_finite") is True
    except (OSError, ValueError):
        return False


def _check_file(path: Path, entry: dict[str, Any]) -> int | None:
    """The index in ``_REASONS`` of what is wrong with ``path``, or ``None``."""
    if not path.is_file():
        return 0
    try:
        size = path.stat().st_size
        digest = file_digest(path)[0] if size == entry["bytes"] else None
    except OSError:
        return 1
    if size != entry["bytes"]:
        return 2
    return None if digest == entry["sha256"] else 3


def verify_digests(directory: str | os.PathLike, device: torch.device) -> None:
    """Collective: raise :class:`DigestMismatch` on every rank when a file listed in
    ``digests.json`` is missing, has another size or another digest (each rank hashes every
    ``world``-th file), or when the directory holds a file the list leaves out (rank 0 lists the
    directory, once): a list that omits a file would let that file be damaged unseen. One
    all-reduce on ``device`` (and a broadcast of the unlisted name where there is one).
    ``digests.json`` must be readable."""
    directory = Path(directory)
    files = read_digests(directory)["files"]
    names = sorted(files)
    rank, world = dist.get_rank(), dist.get_world_size()
    unlisted_code = len(names) * len(_REASONS)  # after every listed file's failure
    worst = unlisted_code + 1  # "nothing wrong" sorts after everything
    unlisted: list[Any] = [None]
    if rank == 0:
        extra = sorted(e.name for e in os.scandir(directory) if e.name != DIGEST_FILE and e.name not in files)
        if extra:
            unlisted[0], worst = extra[0], unlisted_code
    for index in range(rank, len(names), world):
        reason = _check_file(directory / names[index], files[names[index]])
        if reason is not None:
            worst = index * len(_REASONS) + reason
            break
    code = torch.tensor([worst], dtype=torch.int64, device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MIN)
    found = int(code.item())
    if found < unlisted_code:
        index, reason = divmod(found, len(_REASONS))
        raise DigestMismatch(names[index], _REASONS[reason])
    if found == unlisted_code:
        dist.broadcast_object_list(unlisted, src=0)
        raise DigestMismatch(str(unlisted[0])[:80], f"is not listed in {DIGEST_FILE}, which lists every file of a checkpoint")


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
