"""End to end: the training job on real process groups, metrics, summary, checkpoints, resume.

Most runs call ``train_worker`` in a forked gloo world (``run_pooled``: a world kept from one
test to the next); two go through the real command line with ``--nproc 2`` (the elastic
launcher, workers forked from the session's fork server), and one through the torchrun path (``qsdp.cli.main`` inside an initialized world).
"""

from __future__ import annotations

import math
import shutil

import pytest

from distributed import run_pooled, run_world
from qsdp.train.checkpoint import CHECKPOINT_DIR, LATEST_FILE, latest_checkpoint, read_meta
from qsdp.train.loop import TrainArgs, train_worker
from qsdp.train.metrics import read_metrics, read_summary

PRESETS = ("fsdp", "qsdp", "sdp4bit", "zeropp")
TRAIN_FIELDS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "wire_bytes_total"}
SUMMARY_FIELDS = {"config", "final_val_loss", "final_train_loss", "wire", "wire_bytes_total", "steps",
                  "wall_time_s", "median_step_time_s", "world_size", "torch_version", "device"}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qsdp-cache"))


def _args(out, corpus, **kw) -> TrainArgs:
    base = dict(out=str(out), data=corpus, model="tiny", steps=8, batch_size=4, seq_len=32,
                lr=3e-3, eval_every=0, eval_batches=2, ckpt_every=0, progress=False)
    return TrainArgs(**{**base, **kw})


def _worker(rank, world, args):
    return train_worker(args)


def train(args, world=2, lws=None, timeout=120, patched=False):
    """``patched``: ranks forked at the call (run_world), which see the test's monkeypatches."""
    run = run_world if patched else run_pooled
    return run(_worker, world, args, local_world_size=lws, timeout=timeout)


def _train_losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def check_run_files(run_dir, steps: int, preset: str, world: int) -> None:
    """metrics.jsonl and summary.json are complete and consistent."""
    records = read_metrics(run_dir)
    train_recs = [r for r in records if "loss" in r]
    val_recs = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train_recs] == list(range(1, steps + 1))
    for r in train_recs:
        assert TRAIN_FIELDS <= r.keys()
        assert math.isfinite(r["loss"]) and r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        for kind in ("weights", "grads"):
            for level in ("intra", "inter", "total"):
                assert f"wire_bytes_{kind}_{level}" in r and f"bits_per_elt_{kind}_{level}" in r
    wire = [r["wire_bytes_total"] for r in train_recs]
    assert all(b > a for a, b in zip(wire, wire[1:])), "cumulative bytes must grow every step"
    assert val_recs and val_recs[-1]["step"] == steps
    summary = read_summary(run_dir)
    assert SUMMARY_FIELDS <= summary.keys()
    assert summary["config"]["name"] == preset
    assert summary["steps"] == steps and summary["world_size"] == world
    assert summary["final_val_loss"] == val_recs[-1]["val_loss"]
    assert summary["wire_bytes_total"] >= wire[-1]
    for kind in ("weights", "grads", "control"):
        assert set(summary["wire"][kind]) == {"intra", "inter", "total"}
    latest = latest_checkpoint(run_dir)
    assert latest is not None and latest.name == f"step_{steps:08d}"
    assert read_meta(latest)["step"] == steps


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_trains_and_writes_complete_metrics(tmp_path, corpus, preset):
    steps = 12
    out = tmp_path / preset
    summaries = train(_args(out, corpus, preset=preset, steps=steps, eval_every=6))
    assert summaries[0]["final_val_loss"] == summaries[1]["final_val_loss"]
    check_run_files(out, steps, preset, world=2)
    losses = _train_losses(out)
    assert losses[0] > 5.0  # about ln(256): a byte model at initialization
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    # the codecs the run used: none for fsdp, the reference everywhere else on CPU
    assert read_summary(out)["codec_kernels"] == ("none" if preset == "fsdp" else "torch")
    wire = read_summary(out)["wire"]
    weights_bits = wire["weights"]["total"]["bits_per_element"]
    grads_bits = wire["grads"]["total"]["bits_per_element"]
    if preset == "fsdp":
        assert weights_bits == pytest.approx(32.0) and grads_bits == pytest.approx(32.0)  # fp32 on CPU
    elif preset == "sdp4bit":  # 2 ranks on one node: weights gathered exactly, no replica held
        assert grads_bits < 9.0 and weights_bits == pytest.approx(32.0)
    else:  # everything travels in <= 8 bits
        assert grads_bits < 9.0 and weights_bits < 9.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("preset,world,lws", [
    ("fsdp", 2, None),
    ("sdp4bit", 4, 2),  # 2 nodes x 2 ranks: weight-difference replicas and both gradient hops
    pytest.param("qsdp", 2, None, marks=pytest.mark.slow),
    pytest.param("zeropp", 4, 2, marks=pytest.mark.slow),
])
def test_resume_is_bit_identical(tmp_path, corpus, preset, world, lws):
    """2k steps == k steps (on the 2k-step schedule), stopped, resumed for k more."""
    k = 2
    full, half = tmp_path / "full", tmp_path / "half"
    # Evaluations every 3 steps: the half run's own one at k is not one of the full run's.
    common = dict(preset=preset, local_world_size=lws, eval_every=3)
    train(_args(full, corpus, steps=2 * k, **common), world, lws)
    train(_args(half, corpus, steps=k, decay_steps=2 * k, **common), world, lws)
    assert latest_checkpoint(half).name == f"step_{k:08d}"
    train(_args(half, corpus, steps=2 * k, resume=True, **common), world, lws)
    a, b = _train_losses(full), _train_losses(half)
    assert len(a) == len(b) == 2 * k
    assert a == b  # exact float equality: model, optimizer, LR, comm replicas and counters restored
    val = lambda d: [(r["step"], r["val_loss"]) for r in read_metrics(d) if "val_loss" in r]
    assert [v for v in val(half) if v[0] != k] == val(full)  # the half run also evaluated at k
    sa, sb = read_summary(full), read_summary(half)
    assert sb["start_step"] == k and sb["final_val_loss"] == sa["final_val_loss"]


