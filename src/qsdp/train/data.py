"""Text corpora, tokenizers and deterministic batches for language-model training.

- ``load_corpus(None)`` is the embedded default: the conversations shipped inside the
  ``chitchat-dataset`` package (about 12.7 M characters; ``pip install 'qsdp[train]'``), so a
  demo needs no download. ``sample_corpus_path()`` is a few kilobytes of text shipped inside
  qsdp itself, for short runs that must need nothing else.
- ``ByteTokenizer`` (256 ids, one per byte) is the default tokenizer; ``train_bpe_tokenizer``
  trains a byte-level BPE with the ``tokenizers`` library and caches it as JSON.
- ``TokenDataset`` holds the token ids once and splits them into train (first 90 %) and
  validation (last 10 %). Training reads the train split as a stream of samples in epochs
  (:meth:`TokenDataset.samples`): sample ``k`` is a pure function of (seed, k), so the data
  position is the number of samples consumed, whatever the number of ranks that consumed them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from qsdp.extras import require

from .files import atomic_write

__all__ = [
    "DataError",
    "load_corpus",
    "sample_corpus_path",
    "Tokenizer",
    "ByteTokenizer",
    "BPETokenizer",
    "train_bpe_tokenizer",
    "get_tokenizer",
    "TOKENIZER_KINDS",
    "TokenDataset",
]

TOKENIZER_KINDS = ("byte", "bpe")


class DataError(ValueError):
    """A corpus or dataset that cannot be used; the message names the file and the problem."""


# ---------------------------------------------------------------------------------------------
# Corpora


def load_corpus(path: str | os.PathLike | None = None) -> str:
    """The training text: the embedded chit-chat corpus (``None``) or a UTF-8 text file.

    The default corpus has one utterance a line and a blank line between conversations, in the
    order of the package's JSON file. A file must exist and be non-empty, valid UTF-8 text;
    otherwise DataError names the path and the problem (for bad UTF-8, the byte offset).
    """
    if path is None:
        return _default_corpus()
    p = Path(path)
    if not p.exists():
        raise DataError(f"corpus file {str(p)!r} does not exist")
    if not p.is_file():
        raise DataError(f"corpus path {str(p)!r} is not a regular file")
    raw = p.read_bytes()
    if not raw:
        raise DataError(f"corpus file {str(p)!r} is empty")
    if not raw.strip():
        raise DataError(f"corpus file {str(p)!r} is empty (only whitespace)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"corpus file {str(p)!r} is not valid UTF-8 at byte offset {e.start}"
        ) from None
    # A byte-order mark is an encoding artefact, not text to learn.
    return text.removeprefix("\ufeff")


def sample_corpus_path() -> str:
    """A UTF-8 text file of a few kilobytes shipped inside the package, needing no extra: enough
    for a few training steps end to end (``qsdp train --data PATH``), as the GPU smoke runs."""
    return str(importlib.resources.files("qsdp.train").joinpath("sample.txt"))


def require_default_corpus() -> None:
    """Raise :class:`qsdp.extras.MissingExtraError` where the package of the default corpus
    (``qsdp[train]``) is not installed."""
    require("chitchat_dataset", "the default corpus", "or pass --data FILE.txt")


@functools.lru_cache(maxsize=1)
def _default_corpus() -> str:
    # Read the package's data file directly: its own loader leaves the file open and joins the
    # utterances of a turn with spaces. Cached: a process may ask several times (text, tokenizer).
    require_default_corpus()
    resource = importlib.resources.files("chitchat_dataset").joinpath("dataset.json")
    conversations = json.loads(resource.read_text(encoding="utf-8"))
    parts = []
    for conv in conversations.values():
        lines = (
            " ".join(u["text"].split())  # one utterance a line: fold any inner newlines
            for message in conv["messages"]
            for u in message
        )
        parts.append("\n".join(line for line in lines if line))
    return "\n\n".join(p for p in parts if p) + "\n"


# ---------------------------------------------------------------------------------------------
# Tokenizers


class Tokenizer(Protocol):
    """What ``TokenDataset`` and the training loop need of a tokenizer."""

    vocab_size: int
    fingerprint: str  # changes whenever the text -> ids mapping changes (a cache key)

    def encode(self, text: str) -> list[int]: ...

    def encode_corpus(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: the UTF-8 bytes of the text are the ids (vocab 256), lossless."""

    vocab_size: int = 256
    fingerprint: str = "byte"

    def encode(self, text: str) -> list[int]:
        """Text -> list of ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def encode_corpus(self, text: str) -> np.ndarray:
        """Text -> [n_bytes] uint8 array (fast path for a whole corpus)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Ids -> text; byte sequences that are not valid UTF-8 (a cut character) become U+FFFD."""
        return bytes(_as_int_list(ids)).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE tokenizer (a trained ``tokenizers.Tokenizer``); lossless on any text."""

    def __init__(self, tokenizer, json_str: str) -> None:
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size()
        self.fingerprint: str = "bpe-" + hashlib.sha256(json_str.encode("utf-8")).hexdigest()[:16]

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> BPETokenizer:
        """Load a tokenizer saved as ``tokenizers`` JSON."""
        require("tokenizers", "the BPE tokenizer")
        from tokenizers import Tokenizer as HFTokenizer  # only the BPE tokenizer loads the library

        json_str = Path(path).read_text(encoding="utf-8")
        return cls(HFTokenizer.from_str(json_str), json_str)

    def encode(self, text: str) -> list[int]:
        """Text -> list of ids in [0, vocab_size)."""
        return self._tok.encode(text).ids

    def encode_corpus(self, text: str, chunk_chars: int = 1 << 16) -> np.ndarray:
        """Text -> [n_tokens] array (uint16 or int32), encoded in line-aligned chunks.

        Chunks end at line ends, so pre-tokens (which never span a letter and a newline) are
        nearly always the same as for the whole text, and the chunks encode in parallel.
        """
        chunks, buf, size = [], [], 0
        for line in text.splitlines(keepends=True):
            buf.append(line)
            size += len(line)
            if size >= chunk_chars:
                chunks.append("".join(buf))
                buf, size = [], 0
        if buf:
            chunks.append("".join(buf))
        dtype = _id_dtype(self.vocab_size)
        arrays = [np.asarray(e.ids, dtype=dtype) for e in self._tok.encode_batch(chunks)]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Ids -> text."""
        return self._tok.decode(_as_int_list(ids), skip_special_tokens=False)


def _train_bpe(text: str, vocab_size: int):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``text`` (no special tokens)."""
    # Only the BPE tokenizer loads the library (the byte tokenizer, the default, needs nothing).
    require("tokenizers", "the BPE tokenizer", "or use the byte tokenizer")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # All 256 byte symbols from the start, so any text (even unseen characters) encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    return tok


