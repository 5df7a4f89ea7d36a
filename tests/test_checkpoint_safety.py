"""A checkpoint load never runs code from the checkpoint, never leaves one rank raising while the
others wait, and reports only damage and bad input as a CheckpointError; a save onto storage the
ranks do not share is refused at once, naming the rank and the path."""

from __future__ import annotations

import errno
import json
import pickle
import re

import pytest
import torch

import qsdp
import fsdp_models as fm
from distributed import run_world
from qsdp.train.args import USER_ERRORS
from qsdp.train.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    step_dirname,
)
from qsdp.train.integrity import ALGORITHM, DIGEST_FILE, file_digest, read_digests

pytestmark = pytest.mark.timeout(240)
CPU = torch.device("cpu")


class Payload:
    """Unpickled, it creates the file ``marker``: proof that the load ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _build():
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit")
    return model, handle, torch.optim.Adam(model.parameters(), lr=1e-2)


def _save(rank, world, out, poison=None, marker=None):
    """One training step, then the checkpoint of step 1; ``poison``: which item of it becomes a
    pickle that runs code (written as a checkpoint from an untrusted source would be)."""
    import qsdp.train.checkpoint as ckpt

    model, handle, opt = _build()
    x, y = fm.batch(0, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    if poison is not None:  # written as by another writer: qsdp's save would refuse it (test_checkpoint_save_items)
        ckpt.unsavable_item = lambda state: None
    if poison == "param_group":
        opt.param_groups[0]["lr"] = Payload(marker)
    if poison == "rank_blob":
        ckpt._rank_blob = lambda handles: Payload(marker)  # in this forked rank only
    save_checkpoint(out, 1, model, opt, handle, meta={})


def _load(rank, world, path, paths=None):
    """Load into a fresh model; the CheckpointError's message, or the error's type and message."""
    model, handle, opt = _build()
    try:
        load_checkpoint(paths[rank] if paths else path, model, opt, handle, CPU)
        return None
    except CheckpointError as e:
        return str(e)


def _rewrite_digests(step):
    digests = read_digests(step)
    for name in digests["files"]:
        digest, size = file_digest(step / name)
        digests["files"][name] = {ALGORITHM: digest, "bytes": size}
    (step / DIGEST_FILE).write_text(json.dumps(digests))


@pytest.mark.parametrize("poison", ["param_group", "rank_blob", "metadata"])
def test_a_poisoned_item_is_refused_and_its_code_never_runs(poison, tmp_path):
    """Each kind of non-tensor item DCP would unpickle in full: an optimizer param_groups entry,
    the wrapper of a rank blob, the .metadata file; the digests match (a consistent rewrite)."""
    marker = tmp_path / "the checkpoint ran code"
    out = tmp_path / "run"
    run_world(_save, 2, str(out), poison if poison != "metadata" else None, str(marker), timeout=120)
    step = out / CHECKPOINT_DIR / step_dirname(1)
    if poison == "metadata":
        (step / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
        _rewrite_digests(step)
    assert not marker.exists()
    messages = run_world(_load, 2, str(step), timeout=120)
    assert not marker.exists()
    assert messages[0] == messages[1]  # every rank refuses it, together
    what = {"param_group": r"item optim\.param_groups\.\S+\.lr", "rank_blob": r"item rank_state\.0",
            "metadata": r"\.metadata"}[poison]
    assert messages[0] is not None
    assert re.fullmatch(rf"checkpoint {re.escape(str(step))}: {what} is not plain data \(.*io\.open.*\); "
                        r"refused: unpickling it could run code; no earlier complete checkpoint is left",
                        messages[0]), messages[0]


def _save_apart(rank, world, base):
    """Each rank saves into a root of its own: storage the ranks do not share."""
    model, handle, opt = _build()
    try:
        save_checkpoint(f"{base}/rank{rank}", 1, model, opt, handle, meta={})
        return None
    except CheckpointError as e:
        return str(e)


def test_a_save_onto_storage_the_ranks_do_not_share_is_refused_naming_the_rank_and_path(tmp_path):
    messages = run_world(_save_apart, 2, str(tmp_path), timeout=120)
    wrote = tmp_path / "rank1" / CHECKPOINT_DIR / (step_dirname(1) + ".tmp") / "__1_0.distcp"
    assert messages == [f"the checkpoint's storage is not shared: rank 0 does not "
                        f"see __1_0.distcp, which rank 1 wrote into {wrote}; every rank must save into one directory "
                        "that all of them share (--out on a file system every node mounts)"] * 2
    # Nothing is named a checkpoint, nothing is left behind on either rank's storage.
    assert sorted(p.name for p in (tmp_path / "rank0" / CHECKPOINT_DIR).iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "rank1" / CHECKPOINT_DIR).iterdir()) == []


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run directory with the complete checkpoint of step 1 (2 ranks)."""
    out = tmp_path_factory.mktemp("saved")
    run_world(_save, 2, str(out), timeout=120)
    return out / CHECKPOINT_DIR / step_dirname(1)


def test_a_checkpoint_one_rank_does_not_see_makes_every_rank_raise_together(saved, tmp_path):
    """Rank 1's storage lacks the checkpoint: both ranks raise its error at once, rank 0 does not
    wait in the digests' all-reduce for the process group's timeout."""
    unseen = tmp_path / CHECKPOINT_DIR / step_dirname(1)
    messages = run_world(_load, 2, None, [str(saved), str(unseen)], timeout=60, pg_timeout=30)
    assert messages == [f"rank 1: checkpoint {unseen} does not exist; no earlier complete checkpoint is left"] * 2


def _load_with_io_error_on_rank_1(rank, world, path):
    """Rank 1's reads of the checkpoint fail as a failing disk's would (EIO)."""
    from qsdp.train.plain_data import PlainDataReader

    if rank == 1:
        def read_data(self, plan, planner):
            raise OSError(errno.EIO, "Input/output error", str(path))
        PlainDataReader.read_data = read_data
    model, handle, opt = _build()
    try:
        load_checkpoint(path, model, opt, handle, CPU)
    except Exception as e:  # noqa: BLE001 - what the rank raised is the result
        return type(e).__name__, str(e).splitlines()[0], isinstance(e, USER_ERRORS)
    return None


def test_an_io_error_while_loading_keeps_its_type_and_is_no_user_error(saved):
    """Not the checkpoint's fault: the rank whose read failed raises its OSError (a restart
    retries it; a traceback file is written), its peer a PeerLoadError naming it; neither is
    a CheckpointError (which would be final, one line, exit 2)."""
    from qsdp.train.checkpoint import PeerLoadError

    (own, peer) = run_world(_load_with_io_error_on_rank_1, 2, str(saved), timeout=120)[::-1]
    assert own == ("OSError", f"[Errno 5] Input/output error: '{saved}'", False)
    assert peer == (PeerLoadError.__name__, f"cannot load checkpoint {saved}: rank 1: OSError: [Errno 5] "
                                            f"Input/output error: '{saved}'", False)


def test_digests_written_while_saving_are_those_of_the_files(saved):
    listed = read_digests(saved)["files"]
    assert sorted(listed) == sorted(p.name for p in saved.iterdir() if p.name != DIGEST_FILE)
    for name, entry in listed.items():
        digest, size = file_digest(saved / name)
        assert entry == {ALGORITHM: digest, "bytes": size}, name
