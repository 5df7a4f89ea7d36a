"""A checkpoint is verified before it is trusted: every file against the digest written at save
(a list of either algorithm: xxh3-128-64k, or the sha256 of qsdp before it), the loaded state
for finite values, the rank blobs as plain data; rotation keeps the newest
checkpoint saved with a finite state; a checkpoint that cannot be used is one line naming the
file and the previous complete checkpoint."""

from __future__ import annotations

import io
import json
import math
import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import qsdp
import fsdp_models as fm
from distributed import run_world
from qsdp.train.checkpoint import (
    CHECKPOINT_DIR,
    LATEST_FILE,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    named_checkpoint,
    save_checkpoint,
    step_dirname,
)
from qsdp.train.integrity import ALGORITHM, DIGEST_FILE, file_digest, read_digests

pytestmark = pytest.mark.timeout(240)
CPU = torch.device("cpu")


def _train(model, opt, first, count, rank):
    for step in range(first, first + count):
        x, y = fm.batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _save_run(rank, world, out, poison_after):
    """Checkpoints of steps 1, 2, 3 (keep 2), a training step before each; from step
    ``poison_after`` on, no more training and one weight NaN."""
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in (1, 2, 3):
        if poison_after is None or step < poison_after:
            _train(model, opt, step - 1, 1, rank)
        if step == poison_after:
            with torch.no_grad():
                model.blocks[0].fc1.weight.to_local().fill_(float("nan"))
        save_checkpoint(out, step, model, opt, handle, meta={"mine": step}, keep=2)


