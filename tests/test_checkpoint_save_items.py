"""What a save writes, a load reads: a non-tensor item a load would refuse is stored as plain
data (a numpy scalar as its Python number) or the save is refused naming it, on every rank,
before anything is written; so is a ``meta`` that is not JSON; a ``.metadata`` the restricted
reader does not know is refused naming the torch versions, at load and already at save."""

from __future__ import annotations

import io
import pickle
import re

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

import qsdp
import fsdp_models as fm
from distributed import run_world
from qsdp.train.checkpoint import CHECKPOINT_DIR, CheckpointError, load_checkpoint, save_checkpoint, step_dirname

pytestmark = pytest.mark.timeout(240)
CPU = torch.device("cpu")


def _build():
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit")
    return model, handle, torch.optim.Adam(model.parameters(), lr=1e-2)


def _trained():
    model, handle, opt = _build()
    fm.optimizer_steps(model, opt, 0, 1, torch.distributed.get_rank())
    return model, handle, opt


def _save_then_load(rank, world, out):
    """A numpy cosine schedule's learning rate, saved and loaded back into a fresh optimizer."""
    model, handle, opt = _trained()
    opt.param_groups[0]["lr"] = np.float64(5e-4)
    path = save_checkpoint(out, 1, model, opt, handle, meta={})
    model, handle, opt = _build()
    load_checkpoint(path, model, opt, handle, CPU)
    lr = opt.param_groups[0]["lr"]
    return type(lr).__name__, lr


def test_a_numpy_learning_rate_is_saved_as_a_python_number_and_loads():
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        assert run_world(_save_then_load, 2, out, timeout=120) == [("float", 5e-4)] * 2


class _KeepsABuffer(torch.nn.Module):
    """A module whose extra state is an object a load would refuse (an ``io.BytesIO``)."""

    def get_extra_state(self):
        return io.BytesIO(b"notes")

    def set_extra_state(self, state):
        pass


def _refused_save(rank, world, out, what):
    model, handle, opt = _trained()
    if what == "param_group":
        opt.param_groups[0]["notes"] = io.BytesIO(b"notes")
    if what == "extra_state":
        model.keeps = _KeepsABuffer()
    meta = {"data_position": np.int64(7)} if what == "meta" else {}
    try:
        save_checkpoint(out, 1, model, opt, handle, meta=meta)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what", ["param_group", "extra_state", "meta"])
def test_an_item_a_load_would_refuse_fails_the_save_on_every_rank_before_anything_is_written(what, tmp_path):
    messages = run_world(_refused_save, 2, str(tmp_path), what, timeout=120)
    assert messages[0] == messages[1] and messages[0] is not None, messages
    assert "\n" not in messages[0]
    named = {"param_group": r"item optim\.param_groups\.\S*notes is a _io\.BytesIO",
             "extra_state": r"item model\.keeps\._extra_state is a _io\.BytesIO",
             "meta": r"meta\['data_position'\] is not JSON \(numpy\.int64"}[what]
    assert re.match(rf"cannot save checkpoint step_00000001: {named}", messages[0]), messages[0]
    root = tmp_path / CHECKPOINT_DIR
    assert not root.exists() or sorted(p.name for p in root.iterdir()) == []


def _save_with_a_newer_torch(rank, world, out):
    """DCP of a torch newer than the allowlist's names a class it lacks (here: the allowlist
    lacks one this torch names, in these forked ranks only)."""
    import qsdp.train.plain_data as plain_data

    plain_data.METADATA_GLOBALS = plain_data.METADATA_GLOBALS - {
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")}
    model, handle, opt = _trained()
    try:
        save_checkpoint(out, 1, model, opt, handle, meta={})
    except CheckpointError as e:
        return str(e)
    return None


def test_a_save_whose_metadata_the_restricted_reader_refuses_fails_naming_the_torch_versions(tmp_path):
    messages = run_world(_save_with_a_newer_torch, 2, str(tmp_path), timeout=120)
    assert messages[0] == messages[1] and messages[0] is not None, messages
    assert re.fullmatch(r"rank 0: cannot save checkpoint step_00000001: a load could not read it back: \.metadata is not plain "
                        r"data \(it names torch\.distributed\.checkpoint\.metadata\.TensorStorageMetadata, which "
                        rf"DCP's metadata of torch 2\.11-2\.13 does not name; this is torch {re.escape(torch.__version__)}"
                        r"\); refused: unpickling it could run code", messages[0]), messages[0]
    root = tmp_path / CHECKPOINT_DIR
    assert sorted(p.name for p in root.iterdir()) == []  # no .tmp, no checkpoint


class NewerStorageMetadata:
    """Stands for a metadata class a newer torch's DCP adds."""


def test_metadata_of_a_newer_torch_is_refused_at_load_naming_the_versions(tmp_path):
    from qsdp.train.plain_data import PlainDataReader, UnsafeItem

    newer = NewerStorageMetadata.__module__, NewerStorageMetadata.__qualname__
    (tmp_path / ".metadata").write_bytes(pickle.dumps(dcp_metadata.Metadata(
        state_dict_metadata={}, storage_data={"x": NewerStorageMetadata()})))
    with pytest.raises(UnsafeItem) as e:
        PlainDataReader(str(tmp_path)).read_metadata()
    assert str(e.value) == (f".metadata is not plain data (it names {newer[0]}.{newer[1]}, which DCP's metadata of torch "
                            f"2.11-2.13 does not name; this is torch {torch.__version__}); refused: unpickling it "
                            "could run code")
