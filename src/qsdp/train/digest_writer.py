"""DCP's file system writer hashing every file as it writes it: the digests of a checkpoint cost
no extra read and no directory listing on the ranks that wrote it (:mod:`qsdp.train.integrity`).

DCP writes each file front to back (``tell`` for the offsets, ``write`` for the bytes); a stream
that is ever moved elsewhere (``seek``) is hashed again from the file when it closes, right after
its write, so a digest is always the file's.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .integrity import file_digest

__all__ = ["DigestingWriter"]


class _HashingStream:
    """A file opened for writing that hashes what goes through it."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.sha, self.size, self.exact = raw, hashlib.sha256(), 0, True

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        view = memoryview(data).cast("B")
        if written is not None and written != view.nbytes:  # a partial raw write: hash the file later
            self.exact = False
        self.sha.update(view)
        self.size += view.nbytes
        return written if written is not None else view.nbytes

    def seek(self, *args: Any) -> int:
        self.exact = False
        return self.raw.seek(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, writable...
        return getattr(self.raw, name)


class _DigestingFileSystem(FileSystem):
    def __init__(self, digests: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self.digests = digests

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
        if stream.exact:
            entry = {"sha256": stream.sha.hexdigest(), "bytes": stream.size}
        else:
            digest, size = file_digest(path)
            entry = {"sha256": digest, "bytes": size}
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
    checkpoint directory) to ``{"sha256": ..., "bytes": ...}``."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.digests: dict[str, dict[str, Any]] = {}
        self.fs = _DigestingFileSystem(self.digests)