def _load(rank, world, path):
    model = fm.build(seed=5)
    handle = qsdp.quantize_comms(model, "sdp4bit")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        return load_checkpoint(path, model, opt, handle, CPU)
    except CheckpointError as e:
        return str(e)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A run directory with the complete checkpoints of steps 2 and 3 (2 ranks)."""
    out = tmp_path_factory.mktemp("good")
    run_world(_save_run, 2, str(out), None, timeout=120)
    return out


def _copy(good, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(good, out)
    return out


def _flip_a_byte_inside_a_weight(step_dir, file_prefix="__1_"):
    """Flip the lowest bit of one float of a model weight inside its .distcp payload (the
    value changes by one unit in the last place; the file keeps its size). Returns the file."""
    metadata = FileSystemReader(str(step_dir)).read_metadata()
    index, info = next((i, s) for i, s in metadata.storage_data.items()
                       if i.fqn.startswith("model.") and i.fqn.endswith("weight")
                       and s.relative_path.startswith(file_prefix))
    path = step_dir / info.relative_path
    data = bytearray(path.read_bytes())
    item = bytes(data[info.offset:info.offset + info.length])
    values = torch.load(io.BytesIO(item), weights_only=True).numpy().tobytes()
    at = info.offset + item.index(values) + 4 * 3  # the 4th float's least significant byte
    data[at] ^= 1
    size = path.stat().st_size
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size
    return path


def test_a_byte_flipped_inside_a_payload_is_refused_naming_the_file_and_the_previous_checkpoint(good, tmp_path):
    out = _copy(good, tmp_path)
    step3 = out / CHECKPOINT_DIR / step_dirname(3)
    damaged = _flip_a_byte_inside_a_weight(step3)
    for message in run_world(_load, 2, str(step3), timeout=90):
        assert message == (f"checkpoint {step3} is damaged: {damaged.name} does not match its digest ({ALGORITHM}) "
                           "written at save; the previous complete checkpoint is step_00000002 "
                           "(qsdp train: --resume-from step_00000002)")
    # The one it names loads.
    assert [m["mine"] for m in run_world(_load, 2, str(named_checkpoint(out, "step_00000002")), timeout=90)] == [2, 2]


def _as_sha256(step):
    """Rewrite ``digests.json`` as qsdp wrote it before xxh3-128-64k: the SHA-256 of every file."""
    digests = read_digests(step)
    digests["algorithm"] = "sha256"
    digests["files"] = {name: {"sha256": file_digest(step / name, "sha256")[0], "bytes": entry["bytes"]}
                        for name, entry in digests["files"].items()}
    (step / DIGEST_FILE).write_text(json.dumps(digests))


def _load_each(rank, world, paths):
    return [_load(rank, world, path) for path in paths]


@pytest.mark.parametrize("algorithm", [ALGORITHM, "sha256"])
def test_a_byte_flipped_anywhere_in_any_file_is_refused_naming_it(good, tmp_path, algorithm):
    """Each payload at its first byte, a byte DCP's reads skip (inside the first zip entry's
    header), its middle and its last byte, each other file at its middle: refused on every rank,
    naming the file, whether the payloads are hashed while DCP reads them (xxh3-128-64k) or
    before the load (sha256)."""
    source = good / CHECKPOINT_DIR / step_dirname(3)
    cases = []
    for name in sorted(p.name for p in source.iterdir() if p.name != DIGEST_FILE):
        size = (source / name).stat().st_size
        for at in sorted({0, 40, size // 2, size - 1} if name.endswith(".distcp") else {size // 2}):
            copy = tmp_path / f"{name}@{at}" / step_dirname(3)
            shutil.copytree(source, copy)
            if algorithm == "sha256":
                _as_sha256(copy)
            data = bytearray((copy / name).read_bytes())
            data[at] ^= 0xFF
            (copy / name).write_bytes(bytes(data))
            cases.append((copy, name))
    expected = [f"checkpoint {copy} is damaged: {name} does not match its digest ({algorithm}) written at save; "
                "no earlier complete checkpoint is left" for copy, name in cases]
    assert run_world(_load_each, 2, [str(copy) for copy, _ in cases], timeout=120) == [expected, expected]


def test_a_damaged_payload_is_refused_when_loaded_on_another_number_of_ranks(good, tmp_path):
    """Saved by 2 ranks, loaded by 1: it reads both payloads but not every byte (the other
    rank's blob, zip headers); a byte flipped in the middle of each is found all the same."""
    source = good / CHECKPOINT_DIR / step_dirname(3)
    cases = []
    for name in ("__0_0.distcp", "__1_0.distcp"):
        copy = tmp_path / name / step_dirname(3)
        shutil.copytree(source, copy)
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (copy / name).write_bytes(bytes(data))
        cases.append((copy, name))
    assert run_world(_load_each, 1, [str(copy) for copy, _ in cases], timeout=90) == [[
        f"checkpoint {copy} is damaged: {name} does not match its digest ({ALGORITHM}) written at save; "
        "no earlier complete checkpoint is left" for copy, name in cases]]


def test_a_checkpoint_whose_digests_are_sha256_loads(good, tmp_path):
    """What qsdp wrote before xxh3-128-64k still loads, verified."""
    out = _copy(good, tmp_path)
    step3 = out / CHECKPOINT_DIR / step_dirname(3)
    _as_sha256(step3)
    assert [m["mine"] for m in run_world(_load, 2, str(step3), timeout=90)] == [3, 3]


@pytest.mark.parametrize("algorithm", [ALGORITHM, "sha256"])
def test_a_file_the_digest_list_leaves_out_is_refused_even_when_it_is_damaged(good, tmp_path, algorithm):
    out = _copy(good, tmp_path)
    step3 = out / CHECKPOINT_DIR / step_dirname(3)
    if algorithm == "sha256":
        _as_sha256(step3)
    damaged = _flip_a_byte_inside_a_weight(step3)
    digests = json.loads((step3 / DIGEST_FILE).read_text())
    del digests["files"][damaged.name]  # as anyone who can write the folder can
    (step3 / DIGEST_FILE).write_text(json.dumps(digests))
    for message in run_world(_load, 2, str(step3), timeout=90):
        assert message == (f"checkpoint {step3} is damaged: {damaged.name} is not listed in {DIGEST_FILE}, which "
                           "lists every file of a checkpoint; the previous complete checkpoint is step_00000002 "
                           "(qsdp train: --resume-from step_00000002)")


def test_a_rank_blob_that_would_run_code_is_refused(tmp_path, monkeypatch):
    """A checkpoint from an untrusted source whose rank blob is a pickle that calls ``open``
    (digests rewritten to match: a consistent rewrite is not detected) is refused when the
    blob is read, and the code never runs."""
    import qsdp.train.checkpoint as ckpt

    marker = tmp_path / "the blob ran code"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    def evil_blob(handle):
        buf = io.BytesIO()
        torch.save({"comms": Evil(), "rng": {}}, buf)
        return buf.getvalue()

    monkeypatch.setattr(ckpt, "_rank_blob", evil_blob)  # the forked rank writes the untrusted checkpoint
    run_world(_save_one, 1, str(tmp_path / "run"), timeout=90)
    monkeypatch.undo()
    step = tmp_path / "run" / CHECKPOINT_DIR / step_dirname(1)
    for message in run_world(_load, 1, str(step), timeout=90):
        assert message == (f"checkpoint {step}: its rank blob is not plain data (Unsupported global: GLOBAL io.open); "
                           "refused: unpickling it could run code; no earlier complete checkpoint is left")
    assert not marker.exists()


def _save_one(rank, world, out):
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 0, 1, rank)
    save_checkpoint(out, 1, model, opt, handle, meta={})


def test_rotation_keeps_the_newest_checkpoint_saved_with_finite_state(tmp_path):
    """Steps 1, 2, 3 with keep 2, a weight NaN from step 2 on: step 1, the newest whose state
    was finite, stays beside the newest two; loading step 3 names the NaN tensor and step 1."""
    out = tmp_path / "run"
    run_world(_save_run, 1, str(out), 2, timeout=120)
    root = out / CHECKPOINT_DIR
    assert sorted(p.name for p in root.iterdir()) == [LATEST_FILE, "step_00000001", "step_00000002",
                                                      "step_00000003"]
    assert [read_digests(root / step_dirname(s))["state_finite"] for s in (1, 2, 3)] == [True, False, False]
    step3 = root / step_dirname(3)
    for message in run_world(_load, 1, str(step3), timeout=90):
        assert message == (f"checkpoint {step3} holds non-finite values (rank 0: blocks.0.fc1.weight); the "
                           "previous complete checkpoint is step_00000001 (qsdp train: --resume-from step_00000001)")


