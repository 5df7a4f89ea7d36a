"""Reading a DCP checkpoint without running code from it.

DCP unpickles two things with a full unpickler: the ``.metadata`` file
(``FileSystemReader.read_metadata``) and every non-tensor item (``DefaultLoadPlanner.load_bytes``:
``torch.load(weights_only=False)``): the rank blob's wrapper, each optimizer ``param_groups``
entry. Anyone who can write the checkpoint directory (and rewrite ``digests.json`` to match)
could make a load run a command. Here both go through restricted unpicklers instead:

- :class:`PlainDataReader` reads ``.metadata`` allowing only DCP's own metadata classes,
  ``torch.Size``, dtypes, layouts and paths;
- :class:`PlainDataLoadPlanner` reads each non-tensor item with ``torch.load(weights_only=True)``
  (tensors, numbers, strings, containers).

Anything else is an :class:`UnsafeItem` naming the file or item; nothing of it runs. So is an
item or ``.metadata`` that is no pickle at all (its bytes are in memory: any failure to parse them
is their content's, never an I/O error). Tensor payloads were already read with
``weights_only=True`` by DCP itself.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint._traverse import set_element

__all__ = [
    "UnsafeItem", "PlainDataReader", "PlainDataLoadPlanner", "METADATA_GLOBALS", "METADATA_TORCH", "refusal_reason",
]

# The torch releases whose DCP ``.metadata`` the allowlist below was read from; a newer torch's may
# name a class it lacks: refused naming both versions (a save reads its own back at once).
METADATA_TORCH = "2.11-2.13"
# What DCP's ``.metadata`` pickle names (torch 2.11-2.13): its dataclasses, the enum of memory
# formats, the storage info of the file system writer, and the torch types inside them.
METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


class UnsafeItem(Exception):
    """A checkpoint file or item that is not plain data (unpickling it could run code), or not a
    pickle at all; the message names it and why. (One argument: DCP sends it to every rank.)"""


def _refused(what: str, detail: str) -> UnsafeItem:
    return UnsafeItem(f"{what} is not plain data ({detail}); refused: unpickling it could run code")


def refusal_reason(error: BaseException) -> str:
    """The line of torch's weights-only refusal that names the global (its message goes on at length)."""
    text = str(error)
    m = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\n|$)", text)
    return m.group(1).strip() if m else (text.strip().splitlines() or [type(error).__name__])[0]


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only :data:`METADATA_GLOBALS` and torch dtypes (``torch.float32``...)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def _require_inside(name: str, metadata: Metadata) -> None:
    """Every file the metadata names lies inside the checkpoint's directory: a ``relative_path``
    that is absolute or climbs out (``..``) is refused before anything is read."""
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        parts = PurePosixPath(rel).parts if isinstance(rel, str) else ("..",)
        if not parts or PurePosixPath(rel).is_absolute() or PureWindowsPath(rel).is_absolute() or any(
                p in ("..", ".") or "\\" in p for p in parts):
            raise UnsafeItem(f"{name} names a file outside its checkpoint directory ({str(rel)[:80]!r}); refused "
                             "before any read: DCP's files lie in the checkpoint itself")


class PlainDataReader(FileSystemReader):
    """DCP's file system reader whose ``.metadata`` is read by a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        name = getattr(path, "name", str(path))
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            raise _refused(name, f"{e}, which DCP's metadata of torch {METADATA_TORCH} does not name; this is torch "
                                 f"{torch.__version__}") from None
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - in memory: any other failure is the bytes' own
            raise UnsafeItem(f"{name} cannot be read as DCP metadata ({type(e).__name__}: {e})") from None
        if not isinstance(metadata, Metadata):
            raise UnsafeItem(f"{name} holds a {type(metadata).__name__}, not DCP metadata")
        _require_inside(name, metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class PlainDataLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner reading non-tensor items with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refused(f"item {fqn}", refusal_reason(e)) from None
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - in memory: any other failure is the bytes' own
            raise UnsafeItem(f"item {fqn} cannot be read as a torch.save pickle ({type(e).__name__}: {e})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