def _crashing_save(original, crash_step):
    def save(state, checkpoint_id, **kw):
        original(state, checkpoint_id=checkpoint_id, **kw)
        if f"step_{crash_step:08d}" in str(checkpoint_id):
            raise RuntimeError("simulated crash in the middle of a checkpoint save")
    return save


@pytest.mark.timeout(120)
def test_interrupted_save_keeps_last_good_checkpoint_and_resume_continues(tmp_path, corpus, monkeypatch):
    import qsdp.train.checkpoint as ckpt

    out, ref = tmp_path / "run", tmp_path / "ref"
    args = dict(preset="sdp4bit", steps=4, ckpt_every=2, keep_checkpoints=0)
    train(_args(ref, corpus, **args))
    monkeypatch.setattr(ckpt.dcp, "save", _crashing_save(ckpt.dcp.save, 4))  # forked workers inherit it
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(_args(out, corpus, **args), patched=True)
    monkeypatch.undo()
    root = out / CHECKPOINT_DIR
    assert (root / LATEST_FILE).read_text().strip() == "step_00000002"
    assert not (root / "step_00000004").exists()  # the half-written save never got its name
    assert (root / "step_00000004.tmp").is_dir()
    train(_args(out, corpus, resume=True, **args))
    assert (root / LATEST_FILE).read_text().strip() == "step_00000004"
    assert not list(root.glob("*.tmp"))
    # The resumed run re-logged steps 3-4 after the crash: the later records equal the reference.
    by_step = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert [by_step[s] for s in range(1, 5)] == _train_losses(ref)


@pytest.mark.timeout(120)
def test_checkpoint_retention_and_existing_step_directory(tmp_path, corpus):
    out = tmp_path / "run"
    train(_args(out, corpus, preset="fsdp", steps=6, ckpt_every=2, keep_checkpoints=2))
    root = out / CHECKPOINT_DIR
    assert sorted(p.name for p in root.iterdir()) == [LATEST_FILE, "step_00000004", "step_00000006"]
    # A crash after the rename but before `latest` moved leaves a newer complete directory:
    # resuming from `latest` writes that step again and replaces it.
    shutil.copytree(root / "step_00000006", root / "step_00000008")
    train(_args(out, corpus, preset="fsdp", steps=8, ckpt_every=2, keep_checkpoints=2, resume=True))
    assert (root / LATEST_FILE).read_text().strip() == "step_00000008"
    assert read_meta(root / "step_00000008")["step"] == 8


