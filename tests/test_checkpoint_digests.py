"""The digest of a checkpoint file (xxh3-128-64k): the same whether its bytes are fed front to
back in pieces of any length (at save) or at their offsets in any order (as DCP reads them at
load); at load, each payload is hashed by the rank that reads most of it; without the xxhash
package, saves write SHA-256 digests."""

from __future__ import annotations

import io
import json
import os
import random
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qsdp
import fsdp_models as fm
from distributed import run_world
from prestarted import PRESTARTED, Command
from qsdp.train.block_digest import BLOCK, BlockDigest, SequentialDigest, file_block_digest
from qsdp.train.checkpoint import CHECKPOINT_DIR, save_checkpoint, step_dirname

pytestmark = pytest.mark.timeout(120)

# Sizes around the block boundaries: empty, one byte, one block but a byte, one block, one block
# and a byte, several blocks and a short last one.
SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 77]


@pytest.mark.parametrize("size", SIZES)
def test_pieces_front_to_back_give_the_file_digest(size, tmp_path):
    data = random.Random(size).randbytes(size)
    (tmp_path / "f").write_bytes(data)
    rng, digest, at = random.Random(1), SequentialDigest(), 0
    while at < size:
        n = rng.choice([1, 7, BLOCK - 3, BLOCK, 3 * BLOCK + 5])
        digest.update(data[at:at + n])
        at += n
    assert digest.hexdigest() == file_block_digest(tmp_path / "f")[0]
    assert digest.size == size


def _fill_from(digest: BlockDigest, path) -> None:
    """The blocks no read held whole, read from the file at ``path`` (of the digest's size)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        assert digest.fill(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", SIZES)
def test_reads_at_any_offsets_in_any_order_give_the_file_digest(size, tmp_path):
    """What the reads held whole is hashed from them; the rest is read from the file."""
    data = random.Random(size).randbytes(size)
    (tmp_path / "f").write_bytes(data)
    rng, digest = random.Random(2), BlockDigest(size)
    for _ in range(6):
        at = rng.randrange(size + 1)
        digest.feed(at, data[at:at + rng.choice([3, BLOCK + 9, 4 * BLOCK])])
    _fill_from(digest, tmp_path / "f")
    assert digest.hexdigest() == file_block_digest(tmp_path / "f")[0]


def test_reads_that_held_every_block_whole_leave_nothing_to_read_again():
    data = random.Random(3).randbytes(3 * BLOCK + 10)
    digest = BlockDigest(len(data))
    digest.feed(2 * BLOCK, data[2 * BLOCK:])  # the last two blocks, the short one included
    digest.feed(0, data[:2 * BLOCK])
    assert digest.missing_bytes() == 0


def test_a_read_ending_inside_a_block_hashes_only_the_blocks_before_it(tmp_path):
    """A read from a block's start to the middle of a later block (an item's end inside the file):
    the blocks it holds whole are hashed, the one it ends in is left to be read again."""
    data = random.Random(4).randbytes(4 * BLOCK)
    (tmp_path / "f").write_bytes(data)
    digest = BlockDigest(len(data))
    digest.feed(BLOCK, data[BLOCK:3 * BLOCK + 5])
    assert digest.missing_bytes() == 2 * BLOCK
    _fill_from(digest, tmp_path / "f")
    assert digest.hexdigest() == file_block_digest(tmp_path / "f")[0]


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 6 * BLOCK), reads=st.lists(st.tuples(st.integers(0, 6 * BLOCK), st.integers(0, 3 * BLOCK)),
                                                      max_size=8))
def test_any_reads_then_the_rest_give_the_file_digest(size, reads, tmp_path_factory):
    """Reads at any offsets, of any lengths (overlapping, past the end, block-aligned or not),
    then the blocks none held whole read from the file: always the file's digest, and
    ``missing_bytes`` is what was read again."""
    data = random.Random(size).randbytes(size)
    path = tmp_path_factory.mktemp("f") / "f"
    path.write_bytes(data)
    digest = BlockDigest(size)
    for at, n in reads:
        digest.feed(at, data[at:at + n])
    missing = digest.missing_bytes()
    _fill_from(digest, path)
    assert digest.missing_bytes() == 0
    assert digest.hexdigest() == file_block_digest(path)[0]
    held = set()
    for at, n in reads:
        end = min(at + n, size)
        held |= {i for i in range(-(-at // BLOCK), digest.count) if min((i + 1) * BLOCK, size) <= end}
    assert missing == sum(min(BLOCK, size - i * BLOCK) for i in range(digest.count) if i not in held)


def test_a_file_shorter_than_its_listed_size_is_found(tmp_path):
    (tmp_path / "f").write_bytes(bytes(BLOCK))
    digest = BlockDigest(BLOCK + 1)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert digest.fill(fd) is False
    finally:
        os.close(fd)


def _save(rank, world, out):
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = fm.batch(0, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    save_checkpoint(out, 1, model, opt, handle, meta={})


def _owners(rank, world, path):
    """Load the model's weights through the reader; what this rank hashed, and its verdict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from qsdp.train.digest_reader import DigestingReader
    from qsdp.train.integrity import hashed_while_loading, read_digests
    from qsdp.train.plain_data import PlainDataLoadPlanner

    model = fm.build(seed=5)
    qsdp.quantize_comms(model, "sdp4bit")
    digests = read_digests(path)
    reader = DigestingReader(path, {n: digests["files"][n] for n in hashed_while_loading(digests)})
    dcp.load({"model": get_model_state_dict(model)}, storage_reader=reader, planner=PlainDataLoadPlanner())
    return reader.owned, reader.bad


