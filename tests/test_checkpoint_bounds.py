"""A checkpoint stays inside its directory: a ``.metadata`` naming a file outside it is refused
before any read; and a short read (network or FUSE file systems) is read on, never called damage."""

from __future__ import annotations

import os
import pickle
import random

import pytest
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from qsdp.train.block_digest import BLOCK, BlockDigest, file_block_digest
from qsdp.train.plain_data import PlainDataReader, UnsafeItem

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("relative_path", ["../other_run/__0_0.distcp", "/etc/passwd", "sub/../../x.distcp"])
def test_a_metadata_naming_a_file_outside_its_checkpoint_is_refused_before_any_read(relative_path, tmp_path):
    metadata = Metadata(state_dict_metadata={},
                        storage_data={MetadataIndex("model.w", (0,)): _StorageInfo(relative_path, 0, 16)})
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeItem) as e:
        PlainDataReader(str(tmp_path)).read_metadata()
    assert str(e.value) == (f".metadata names a file outside its checkpoint directory ({relative_path!r}); refused "
                            "before any read: DCP's files lie in the checkpoint itself")


def test_a_metadata_naming_files_inside_its_checkpoint_is_read(tmp_path):
    metadata = Metadata(state_dict_metadata={},
                        storage_data={MetadataIndex("model.w", (0,)): _StorageInfo("__0_0.distcp", 0, 16)})
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    assert PlainDataReader(str(tmp_path)).read_metadata().storage_data == metadata.storage_data


def test_short_reads_are_read_on_and_give_the_file_digest(tmp_path, monkeypatch):
    """A file system that returns at most 1000 bytes a read, as network and FUSE ones may."""
    data = random.Random(5).randbytes(5 * BLOCK + 77)
    (tmp_path / "f").write_bytes(data)
    real = os.preadv

    def short_preadv(fd, buffers, offset):
        return real(fd, [memoryview(buffers[0])[:1000]], offset)

    monkeypatch.setattr(os, "preadv", short_preadv)
    digest = BlockDigest(len(data))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert digest.fill(fd)
    finally:
        os.close(fd)
    assert digest.hexdigest() == file_block_digest(tmp_path / "f")[0]


def test_a_file_shorter_than_its_size_is_still_found(tmp_path):
    data = random.Random(6).randbytes(3 * BLOCK)
    (tmp_path / "f").write_bytes(data)
    digest = BlockDigest(len(data) + 10)  # the size at save: the file has lost its end since
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert not digest.fill(fd)
    finally:
        os.close(fd)