def _cli_in_world(rank, world, argv):
    from qsdp.cli import main

    return main(argv)


@pytest.mark.timeout(120)
def test_cli_under_torchrun_environment_runs_in_process(tmp_path, corpus):
    """With RANK/WORLD_SIZE set (as torchrun does), `qsdp train` runs the job in the process."""
    out = tmp_path / "run"
    argv = ["train", "--preset", "zeropp", "--steps", "4", "--batch-size", "4", "--seq-len", "32",
            "--data", corpus, "--out", str(out), "--no-progress", "--eval-batches", "2"]
    assert run_pooled(_cli_in_world, 2, argv, timeout=90) == [0, 0]
    check_run_files(out, 4, "zeropp", world=2)


@pytest.mark.timeout(240)
def test_real_cli_launches_two_workers_and_resumes(tmp_path, corpus, capsys):
    """`qsdp train --nproc 2` through the elastic launcher, then `--resume` to more steps (a
    checkpoint and two steps after it: the bit-identical resume is test_resume_is_bit_identical's)."""
    from qsdp.cli import main

    out = tmp_path / "run"
    argv = ["train", "--preset", "sdp4bit", "--nproc", "2", "--batch-size", "4", "--seq-len", "32",
            "--data", corpus, "--out", str(out), "--eval-every", "2", "--eval-batches", "2",
            "--ckpt-every", "2", "--no-progress", "--set", "grads.pipeline_slices=2"]
    assert main(argv + ["--steps", "2"]) == 0
    check_run_files(out, 2, "sdp4bit", world=2)
    assert read_summary(out)["config"]["grads"]["pipeline_slices"] == 2
    assert "final val loss" in capsys.readouterr().out
    assert main(argv + ["--steps", "4", "--resume"]) == 0
    check_run_files(out, 4, "sdp4bit", world=2)
    assert read_summary(out)["start_step"] == 2


@pytest.mark.timeout(90)
def test_a_local_launch_gives_each_worker_its_share_of_the_cores_and_leaves_its_environment(tmp_path, tiny_corpus,
                                                                                             caplog):
    """`qsdp train --nproc 2`: each worker runs the launcher's OMP_NUM_THREADS or its share of
    the cores, set inside the worker; the launcher's own environment is left as it was (a
    changed one would make every later local launch of the process, a benchmark's, spawn)."""
    import os

    from qsdp.cli import main

    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
    before = os.environ.get("OMP_NUM_THREADS")
    with caplog.at_level("INFO", logger="qsdp.worker_start"):
        assert main(["train", "--preset", "fsdp", "--nproc", "2", "--batch-size", "2", "--seq-len", "16",
                     "--data", tiny_corpus, "--out", str(tmp_path), "--steps", "1", "--eval-every", "0",
                     "--eval-batches", "1", "--no-progress"]) == 0
    assert [r.message for r in caplog.records if "spawning workers" in r.message] == []
    assert f", {threads} threads/rank)" in read_summary(tmp_path)["device"]
    assert os.environ.get("OMP_NUM_THREADS") == before


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_prints_the_table_and_writes_plots(tmp_path, capsys):
    from qsdp.cli import main

    assert main(["demo", "--out", str(tmp_path), "--steps", "6"]) == 0
    out = capsys.readouterr().out
    for preset in ("fsdp", "qsdp", "sdp4bit"):
        assert any(line.startswith(preset + " ") for line in out.splitlines()), out
        check_run_files(tmp_path / preset, 6, preset, world=4)
        assert read_summary(tmp_path / preset)["nodes"] == 2
    assert (tmp_path / "loss_vs_step.png").is_file() and (tmp_path / "loss_vs_bytes.png").is_file()