def test_a_latest_naming_a_missing_directory_names_the_previous_complete_checkpoint(good, tmp_path):
    out = _copy(good, tmp_path)
    shutil.rmtree(out / CHECKPOINT_DIR / step_dirname(3))
    latest = out / CHECKPOINT_DIR / LATEST_FILE
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(out)
    assert str(e.value) == (f"{latest} names step_00000003, which does not exist; the previous complete "
                            "checkpoint is step_00000002 (qsdp train: --resume-from step_00000002)")


def test_a_missing_latest_beside_complete_checkpoints_names_the_newest(good, tmp_path):
    out = _copy(good, tmp_path)
    root = out / CHECKPOINT_DIR
    (root / LATEST_FILE).unlink()
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(out)
    assert str(e.value) == (f"{root / LATEST_FILE} is missing, but {root} holds complete checkpoints "
                            "(newest step_00000003): resume from it with --resume-from step_00000003")


def test_an_incomplete_checkpoint_names_the_previous_complete_one(good, tmp_path):
    out = _copy(good, tmp_path)
    step3 = out / CHECKPOINT_DIR / step_dirname(3)
    (step3 / DIGEST_FILE).unlink()
    for message in run_world(_load, 2, str(step3), timeout=90):  # every rank raises it, together
        assert message == (f"checkpoint {step3} is incomplete: {DIGEST_FILE} is missing; the previous complete "
                           "checkpoint is step_00000002 (qsdp train: --resume-from step_00000002)")


def test_a_checkpoint_of_the_earlier_format_is_refused_in_one_line(good, tmp_path):
    """A checkpoint whose comms.json has no format (qsdp before the optimizer state was keyed by
    parameter; digests rewritten to match) is refused on every rank before DCP reads a key."""
    out = _copy(good, tmp_path)
    step3 = out / CHECKPOINT_DIR / step_dirname(3)
    comms = json.loads((step3 / "comms.json").read_text())
    del comms["format"]
    (step3 / "comms.json").write_text(json.dumps(comms))
    digests = read_digests(step3)
    digest, size = file_digest(step3 / "comms.json")
    digests["files"]["comms.json"] = {ALGORITHM: digest, "bytes": size}
    (step3 / DIGEST_FILE).write_text(json.dumps(digests))
    for message in run_world(_load, 2, str(step3), timeout=90):
        assert message == (f"checkpoint {step3} is in checkpoint format 1, this qsdp reads format 2 (optimizer "
                           "state keyed by parameter): resume it with the qsdp that wrote it")


def test_digests_cover_every_file_of_a_checkpoint(good):
    step3 = good / CHECKPOINT_DIR / step_dirname(3)
    listed = read_digests(step3)["files"]
    assert sorted(listed) == sorted(p.name for p in step3.iterdir() if p.name != DIGEST_FILE)
    assert {".metadata", "trainer.json", "comms.json", "__0_0.distcp", "__1_0.distcp"} <= set(listed)
    assert all(entry["bytes"] == (step3 / name).stat().st_size for name, entry in listed.items())


def test_the_counters_maximum_is_stored_once_beside_one_blob_a_rank(good):
    """comms.json holds the layout and every counter's maximum over the ranks, each "changed"
    flag set (what a resume on another layout continues from, reading no rank blob)."""
    step3 = good / CHECKPOINT_DIR / step_dirname(3)
    comms = json.loads((step3 / "comms.json").read_text())
    assert comms["layout"] == {"world_size": 2, "shard_group": 2, "replicas": 1}
    assert [g["calls"] for g in comms["continued"]["reduce_scatter"].values()] == [3, 3, 3]  # 3 steps
    assert all(g["changed"] is True for g in comms["continued"]["all_gather"].values())
    keys = FileSystemReader(str(step3)).read_metadata().state_dict_metadata
    assert sorted(k for k in keys if k.startswith("rank_state.")) == ["rank_state.0", "rank_state.1"]


def test_a_fresh_run_refuses_a_directory_holding_checkpoints_without_latest(good, tmp_path):
    """Its rotation would remove them: the directory holds a run even without `latest`."""
    from qsdp.train.args import TrainArgs, TrainError
    from qsdp.train.preflight import check_out_dir

    out = _copy(good, tmp_path)
    (out / CHECKPOINT_DIR / LATEST_FILE).unlink()
    with pytest.raises(TrainError) as e:
        check_out_dir(TrainArgs(out=str(out)))
    assert str(e.value) == (f"--out {out} already holds a run (checkpoints/step_00000003); pass --resume to "
                            "continue it or choose another --out")
