"""DCP's reader hashing each payload file as DCP reads it: the digests of a checkpoint cost no
separate read before the load (:mod:`qsdp.train.integrity`).

Each ``.distcp`` file gets one owner rank, chosen when DCP plans the load (the coordinator sees
every rank's reads): the rank that reads most of it, or, for a file no rank reads, the rank with
the least to hash. The owner hashes the 64 KiB blocks of the file that DCP's reads bring into
memory whole, in whatever order DCP reads them (:class:`qsdp.train.block_digest.BlockDigest`);
once its reads are done (or have failed) it reads and hashes the blocks no read held whole (zip
headers and padding DCP skips, block ends of each item: a few percent of a file) and whatever
it owns but did not read. :attr:`DigestingReader.bad` is then this rank's first bad file, which
:func:`qsdp.train.integrity.agree_on_digests` agrees on after the load, before any loaded
value is used.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from .block_digest import ALGORITHM, BLOCK, BlockDigest
from .integrity import MISMATCH, MISSING, RESIZED, UNREADABLE
from .plain_data import PlainDataReader

__all__ = ["DigestingReader"]

# A large read is split so that each piece is hashed right after it arrives, still in the CPU's
# cache: DCP reads a tensor's whole storage at once, and hashed after such a read its bytes come
# back from memory. Measured on a 1 GB load, 2 ranks of a 2-core Xeon (CPU seconds a rank spends in
# DCP's large reads, hashing included, paired repeats on a machine shared with other work): 85-91 ms
# unsplit without hashing, 95-107 ms split into 512 KiB pieces without hashing (960 more reads);
# hashed, 256 KiB to 1 MiB pieces 134-145 ms alike, 2 MiB 144-149 ms. Hashed whole after an unsplit
# read, the bytes come from memory (one process: 34 ms to hash 0.5 GB, against 21 ms in 512 KiB pieces).
_SLICE = 1 << 19


class _HashingReadStream:
    """A file opened for reading whose reads feed the file's :class:`BlockDigest`."""

    def __init__(self, raw: Any, digest: BlockDigest) -> None:
        self.raw, self.digest = raw, digest
        # DCP's view of an item calls these around each of its reads: found here, not by __getattr__.
        self.seek, self.tell = raw.seek, raw.tell

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf)
        if view.nbytes < BLOCK:  # a zip header: no whole block (but a short last one, read again at the end)
            return self.raw.readinto(view)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        pos, done, total = self.raw.tell(), 0, view.nbytes
        readinto, feed = self.raw.readinto, self.digest.feed
        while done < total:
            # Pieces end on block boundaries of the file: no block is split between two of them.
            piece = min(total - done, _SLICE - (pos + done) % _SLICE)
            n = readinto(view[done:done + piece])
            if not n:
                break
            feed(pos + done, view[done:done + n])
            done += n
        return done

    def read(self, size: int = -1) -> bytes:
        if 0 <= size < BLOCK:  # as in readinto
            return self.raw.read(size)
        pos = self.raw.tell()
        data = self.raw.read(size)
        self.digest.feed(pos, data)
        return data

    def __getattr__(self, name: str) -> Any:  # seek, tell, close, seekable...
        return getattr(self.raw, name)


class _HashingFileSystem(FileSystem):
    def __init__(self, digests: dict[str, BlockDigest]) -> None:
        super().__init__()
        self.digests = digests  # the files this rank owns, by name

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            digest = self.digests.get(Path(path).name) if "r" in mode else None
            yield raw if digest is None else _HashingReadStream(raw, digest)


class DigestingReader(PlainDataReader):
    """:class:`qsdp.train.plain_data.PlainDataReader` hashing the payload files ``files``
    (name -> ``{"xxh3-128-64k": digest, "bytes": size}``, from ``digests.json``) as DCP reads
    them. After ``dcp.load`` (returned or raised), :attr:`bad` is ``(name, reason index)`` of
    this rank's first owned file that is not the one saved (in name order), or ``None``;
    :attr:`owned` names the files this rank hashed, :attr:`reread` how many of their bytes it
    read apart from DCP's reads."""

    def __init__(self, path: str | os.PathLike, files: dict[str, dict[str, Any]]) -> None:
        super().__init__(path)
        self.files = files
        self.bad: tuple[str, int] | None = None
        self.owned: list[str] = []
        self.reread = 0
        self._owned: dict[str, BlockDigest] = {}
        self.fs = _HashingFileSystem(self._owned)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: each payload's owner, in ``storage_data`` of its plan."""
        plans = super().prepare_global_plan(plans)
        reads = [dict[str, int]() for _ in plans]
        for rank, plan in enumerate(plans):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                reads[rank][info.relative_path] = reads[rank].get(info.relative_path, 0) + info.length
        owned: list[list[str]] = [[] for _ in plans]
        load = [0] * len(plans)  # bytes each rank hashes apart from its reads
        unread = []
        for name in sorted(self.files):
            most = max(range(len(plans)), key=lambda r: (reads[r].get(name, 0), -r))
            if reads[most].get(name, 0):
                owned[most].append(name)
            else:
                unread.append(name)
        for name in sorted(unread, key=lambda n: -self.files[n]["bytes"]):
            least = min(range(len(plans)), key=lambda r: (load[r], r))
            owned[least].append(name)
            load[least] += self.files[name]["bytes"]
        return [dataclasses.replace(plan, storage_data=tuple(names)) for plan, names in zip(plans, owned)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._owned.clear()
        self.owned = list(plan.storage_data or ())
        for name in self.owned:
            self._owned[name] = BlockDigest(self.files[name]["bytes"])
        try:
            return super().read_data(plan, planner)
        finally:  # also after a failed read: the verdict on the files comes before DCP's error
            self.bad = self._finish()

    def _finish(self) -> tuple[str, int] | None:
        """Hash what DCP's reads did not hold whole; this rank's first bad owned file."""
        for name in sorted(self._owned):
            digest, path = self._owned[name], Path(self.path) / name
            self.reread += digest.missing_bytes()
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return name, MISSING
            except OSError:
                return name, UNREADABLE
            try:
                whole = digest.fill(fd) and os.fstat(fd).st_size == digest.size
            except OSError:
                return name, UNREADABLE
            finally:
                os.close(fd)
            if not whole:
                return name, RESIZED
            if digest.hexdigest() != self.files[name][ALGORITHM]:
                return name, MISMATCH
        return None
