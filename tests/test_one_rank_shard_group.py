"""A shard group of one rank (one GPU, or dp = 1 beside tensor or pipeline parallelism): FSDP2
reduces it without calling qsdp's reduce-scatter, so no reduce-scatter flag is set; the step's
check still finds non-finite gradients, and ``--on-nonfinite skip`` steps none into the weights.
(dp = 1 beside pipeline parallelism: ``tests/test_pipeline.py``.)"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import qsdp
from distributed import run_pooled
import fsdp_models as fm

pytestmark = pytest.mark.timeout(180)


def _one_gpu(rank, world, preset, nan):
    model = fm.build(depth=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the FSDP group has one rank"
        handle = qsdp.quantize_comms(model, preset)
    x, y = fm.batch(0, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    (loss * float("nan") if nan else loss).backward()
    flagged = handle.nonfinite_gradients()
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).mul(float("nan") if nan else 1.0).backward()
    check = qsdp.check_gradients(handle, model.parameters())
    return flagged, check.nonfinite, check.grad_norm


@pytest.mark.parametrize("preset", ["sdp4bit", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_nan_loss_on_one_gpu_is_flagged(preset):
    (flagged, nonfinite, norm), = run_pooled(_one_gpu, 1, preset, True)
    assert flagged and nonfinite and math.isnan(norm)
    (flagged, nonfinite, norm), = run_pooled(_one_gpu, 1, preset, False)
    assert not flagged and not nonfinite and norm > 0


def _dp1_tp2(rank, world, nan_on):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = fm.TinyNet(32, 2)
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = qsdp.quantize_comms(model, "qsdp")
    x, y = fm.batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    if rank == nan_on:  # the reduced gradient of the (not parallelized) head, on one tp rank only
        model.head.weight.grad.to_local()[0, 0] = float("nan")
    return handle.nonfinite_gradients()


def test_with_dp_1_beside_tensor_parallelism_a_nan_on_one_rank_is_seen_by_both():
    assert run_pooled(_dp1_tp2, 2, 1) == [True, True]
    assert run_pooled(_dp1_tp2, 2, None) == [False, False]


def _train(rank, world, args):
    from qsdp.train.loop import train_worker

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train_worker(args)


def test_qsdp_train_on_one_rank_skips_a_nan_step_without_touching_the_weights(tmp_path, corpus, monkeypatch):
    from qsdp.train.loop import TrainArgs
    from qsdp.train.metrics import read_metrics

    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "QSDP_TEST_NAN_AT"):
        monkeypatch.delenv(var, raising=False)

    def args(out, steps):
        return TrainArgs(out=str(out), data=corpus, model="tiny", steps=steps, batch_size=4, seq_len=32, lr=3e-3,
                         warmup=1, decay_steps=3, eval_every=0, ckpt_every=0, progress=False, preset="sdp4bit",
                         on_nonfinite="skip")

    (before,) = run_pooled(_train, 1, args(tmp_path / "one_step", 1), timeout=120)
    monkeypatch.setenv("QSDP_TEST_NAN_AT", "2:0")
    (after,) = run_pooled(_train, 1, args(tmp_path / "run", 2), timeout=120)
    assert after["nonfinite_skipped"] == 1
    assert after["final_weights_sha256"] == before["final_weights_sha256"]  # the NaN step changed nothing
    assert after["final_optimizer_sha256"] == before["final_optimizer_sha256"]
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["nonfinite_skipped"] for r in records] == [0, 1] and records[1]["grad_norm"] is None
