"""The pre-flight of a run: arguments + world size -> a plan (built config, resume point, data
identity), checked before any process group exists."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qsdp.config import resolve_config
from qsdp.train.args import TrainArgs, TrainError, validate_args
from qsdp.train.metrics import METRICS_FILE
from qsdp.train.preflight import Plan, preflight, prepare_dataset, record_job


@pytest.fixture
def args(tmp_path, monkeypatch) -> TrainArgs:
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    corpus = tmp_path / "text.txt"
    corpus.write_text("a small corpus for the pre-flight checks.\n" * 200, encoding="utf-8")
    return TrainArgs(preset="sdp4bit", overrides={"grads.pipeline_slices": 2}, data=str(corpus),
                     out=str(tmp_path / "run"), seed=3, seq_len=16, local_world_size=2)


def test_a_fresh_run_plans_the_built_config_and_no_resume(args):
    plan = preflight(args, world_size=4, data_id="abc")
    expected = resolve_config("sdp4bit", {"grads.pipeline_slices": 2, "local_world_size": 2, "seed": 3})
    assert plan == Plan(config=expected, world_size=4, data_id="abc", resume_from=None, restarted=False)
    assert plan.identity(args)["config"] == expected.to_dict() and plan.identity(args)["data_id"] == "abc"


def test_a_preset_quantizing_only_the_replica_all_reduce_needs_hsdp(args):
    with pytest.raises(TrainError, match="--preset hsdp4 .* add --hsdp"):
        preflight(dataclasses.replace(args, preset="hsdp4", overrides={}), world_size=4)


def test_validate_args_returns_the_config_the_plan_carries(args):
    assert validate_args(args) == preflight(args, world_size=4).config


def test_a_directory_holding_a_run_needs_resume(args, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / METRICS_FILE).write_text("{}\n")
    with pytest.raises(TrainError, match="already holds a run"):
        preflight(args, world_size=2)


def _a_run_started_by_torchrun_job(args, monkeypatch, job):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    run = Path(args.out)
    run.mkdir()
    (run / METRICS_FILE).write_text("{}\n")
    record_job(args.out)


def test_a_node_joining_the_torchrun_job_that_started_the_run_plans_a_restart(args, monkeypatch):
    # A replacement node's agent has restarted nothing (count 0), yet the survivors resume.
    _a_run_started_by_torchrun_job(args, monkeypatch, "job-7")
    plan = preflight(args, world_size=4)
    assert plan.restarted and plan.resume_from is None  # no checkpoint yet: start afresh, as they do


def test_another_torchrun_job_into_a_directory_holding_a_run_still_needs_resume(args, monkeypatch):
    _a_run_started_by_torchrun_job(args, monkeypatch, "job-7")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    with pytest.raises(TrainError, match="already holds a run"):
        preflight(args, world_size=4)


def test_torchruns_default_job_id_names_no_job(args, monkeypatch):
    _a_run_started_by_torchrun_job(args, monkeypatch, "none")
    with pytest.raises(TrainError, match="already holds a run"):
        preflight(args, world_size=4)


def test_resume_without_a_checkpoint_is_refused(args):
    args.resume = True
    with pytest.raises(TrainError, match="no checkpoint"):
        preflight(args, world_size=2)


def test_the_data_identity_names_text_and_tokenizer(args, tmp_path):
    _, first = prepare_dataset(args)
    other = tmp_path / "other.txt"
    other.write_text("a different corpus for the pre-flight checks.\n" * 200, encoding="utf-8")
    args.data = str(other)
    _, second = prepare_dataset(args)
    assert len(first) == 16 and first != second


def test_the_backend_is_chosen_apart_from_the_device():
    assert TrainArgs(device="cpu").process_backend() == "gloo"
    assert TrainArgs(device="cpu", backend="gloo").use_cuda() is False
    assert TrainArgs(device="cuda", backend="gloo").process_backend() == "gloo"
    assert TrainArgs(device="cuda").process_backend() == "nccl"


def test_a_checkpoint_of_eight_slices_resumes_under_auto_which_rounds_the_same():
    from qsdp.train.preflight import _check_identity

    def written_with(slices):
        return {"identity": {"seed": 3, "config": {"grads": {"pipeline_slices": slices}}}}

    mine = {"seed": 3, "config": {"grads": {"pipeline_slices": "auto"}}}
    _check_identity(Path("ckpt"), written_with(8), mine)
    _check_identity(Path("ckpt"), written_with("auto"), {"seed": 3, "config": {"grads": {"pipeline_slices": 8}}})
    with pytest.raises(TrainError, match="config.grads.pipeline_slices: checkpoint 4 != now 'auto'"):
        _check_identity(Path("ckpt"), written_with(4), mine)


def test_a_checkpoint_resumes_under_another_exchange_size_which_moves_the_same_bytes():
    from qsdp.train.preflight import _check_identity

    grads = {"pipeline_slices": "auto", "pipeline_min_bytes": 1 << 20}
    _check_identity(Path("ckpt"), {"identity": {"config": {"grads": grads}}},
                    {"config": {"grads": {**grads, "pipeline_min_bytes": 4096}}})