def test_each_payload_is_hashed_by_the_rank_that_reads_most_of_it(tmp_path):
    """Loaded on the layout that saved it, rank r reads its own shards from __r_0.distcp: it
    hashes that file as it reads it, and nothing else."""
    run_world(_save, 2, str(tmp_path), timeout=90)
    step = tmp_path / CHECKPOINT_DIR / step_dirname(1)
    assert run_world(_owners, 2, str(step), timeout=90) == [(["__0_0.distcp"], None), (["__1_0.distcp"], None)]


# In a fresh interpreter (run ahead of its test) where xxhash cannot be imported, as where the
# package is not installed: what a save writes, and what reading an xxh3 list says.
_WITHOUT_XXHASH = textwrap.dedent("""
    import json, sys, tempfile
    sys.modules["xxhash"] = None  # what import finds where the package is not installed
    from qsdp.train.integrity import WRITTEN, read_digests
    print(WRITTEN)
    with tempfile.TemporaryDirectory() as folder:
        with open(folder + "/digests.json", "w") as f:
            json.dump({"algorithm": "xxh3-128-64k", "files": {}}, f)
        try:
            read_digests(folder)
        except ValueError as e:
            print(e)
""")


WITHOUT_XXHASH = Command.python("-c", _WITHOUT_XXHASH, cwd=os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.prestart(lambda: WITHOUT_XXHASH)
def test_without_xxhash_a_save_writes_sha256_and_an_xxh3_list_names_the_package(request):
    """An install without dependencies: digests stay verifiable, the one that cannot be says why."""
    rc, printed = PRESTARTED.result(request.node.nodeid, WITHOUT_XXHASH, timeout=100)
    assert rc == 0 and printed.splitlines() == [
        "sha256", "digests.json lists xxh3-128-64k digests, which need the xxhash package: pip install xxhash"], printed


def _written(tmp_path, writes):
    """Each item of ``writes`` (bytes-like, or ``("seek", offset)``) through a digesting writer's
    stream into one file: what the writer lists for it, and the file's digest read back."""
    from qsdp.train.digest_writer import DigestingWriter

    writer = DigestingWriter(tmp_path)
    with writer.fs.create_stream(tmp_path / "f", "wb") as stream:
        for item in writes:
            if isinstance(item, tuple):
                stream.seek(item[1])
            else:
                stream.write(item)
    digest, size = file_block_digest(tmp_path / "f")
    return writer.digests["f"], {"xxh3-128-64k": digest, "bytes": size}


def test_what_the_writer_lists_is_the_digest_of_the_file_it_wrote(tmp_path):
    """Writes of any length, the large ones split into pieces as they are hashed, and views of
    tensors of any dtype (torch.save hands the writer the storage's bytes)."""
    rng = random.Random(3)
    writes = [rng.randbytes(n) for n in (0, 1, 7, BLOCK - 3, 3 * BLOCK + 5)]
    writes += [memoryview(torch.arange(3 << 18, dtype=torch.float32).numpy()), rng.randbytes((2 << 20) + 11)]
    listed, read_back = _written(tmp_path, writes)
    assert listed == read_back
    assert listed["bytes"] == sum(memoryview(w).nbytes for w in writes)


def test_a_stream_moved_while_written_is_listed_with_the_digest_of_the_file(tmp_path):
    """A write after a seek overwrites bytes already hashed: the file is hashed again at close."""
    listed, read_back = _written(tmp_path, [bytes(3 * BLOCK), ("seek", BLOCK + 1), b"\xff" * 10])
    assert listed == read_back and listed["bytes"] == 3 * BLOCK


class _TakesPart(io.BytesIO):
    """A file object that takes at most ``most`` bytes a write, as an OS may."""

    def __init__(self, most: int) -> None:
        super().__init__()
        self.most = most

    def write(self, data) -> int:
        return super().write(memoryview(data)[:self.most])


def test_a_write_the_file_takes_in_part_is_written_on_and_hashed_whole():
    from qsdp.train.digest_writer import PIECE, write_in_pieces

    data = random.Random(4).randbytes(PIECE + 5000)
    raw, pieces = _TakesPart(3000), []
    assert write_in_pieces(raw, data, lambda piece: pieces.append(bytes(piece))) == len(data)
    assert raw.getvalue() == data and b"".join(pieces) == data and len(pieces) == 2
