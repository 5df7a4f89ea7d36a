"""DCP's file system writer hashing every file as it writes it: the digests of a checkpoint cost
no extra read and no directory listing on the ranks that wrote it (:mod:`qsdp.train.integrity`).

DCP writes each file front to back (``tell`` for the offsets, ``write`` for the bytes). Each
``write`` hands the bytes to the OS and hashes them (:mod:`qsdp.train.block_digest`) a piece at a
time, so the hash reads each piece while the copy into the page cache has just brought it into
the CPU's cache: one pass over memory, no second read of the file, no copy of the data. A stream
that is ever moved elsewhere (``seek``) is hashed again from the file when it closes, so a digest
is always the file's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .integrity import WRITTEN, file_digest, new_hasher

__all__ = ["DigestingWriter", "PIECE", "write_in_pieces"]

# What a write hands to the OS, then hashes, at a time: small enough to stay in the CPU's cache
# between the two, large enough that the calls cost nothing beside the bytes.
PIECE = 1 << 20


def write_in_pieces(raw: Any, data: Any, after: Callable[[memoryview], Any] | None = None) -> int:
    """Write every byte of ``data`` (any buffer) to the file object ``raw``, :data:`PIECE` bytes
    at a time, each piece passed to ``after`` once written (a piece the OS took in part is
    written on from where it stopped); how many bytes were written."""
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    for start in range(0, view.nbytes, PIECE):
        piece = view[start:start + PIECE]
        done = 0
        while done < piece.nbytes:
            n = raw.write(piece[done:])
            if n == 0:
                raise OSError(f"no byte of {piece.nbytes - done} could be written")
            done = piece.nbytes if n is None else done + n
        if after is not None:
            after(piece)
    return view.nbytes


class _HashingStream:
    """A file opened for writing that hashes what goes through it, as it goes through. Nothing
    is kept of what ``write`` is given: torch.save passes views of buffers that are freed once
    ``write`` returns."""

    def __init__(self, raw: Any, path: Path, algorithm: str) -> None:
        self.raw, self.path, self.algorithm = raw, path, algorithm
        self.hasher, self.size, self.exact = new_hasher(algorithm), 0, True

    def write(self, data: Any) -> int:
        nbytes = write_in_pieces(self.raw, data, self.hasher.update)
        self.size += nbytes
        return nbytes

    def seek(self, *args: Any) -> int:
        self.exact = False
        return self.raw.seek(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, writable...
        return getattr(self.raw, name)

    def digest(self) -> dict[str, Any]:
        """``{algorithm: digest, "bytes": size}`` of the file, once the writer has closed it."""
        if self.exact:
            return {self.algorithm: self.hasher.hexdigest(), "bytes": self.size}
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
            yield stream
        self.digests[Path(path).name] = stream.digest()  # after the close: a file hashed again is complete

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
