"""The digest of a checkpoint file, computable from its bytes in any order.

``xxh3-128-64k``: the XXH3-128 of the concatenated XXH3-128 digests (16 bytes each) of the
file's 64 KiB blocks, the last one shorter. A block is hashed wherever its bytes are in memory
as a whole: in each piece the writer hands the OS at save (:mod:`qsdp.train.digest_writer`),
and in the buffers DCP reads into at load, in whatever order it reads them
(:mod:`qsdp.train.digest_reader`); only the blocks no read held whole are read again. XXH3 runs
at memory speed (about 6x SHA-256 on a core without SHA extensions). It detects damage (any changed byte changes the digest but with
odds of 2^-128 for a random change); it is not a cryptographic hash and does not detect a
deliberate rewrite: the restricted unpickling of :mod:`qsdp.train.plain_data` is what keeps a
checkpoint's contents from running code.

XXH3 comes from the ``xxhash`` package, a dependency of qsdp. Where it is missing (an install
without dependencies), :data:`AVAILABLE` is ``False``: saves write SHA-256 digests instead
(:mod:`qsdp.train.integrity`), which any qsdp verifies, and a checkpoint of this algorithm
cannot be verified there.
"""

from __future__ import annotations

import os
from typing import Any

try:
    import xxhash
except ImportError:  # an install without dependencies: see the module's doc
    xxhash = None

__all__ = ["ALGORITHM", "AVAILABLE", "BLOCK", "BlockDigest", "SequentialDigest", "file_block_digest"]

ALGORITHM = "xxh3-128-64k"
BLOCK = 1 << 16
_FILL = 1 << 20  # what a read of blocks no read held at once reads at a time
AVAILABLE = xxhash is not None
# A block's digest: the C function itself, called once a block (no Python frame around it).
_hash = xxhash.xxh3_128_digest if AVAILABLE else None


def _combine(block_digests: Any) -> str:
    return xxhash.xxh3_128_hexdigest(block_digests)


def _pread_fully(fd: int, view: memoryview, offset: int) -> int:
    """Read ``view`` from ``offset`` on, reading on after a short read (network and FUSE file
    systems return less than asked before the end); fewer bytes only where the file ends."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            break
        done += n
    return done


class BlockDigest:
    """The digest of a file of ``size`` bytes, from bytes fed at their offsets in any order.
    Each block is hashed once, the first time a fed buffer holds it whole."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.count = -(-size // BLOCK)
        self._digests = bytearray(16 * self.count)
        self._done = bytearray(self.count)  # 1 where the block is hashed

    def feed(self, offset: int, data: Any) -> None:
        """Hash every block that ``data`` (the file's bytes from ``offset`` on) holds whole."""
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        end = min(offset + view.nbytes, self.size)
        first = -(-offset // BLOCK)
        last = end // BLOCK if end < self.size else self.count  # exclusive; the short last block ends at size
        if first >= last:
            return
        # Up to the end of the last whole block: the slices below stop there, the short last one at size.
        view, done = view[:min(last * BLOCK, self.size) - offset], self._done
        if done.find(1, first, last) < 0:  # the usual case: no block of the run hashed yet
            # One Python step a block (a slice, a call): the run's digests go in with one assignment.
            self._digests[16 * first:16 * last] = b"".join(
                [_hash(view[start:start + BLOCK]) for start in range(first * BLOCK - offset, view.nbytes, BLOCK)])
            done[first:last] = b"\x01" * (last - first)
            return
        for i in range(first, last):
            if not done[i]:
                start = i * BLOCK - offset
                self._digests[16 * i:16 * i + 16] = _hash(view[start:start + BLOCK])
                done[i] = 1

    def missing_bytes(self) -> int:
        """How many bytes of the file no fed buffer held as whole blocks."""
        missing = self._done.count(0) * BLOCK
        if self.count and not self._done[-1]:
            missing -= self.count * BLOCK - self.size  # the last block is short
        return missing

    def fill(self, fd: int) -> bool:
        """Read and hash the blocks not hashed yet from the open file ``fd``; ``False`` when the
        file ends before ``size`` (it has another size)."""
        buf = memoryview(bytearray(_FILL))
        done, per_read = self._done, _FILL // BLOCK
        i = done.find(0)
        while i >= 0:  # a run of blocks to hash, of _FILL bytes at most: found by bytearray.find, not a loop
            j = done.find(1, i, min(i + per_read, self.count))
            j = min(i + per_read, self.count) if j < 0 else j
            start, stop = i * BLOCK, min(j * BLOCK, self.size)
            n = _pread_fully(fd, buf[:stop - start], start)
            if n != stop - start:
                return False
            self.feed(start, buf[:n])
            i = done.find(0, j)
        return True

    def hexdigest(self) -> str:
        """The file's digest; every block must have been hashed."""
        if 0 in self._done:
            raise ValueError("blocks are missing")
        return _combine(self._digests)


class SequentialDigest:
    """The same digest from the file's bytes fed front to back, in pieces of any length (a
    block split between two pieces is copied, at most 64 KiB)."""

    def __init__(self) -> None:
        self._outer = xxhash.xxh3_128()
        self._partial = bytearray()
        self.size = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        if self._partial:
            take = min(BLOCK - len(self._partial), view.nbytes)
            self._partial += view[:take]
            view = view[take:]
            if len(self._partial) < BLOCK:
                return
            self._outer.update(_hash(self._partial))
            self._partial = bytearray()
        whole = view.nbytes - view.nbytes % BLOCK
        for start in range(0, whole, BLOCK):
            self._outer.update(_hash(view[start:start + BLOCK]))
        self._partial += view[whole:]

    def hexdigest(self) -> str:
        """The digest of what was fed (the last, short block included)."""
        outer = self._outer.copy()
        if self._partial:
            outer.update(_hash(self._partial))
        return outer.hexdigest()


def file_block_digest(path: str | os.PathLike) -> tuple[str, int]:
    """``(digest, size in bytes)`` of a file, read front to back."""
    digest = SequentialDigest()
    buf = memoryview(bytearray(_FILL))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(buf[:n])
    return digest.hexdigest(), digest.size
