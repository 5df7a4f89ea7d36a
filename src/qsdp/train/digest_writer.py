"""DCP's file system writer hashing every file as it writes it: the digests of a checkpoint cost
no extra read and no directory listing on the ranks that wrote it (:mod:`qsdp.train.integrity`).

DCP writes each file front to back (``tell`` for the offsets, ``write`` for the bytes). A thread
reads each file right behind the writer, from the page cache, and hashes it
(:mod:`qsdp.train.block_digest`): the hashing runs while DCP writes and syncs each file, not
after it. A stream that is ever moved elsewhere
(``seek``) or that the thread cannot read is hashed again from the file when it closes, so a
digest is always the file's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .block_digest import BLOCK
from .integrity import WRITTEN, file_digest, new_hasher

__all__ = ["DigestingWriter"]

_CHUNK = 1 << 20  # what the thread behind the writer reads and hashes at a time


class _HashingStream:
    """A file opened for writing, hashed by a thread that reads it right behind the writer (from
    the page cache): the hashing overlaps the writes and DCP's ``fsync`` instead of following
    them, and holds no copy of the data (what the writer passes may be freed once ``write``
    returns)."""

    def __init__(self, raw: Any, path: Path, algorithm: str) -> None:
        self.raw, self.path, self.algorithm = raw, path, algorithm
        self.hasher, self.hashed, self.exact = new_hasher(algorithm), 0, True
        self._handed, self._closed = 0, False  # bytes handed to the OS; whether the writer is done
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._hash_behind, name="qsdp-digest", daemon=True)
        self._thread.start()

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        nbytes = memoryview(data).nbytes
        if written is not None and written != nbytes:  # a partial raw write: hash the file at the end
            self.exact = False
        self.raw.flush()  # the reader behind sees what the OS has
        with self._ready:
            self._handed += nbytes
            self._ready.notify()
        return written if written is not None else nbytes

    def seek(self, *args: Any) -> int:
        self.exact = False
        return self.raw.seek(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, writable...
        return getattr(self.raw, name)

    def _hash_behind(self) -> None:
        buf = memoryview(bytearray(_CHUNK))
        try:
            with open(self.path, "rb", buffering=0) as f:
                while True:
                    with self._ready:
                        while self.hashed >= self._handed and not self._closed:
                            self._ready.wait()
                        target, closed = self._handed, self._closed
                    while self.hashed < target:
                        n = min(_CHUNK, target - self.hashed)
                        if not closed and n > BLOCK:  # whole blocks while the file grows: none is copied
                            n -= (self.hashed + n) % BLOCK
                        n = f.readinto(buf[:n])
                        if not n:
                            raise OSError(f"{self.path} is shorter than what was written")
                        self.hasher.update(buf[:n])
                        self.hashed += n
                    if closed and self.hashed >= self._handed:
                        return
        except OSError:
            self.exact = False  # hashed from the file once it is complete instead

    def digest(self) -> dict[str, Any]:
        """``{algorithm: digest, "bytes": size}`` of the file, once the writer has closed it."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join()
        if self.exact and self.hashed == self._handed:
            return {self.algorithm: self.hasher.hexdigest(), "bytes": self.hashed}
        digest, size = file_digest(self.path, self.algorithm)
        return {self.algorithm: digest, "bytes": size}


class _DigestingFileSystem(FileSystem):
    def __init__(self, digests: dict[str, dict[str, Any]], algorithm: str) -> None:
        super().__init__()
        self.digests, self.algorithm = digests, algorithm

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw, Path(path), self.algorithm)
            try:
                yield stream
            finally:
                raw.close()
                entry = stream.digest()  # after the close: the thread is never left behind
        self.digests[Path(path).name] = entry

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP's .metadata is written as a temp file, then renamed
        entry = self.digests.pop(Path(path).name, None)
        if entry is not None:
            self.digests[Path(new_path).name] = entry

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        self.digests.pop(Path(path).name, None)


class DigestingWriter(FileSystemWriter):
    """``FileSystemWriter`` whose ``digests`` map every file this rank wrote (its name in the
    checkpoint directory) to ``{algorithm: digest, "bytes": size}``; ``algorithm``: by default
    what a save writes (:data:`qsdp.train.integrity.WRITTEN`)."""

    def __init__(self, path: str | os.PathLike, *, algorithm: str = WRITTEN, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.digests: dict[str, dict[str, Any]] = {}
        self.fs = _DigestingFileSystem(self.digests, algorithm)