def train_bpe_tokenizer(
    text: str, vocab_size: int, cache_dir: str | os.PathLike | None
) -> BPETokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` ids on ``text``, or load it from cache.

    The cache file is ``cache_dir/bpe-<hash of text and vocab_size>.json`` (written atomically);
    ``cache_dir=None`` disables caching. In a multi-process job, let one rank call this first and
    the others after a barrier, so that every rank loads the same file.
    """
    if vocab_size <= 256:
        raise ValueError(f"BPE vocab_size must be more than the 256 byte symbols, got {vocab_size}")
    if not text:
        raise DataError("cannot train a BPE tokenizer on empty text")
    path = None
    if cache_dir is not None:
        key = _sha256(text, f"bpe-v1-{vocab_size}")
        path = Path(cache_dir) / f"bpe-{key[:24]}.json"
        if path.exists():
            return BPETokenizer.from_file(path)
    tok = _train_bpe(text, vocab_size)
    json_str = tok.to_str()
    if path is not None:
        _atomic_write_bytes(path, json_str.encode("utf-8"))
    return BPETokenizer(tok, json_str)


def get_tokenizer(
    kind: str,
    text: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    vocab_size: int = 4096,
    val_fraction: float = 0.1,
) -> ByteTokenizer | BPETokenizer:
    """The tokenizer of ``kind``: ``"byte"`` (no training) or ``"bpe"``.

    For ``"bpe"``, trains on the first ``1 - val_fraction`` of ``text``'s characters (about the
    train split of ``TokenDataset``, so validation text stays unseen) with ``vocab_size`` ids.
    """
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if text is None:
            raise ValueError("a BPE tokenizer needs the text to train on")
        _check_fraction(val_fraction)
        train_text = text[: len(text) - int(len(text) * val_fraction)]
        return train_bpe_tokenizer(train_text, vocab_size, cache_dir)
    raise ValueError(f"unknown tokenizer kind {kind!r}; allowed: {', '.join(TOKENIZER_KINDS)}")


# ---------------------------------------------------------------------------------------------
# Batches


class TokenDataset:
    """Token ids with a train/validation split and stateless, deterministic batches.

    The last ``val_fraction`` of the tokens (10 % by default) is the validation split, the rest
    the train split. Two ways to draw training data:

    * the **stream** (:meth:`samples`, :meth:`stream_batch`; the training job's): the train split
      cut into :meth:`samples_per_epoch` windows, visited in a new random order each epoch.
      Sample ``k`` of the stream depends only on (seed, k), so the data position is the number
      of samples consumed: a run resumed on any number of ranks continues the epoch without
      seeing a sample twice or skipping one, provided the global batch is taken as consecutive
      samples (:meth:`stream_batch` for equal shares; the training job's shares may differ by
      one, :class:`qsdp.train.elastic.BatchSplit`);
    * :meth:`batch`: random windows whose positions depend only on (seed, step, rank), for
      measurements that need independent batches without a position.
    """

    def __init__(
        self,
        tokens: np.ndarray | Sequence[int],
        vocab_size: int,
        *,
        val_fraction: float = 0.1,
        seed: int = 0,
    ) -> None:
        """tokens: [n] integer ids in [0, vocab_size)."""
        _check_fraction(val_fraction)
        self.tokens = np.asarray(tokens)
        if self.tokens.ndim != 1 or not np.issubdtype(self.tokens.dtype, np.integer):
            raise DataError(f"tokens must be a 1-D integer array, got {self.tokens.dtype} "
                            f"of shape {self.tokens.shape}")
        if self.tokens.size and (self.tokens.min() < 0 or self.tokens.max() >= vocab_size):
            raise DataError(f"token ids must be in [0, {vocab_size}), got "
                            f"[{self.tokens.min()}, {self.tokens.max()}]")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.vocab_size = vocab_size
        self.seed = seed
        self.n_val = int(len(self.tokens) * val_fraction)
        self.n_train = len(self.tokens) - self.n_val

    @classmethod
    def from_text(
        cls,
        text: str,
        tokenizer: Tokenizer,
        *,
        cache_dir: str | os.PathLike | None = None,
        val_fraction: float = 0.1,
        seed: int = 0,
    ) -> TokenDataset:
        """Encode ``text`` once; with ``cache_dir``, keep the ids as ``tokens-<hash>.npy`` there.

        The cache key hashes the text and the tokenizer's fingerprint; a cached file is memory
        mapped, so local ranks share its pages.
        """
        if cache_dir is None:
            return cls(tokenizer.encode_corpus(text), tokenizer.vocab_size,
                       val_fraction=val_fraction, seed=seed)
        key = _sha256(text, tokenizer.fingerprint)
        path = Path(cache_dir) / f"tokens-{key[:24]}.npy"
        if not path.exists():
            ids = tokenizer.encode_corpus(text).astype(_id_dtype(tokenizer.vocab_size))
            atomic_write(path, lambda f: np.save(f, ids, allow_pickle=False))
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
        return cls(ids, tokenizer.vocab_size, val_fraction=val_fraction, seed=seed)

    def _split(self, split: str) -> np.ndarray:
        if split == "train":
            return self.tokens[: self.n_train]
        if split == "val":
            return self.tokens[self.n_train :]
        raise ValueError(f"unknown split {split!r}; allowed: train, val")

    def _check_len(self, data: np.ndarray, split: str, seq_len: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if len(data) < seq_len + 1:
            raise DataError(
                f"corpus too short: the {split} split has {len(data)} tokens, a sequence of "
                f"{seq_len} needs at least {seq_len + 1}; use a longer text or a shorter seq_len"
            )

    def samples_per_epoch(self, seq_len: int) -> int:
        """How many samples one epoch of the stream holds: windows of ``seq_len + 1`` tokens
        starting every ``seq_len`` tokens of the train split (a window's last token, a target,
        is the next window's first input), the tail that makes no whole window left out."""
        self._check_len(self._split("train"), "train", seq_len)
        return (self.n_train - 1) // seq_len

    def sample_indices(self, start: int, count: int, seq_len: int) -> np.ndarray:
        """Which windows samples ``start .. start + count - 1`` of the stream are: int64
        ``[count]`` in ``[0, samples_per_epoch)``; sample ``k`` is in epoch ``k // n`` at its
        position ``k % n`` of that epoch's permutation (seeded by the dataset's seed and the
        epoch)."""
        if start < 0 or count < 0:
            raise ValueError(f"need start >= 0 and count >= 0, got {start}, {count}")
        n = self.samples_per_epoch(seq_len)
        epochs, positions = np.divmod(np.arange(start, start + count, dtype=np.int64), n)
        windows = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            windows[mask] = _epoch_order(self.seed, int(epoch), n)[positions[mask]]
        return windows

    def samples(self, start: int, count: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``start .. start + count - 1`` of the stream as (x, y), int64 tensors of
        shape [count, seq_len], ``y`` shifted by one token."""
        starts = self.sample_indices(start, count, seq_len) * seq_len
        return self._windows(self._split("train"), starts, seq_len)

    def stream_batch(
        self, position: int, rank: int, batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s share of the global batch that starts at sample ``position`` of the
        stream: its ``batch_size`` consecutive samples after those of the lower ranks. The global
        batch is samples ``position .. position + world * batch_size - 1`` whatever the split."""
        if rank < 0 or batch_size <= 0:
            raise ValueError(f"need rank >= 0 and batch_size > 0, got {rank}, {batch_size}")
        return self.samples(position + rank * batch_size, batch_size, seq_len)

    def batch(
        self,
        step: int,
        rank: int,
        world_size: int,
        batch_size: int,
        seq_len: int,
        split: str = "train",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``rank`` at ``step``: (x, y), int64 tensors of shape [batch_size, seq_len].

        ``y`` is ``x`` shifted by one token (the next-token targets). Window starts are drawn
        uniformly from the split with a generator seeded by (seed, step, rank).
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if step < 0 or batch_size <= 0:
            raise ValueError(f"need step >= 0 and batch_size > 0, got {step}, {batch_size}")
        data = self._split(split)
        self._check_len(data, split, seq_len)
        # SeedSequence mixes the three integers: independent streams per (seed, step, rank).
        rng = np.random.default_rng([self.seed, step, rank, 0 if split == "train" else 1])
        starts = rng.integers(0, len(data) - seq_len, size=batch_size)
        return self._windows(data, starts, seq_len)

    def val_batches(
        self, n_batches: int, batch_size: int, seq_len: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed set of validation batches, the same on every rank and every call.

        Yields ``n_batches`` pairs (x, y) of int64 [batch_size, seq_len]; the windows are evenly
        spaced over the validation split.
        """
        if n_batches <= 0 or batch_size <= 0:
            raise ValueError(
                f"need n_batches > 0 and batch_size > 0, got {n_batches}, {batch_size}"
            )
        data = self._split("val")
        self._check_len(data, "val", seq_len)
        starts = np.linspace(0, len(data) - seq_len - 1, n_batches * batch_size).round()
        starts = starts.astype(np.int64).reshape(n_batches, batch_size)
        for row in starts:
            yield self._windows(data, row, seq_len)

    @staticmethod
    def _windows(
        data: np.ndarray, starts: np.ndarray, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(seq_len + 1)
        w = torch.from_numpy(data[idx].astype(np.int64))  # [B, seq_len + 1]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------------
# Helpers


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    # Cached: every step of an epoch reads the same permutation (8 bytes a sample).
    order = np.random.default_rng([seed, epoch, 2]).permutation(n)
    order.flags.writeable = False
    return order


def _id_dtype(vocab_size: int) -> type:
    # Half the memory of int32 for any vocabulary up to 65 536 ids.
    return np.uint16 if vocab_size <= 1 << 16 else np.int32


def _as_int_list(ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1).tolist()
    return np.asarray(ids).reshape(-1).tolist()


def _check_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")


def _sha256(text: str, salt: str) -> str:
    h = hashlib.sha256(salt.encode("utf-8") + b"\0")
    h.update(text.encode("utf-8"))
    return h.hexdigest()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))
