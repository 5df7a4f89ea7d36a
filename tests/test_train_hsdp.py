"""``qsdp train --hsdp``: the training job sharded inside each node and replicated across nodes
(4 ranks as 2 nodes x 2 on gloo): it trains, its losses follow the exact route's, it resumes
bit-identically from its checkpoints, and layouts that cannot be HSDP are refused up front."""

from __future__ import annotations

import math
import shutil

import pytest

from distributed import run_pooled
from qsdp.cli import main
from qsdp.train.checkpoint import CHECKPOINT_DIR, LATEST_FILE, latest_checkpoint
from qsdp.train.loop import TrainArgs, TrainError, train_worker
from qsdp.train.metrics import read_metrics, read_summary
from qsdp.train.preflight import check_resume

WORLD, PER_NODE = 4, 2


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qsdp-cache"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):  # not under torchrun
        monkeypatch.delenv(var, raising=False)


def _args(out, corpus, **kw) -> TrainArgs:
    base = dict(out=str(out), data=corpus, model="tiny", steps=8, batch_size=4, seq_len=32, lr=3e-3,
                eval_every=0, eval_batches=4, ckpt_every=0, progress=False, hsdp=True,
                local_world_size=PER_NODE)
    return TrainArgs(**{**base, **kw})


def _worker(rank, world, args):
    return train_worker(args)


def train(args, world=WORLD, timeout=150):
    return run_pooled(_worker, world, args, local_world_size=PER_NODE, timeout=timeout)


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory, corpus):
    """``--hsdp`` with preset ``fsdp``: the fp32 all-reduce between the nodes, the reference."""
    out = tmp_path_factory.mktemp("hsdp-fsdp")
    train(_args(out, corpus, preset="fsdp"))
    return out


@pytest.mark.timeout(200)
def test_an_hsdp_run_says_so_in_its_metrics_and_summary(exact_run):
    summary = read_summary(exact_run)
    assert summary["hsdp"] is True
    assert (summary["nodes"], summary["local_world_size"], summary["world_size"]) == (2, PER_NODE, WORLD)
    records = [r for r in read_metrics(exact_run) if "loss" in r]
    assert len(records) == 8 and all(r["hsdp"] is True for r in records)


@pytest.mark.timeout(200)
def test_the_exact_route_trains(exact_run):
    losses = _losses(exact_run)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["hsdp4", "sdp4bit"])
def test_quantized_hsdp_trains_close_to_the_exact_route(tmp_path, corpus, exact_run, preset):
    train(_args(tmp_path, corpus, preset=preset))
    quantized, exact = _losses(tmp_path), _losses(exact_run)
    assert all(math.isfinite(x) for x in quantized)
    summary = read_summary(tmp_path)
    assert summary["hsdp"] is True and summary["wire"]["grads"]["inter"]["bytes"] > 0
    # 4-bit gradients between the nodes: about 0.5% off the exact loss after 8 steps on CPU.
    assert abs(quantized[-1] - exact[-1]) < 0.02 * exact[-1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["sdp4bit", *(pytest.param(p, marks=pytest.mark.slow)
                                                 for p in ("fsdp", "hsdp4", "qsdp", "zeropp"))])
def test_resume_under_hsdp_is_bit_identical(tmp_path, corpus, preset):
    """4 steps straight == the same run stopped at its step-2 checkpoint and resumed."""
    full, half = tmp_path / "full", tmp_path / "half"
    common = dict(preset=preset, steps=4, ckpt_every=2, keep_checkpoints=0, eval_every=2)
    train(_args(full, corpus, **common))
    # The run as it stood after step 2: its step-2 checkpoint is the latest one.
    shutil.copytree(full, half)
    shutil.rmtree(half / CHECKPOINT_DIR / "step_00000004")
    (half / CHECKPOINT_DIR / LATEST_FILE).write_text("step_00000002\n")
    assert latest_checkpoint(half).name == "step_00000002"
    train(_args(half, corpus, resume=True, **common))
    a, b = read_summary(full), read_summary(half)
    assert b["start_step"] == 2
    assert _losses(half) == _losses(full)
    assert b["final_weights_sha256"] == a["final_weights_sha256"]
    assert b["final_optimizer_sha256"] == a["final_optimizer_sha256"]
    assert b["final_val_loss"] == a["final_val_loss"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags,words", [
    (["--nproc", "2", "--local-world-size", "2"], "at least 2 nodes"),
    (["--nproc", "4"], "at least 2 nodes"),
    (["--nproc", "1"], "at least 2 nodes"),
    (["--nproc", "4", "--local-world-size", "3"], "must divide"),
])
def test_a_layout_that_cannot_be_hsdp_is_a_clear_usage_error(tmp_path, corpus, capsys, flags, words):
    rc = main(["train", "--hsdp", "--data", corpus, "--out", str(tmp_path), "--steps", "2", *flags])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("qsdp: error:") and words in err
    assert not (tmp_path / "metrics.jsonl").exists()


def _error_of_worker(rank, world, args):
    try:
        train_worker(args)
    except TrainError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_a_worker_with_one_node_refuses_before_any_collective(tmp_path, corpus):
    """Under torchrun (the launcher's checks skipped) every rank raises the same error."""
    errors = run_pooled(_error_of_worker, 2, _args(tmp_path, corpus, local_world_size=None), local_world_size=2,
                       timeout=60)
    assert all(e is not None and "at least 2 nodes" in e for e in errors)


@pytest.mark.timeout(120)
def test_resuming_a_non_hsdp_checkpoint_with_hsdp_is_refused(tmp_path, corpus):
    train(_args(tmp_path, corpus, hsdp=False, steps=2), world=2)
    with pytest.raises(TrainError, match="hsdp: checkpoint False != now True"):
        check_resume(_args(tmp_path, corpus, steps=4, resume=True), 2)


@pytest.mark.timeout(200)
def test_under_torchrun_the_nodes_come_from_local_world_size_and_the_cli_says_hsdp(tmp_path, corpus):
    """Under torchrun (here: an initialized world with its environment) ``qsdp train --hsdp``
    takes the ranks per node from ``LOCAL_WORLD_SIZE``."""
    results = run_pooled(_cli_under_torchrun, WORLD, str(tmp_path), corpus, local_world_size=PER_NODE, timeout=150)
    assert [rc for rc, _ in results] == [0] * WORLD
    assert "as HSDP (2 nodes x 2)" in results[0][1][-1]
    assert read_summary(tmp_path)["nodes"] == 2


def _cli_under_torchrun(rank, world, out, corpus):
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["train", "--hsdp", "--data", corpus, "--out", out,
                   "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "4", "--no-progress"])
    return rc, stdout.getvalue().splitlines()
