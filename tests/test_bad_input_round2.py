"""Bad input a careless user gives, refused at start-up in one line naming it: numbers out of
range (a group of 2**31 elements, a learning rate of 3e38, a negative number of checkpoints to
keep, an infinite link, NaN hardware), a file where the run's checkpoints directory goes, a
``--save`` path nothing can be written to, and a config field set twice."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import qsdp
from distributed import run_pooled
from qsdp.cli import main

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _shell(outside_torchrun):
    pass


def run_cli(argv, capsys) -> tuple[int, list[str]]:
    rc = main(argv)
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("extra,expected", [
    (["--set", "grads.group_size=2147483648"], "grads.group_size=2147483648 must be at most 1048576"),
    (["--set", "weights.group_size=2147483648"], "weights.group_size=2147483648 must be at most 1048576"),
    (["--lr", "3e38"], "lr must be at most 1"),
    (["--lr", "0.5", "--weight-decay", "4"], "lr * weight_decay must be below 1"),
    (["--keep-checkpoints", "-1"], "keep_checkpoints must be a non-negative integer"),
    (["--steps", str(2**40)], "steps must be a positive integer (at most 2147483647)"),
    (["--seed", str(2**64)], "seed must be a non-negative integer"),
    (["--set", "weights.bits=4", "--set", "weights.bits=8"], "weights.bits given twice (4, then 8)"),
])
def test_a_value_out_of_range_is_refused_at_start_up_naming_it(extra, expected, tmp_path, tiny_corpus, capsys):
    out = tmp_path / "out"
    rc, lines = run_cli(["train", "--data", tiny_corpus, "--out", str(out), "--steps", "3", "--no-progress",
                         *extra], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("qsdp: error: ") and expected in lines[0], lines
    assert not out.exists()  # nothing started: the --out it created is gone again


@pytest.mark.parametrize("name,kind", [("checkpoints", "a file"), ("metrics.jsonl", "a directory"),
                                       ("summary.json", "a directory")])
def test_a_path_the_run_writes_that_holds_the_wrong_kind_of_thing_is_refused_before_training(
        name, kind, tmp_path, tiny_corpus, capsys):
    out = tmp_path / "out"
    out.mkdir()
    if kind == "a file":
        (out / name).write_text("not a directory")
    else:
        (out / name).mkdir()
    rc, lines = run_cli(["train", "--data", tiny_corpus, "--out", str(out), "--steps", "2", "--no-progress",
                         "--model", "tiny", "--batch-size", "2", "--seq-len", "16"], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert f"{name} is {kind}" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == [name]  # nothing trained, nothing written


@pytest.mark.parametrize("argv,expected", [
    (["advise", "--params", "1B", "--link", "1e309gbit"], "--link: '1e309gbit' is not a finite rate"),
    (["advise", "--params", "1B", "--link-per-gpu", "1e309gbit"], "--link-per-gpu: '1e309gbit' is not a finite rate"),
    (["bench", "simulate", "--intra-gbps", "nan"], "--intra-gbps=nan must be a positive finite number"),
    (["bench", "simulate", "--inter-gbps", "inf"], "--inter-gbps=inf must be a positive finite number"),
    (["bench", "simulate", "--scale-gpus", "0", "-3"], "--scale-gpus: 0, -3 must be positive numbers of GPUs"),
])
def test_other_commands_refuse_numbers_that_are_not_finite_or_positive(argv, expected, capsys):
    rc, lines = run_cli(argv, capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert expected in lines[0]


def test_gpu_report_refuses_a_budget_that_is_not_a_positive_number(capsys):
    from benchmarks import gpu_report

    for budget in ("nan", "-5", "0"):
        with pytest.raises(SystemExit) as stop:
            gpu_report.main(["--budget", budget, "--dry-run"])
        assert stop.value.code == 2
        assert "argument --budget: must be" in capsys.readouterr().err


def test_save_to_a_path_nothing_can_be_written_to_is_refused_before_the_benchmark(tmp_path, capsys):
    # /proc accepts no new file, whoever asks (root included, for whom os.access says yes).
    rc, lines = run_cli(["bench", "simulate", "--save", "/proc/qsdp-result.json"], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert "argument --save: cannot write '/proc/qsdp-result.json'" in lines[0]
    assert ".png" not in lines[0]


def _hsdp_nodes(rank, world, nodes):
    try:
        qsdp.hsdp_groups(nodes=nodes, device_type="cpu")
    except qsdp.ConfigError as e:
        return str(e)
    return None


def test_hsdp_groups_refuses_nodes_that_are_not_an_int_naming_the_argument():
    for message in run_pooled(_hsdp_nodes, 2, "2", timeout=60):
        assert message == "hsdp_groups: nodes must be an int or None, got '2'"


def _two_checkpoints(rank, world, out, corpus):
    from qsdp.train.loop import TrainArgs, train_worker

    train_worker(TrainArgs(preset="fsdp", out=out, data=corpus, steps=2, ckpt_every=1, batch_size=2, seq_len=16,
                           eval_batches=2, progress=False))


@pytest.mark.slow  # trains 2 steps on 2 ranks: about 30 s on 2 cores
def test_resume_from_a_path_that_is_no_checkpoint_names_the_run_s_newest_complete_one(tmp_path, tiny_corpus):
    from qsdp.train.args import TrainArgs
    from qsdp.train.checkpoint import CheckpointError
    from qsdp.train.preflight import preflight

    out = tmp_path / "run"
    run_pooled(_two_checkpoints, 2, str(out), tiny_corpus, timeout=110)
    args = TrainArgs(preset="fsdp", out=str(out), data=tiny_corpus, steps=4, batch_size=2, seq_len=16,
                     resume_from="../x", progress=False)
    with pytest.raises(CheckpointError) as refused:
        preflight(args, 2)
    assert str(refused.value) == ("--resume-from '../x' is not a checkpoint directory; the previous complete "
                                  "checkpoint is step_00000002 (qsdp train: --resume-from step_00000002)")
    # a link to a complete checkpoint is not one of the run's: never resumed, never rotated away
    from qsdp.train.checkpoint import complete_checkpoints

    root = out / "checkpoints"
    (root / "step_00000009").symlink_to(root / "step_00000002")
    assert [p.name for _, p in complete_checkpoints(root)] == ["step_00000001", "step_00000002"]


def test_latest_that_is_a_link_to_another_file_is_refused_without_quoting_it(tmp_path):
    from qsdp.train.checkpoint import CheckpointError, latest_checkpoint

    secret = tmp_path / "elsewhere.txt"
    secret.write_text("password=hunter2\n" * 20)
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "latest").symlink_to(secret)
    with pytest.raises(CheckpointError) as refused:
        latest_checkpoint(tmp_path / "run")
    assert "latest is a symbolic link" in str(refused.value) and "hunter2" not in str(refused.value)


def test_latest_naming_a_step_that_is_a_link_to_another_run_is_refused(tmp_path):
    from qsdp.train.checkpoint import CheckpointError, latest_checkpoint

    other = tmp_path / "other" / "checkpoints" / "step_00000009"
    other.mkdir(parents=True)
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "step_00000009").symlink_to(other)
    (root / "latest").write_text("step_00000009\n")
    with pytest.raises(CheckpointError) as refused:
        latest_checkpoint(tmp_path / "run")
    assert "step_00000009 is a symbolic link" in str(refused.value)


def test_a_long_latest_is_quoted_short_and_escaped(tmp_path):
    from qsdp.train.checkpoint import CheckpointError, latest_checkpoint

    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "latest").write_text("\x1b[2J" + "x" * 5000)
    with pytest.raises(CheckpointError) as refused:
        latest_checkpoint(tmp_path / "run")
    message = str(refused.value)
    assert "\x1b" not in message and "\\x1b[2J" in message and len(message) < 400


def _save_then_load_with(rank, world, out, saved_with, loaded_with):
    import torch

    import fsdp_models as fm
    from qsdp.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    model = fm.build()
    handle = qsdp.quantize_comms(model, saved_with)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    save_checkpoint(out, 1, model, opt, handle, meta={})
    handle.close()
    other = fm.build(seed=5)
    handle = qsdp.quantize_comms(other, loaded_with)
    try:
        load_checkpoint(f"{out}/checkpoints/step_00000001", other, torch.optim.Adam(other.parameters(), lr=1e-2),
                        handle, torch.device("cpu"))
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.slow  # a save and a load on 2 ranks: about 30 s on 2 cores
def test_load_checkpoint_into_comms_of_another_preset_is_refused_naming_the_fields(tmp_path):
    for message in run_pooled(_save_then_load_with, 2, str(tmp_path), "sdp4bit", "qsdp", timeout=100):
        assert message is not None and "was saved by comms of another config (" in message
        assert "grads.mode: checkpoint 'two_level' != now 'one_level'" in message


@pytest.mark.slow  # a save and a load on 2 ranks: about 30 s on 2 cores
def test_load_checkpoint_into_comms_of_the_same_preset_loads(tmp_path):
    assert run_pooled(_save_then_load_with, 2, str(tmp_path), "sdp4bit", "sdp4bit", timeout=100) == [None, None]
