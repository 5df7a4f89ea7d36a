"""Every ``qsdp`` subcommand ends a bad input with one ``qsdp: error:`` line, deletes nothing it
did not write, and a failure inside the workers names the rank that died first."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from qsdp.cli import main
from qsdp.train.checkpoint import CHECKPOINT_DIR
from qsdp.train.launcher import root_cause
from qsdp.train.metrics import METRICS_FILE


@pytest.fixture(autouse=True)
def _shell(outside_torchrun):
    pass


@pytest.fixture
def corpus(tiny_corpus) -> str:
    return tiny_corpus


def one_error(argv, capsys) -> str:
    """Run ``qsdp ARGV``: exit code 2 and exactly one ``qsdp: error:`` line; returns it."""
    rc = main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("qsdp: error: "), (argv, rc, lines)
    return lines[0]


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _train_run(rank, world, out, corpus):
    from qsdp.train.loop import TrainArgs, train_worker

    return train_worker(TrainArgs(preset="sdp4bit", out=out, data=corpus, steps=2, batch_size=2, seq_len=16,
                                  eval_batches=1, progress=False))


@pytest.mark.timeout(120)
def test_the_demo_beside_a_training_run_is_refused_and_the_run_untouched(tmp_path, corpus, capsys):
    from distributed import run_world

    runs = tmp_path / "runs"
    run_world(_train_run, 1, str(runs / "sdp4bit"), corpus, timeout=90)  # docs/training.md's layout
    before = _tree(runs)
    assert f"sdp4bit/{METRICS_FILE}" in before and any(k.startswith(f"sdp4bit/{CHECKPOINT_DIR}/") for k in before)
    line = one_error(["demo", "--out", str(runs), "--steps", "1"], capsys)
    assert f"{runs / 'sdp4bit'} holds checkpoints, metrics.jsonl, summary.json that qsdp demo did not write" in line
    assert _tree(runs) == before
    assert not (runs / "fsdp").exists() and not (runs / "qsdp").exists()


def test_a_directory_marked_by_its_owner_is_cleared_and_no_other(tmp_path):
    from qsdp.train.owned import NotOwnedError, check_clearable, clear_owned

    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    clear_owned(mine, "qsdp demo", ["metrics.jsonl"])  # a new directory, marked
    (mine / "metrics.jsonl").write_text("old demo\n")
    (mine / "notes.txt").write_text("kept: not one of the names\n")
    clear_owned(mine, "qsdp demo", ["metrics.jsonl"])
    assert not (mine / "metrics.jsonl").exists() and (mine / "notes.txt").exists()
    theirs.mkdir()
    (theirs / "metrics.jsonl").write_text("a training run\n")
    with pytest.raises(NotOwnedError, match="holds metrics.jsonl that qsdp demo did not write"):
        clear_owned(theirs, "qsdp demo", ["metrics.jsonl"])
    with pytest.raises(NotOwnedError, match="that another command did not write"):
        check_clearable(mine, "another command")  # another command's marker is not its own
    assert (theirs / "metrics.jsonl").read_text() == "a training run\n"


def test_convergence_reuse_refuses_a_run_directory_it_did_not_write(tmp_path, corpus, capsys):
    from benchmarks import convergence
    from benchmarks._cli import run_script

    run = tmp_path / "seed0" / "fsdp"
    run.mkdir(parents=True)
    (run / METRICS_FILE).write_text('{"step": 1, "loss": 5.0}\n')
    rc = run_script(convergence.main, convergence.PROGRAM,
                    ["--out", str(tmp_path), "--reuse", "--variants", "fsdp", "--seeds", "1", "--steps", "1",
                     "--data", corpus, "--no-progress"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{convergence.PROGRAM}: error: {run} holds metrics.jsonl that "
                               f"{convergence.PROGRAM} did not write"), lines
    assert (run / METRICS_FILE).read_text() == '{"step": 1, "loss": 5.0}\n'


@pytest.mark.parametrize("argv,words", [
    (["train", "--preset", "sdp4bit", "--set", "grads.bits=5"], "grads.bits is unused when grads.mode = 'two_level'"),
    (["train", "--preset", "sdp4bit", "--set", "grads.bits=4"], "grads.bits is unused when grads.mode = 'two_level'"),
    (["train", "--preset", "fsdp", "--set", "weights.bits=3"], "weights.bits is unused when weights.mode = 'plain'"),
    (["check", "--preset", "sdp4bit", "--set", "grads.bits=4"], "grads.bits is unused when grads.mode = 'two_level'"),
    (["train", "--nproc", "100000"], "argument --nproc: must be an integer from 1 to 1024"),
    (["advise", "--params", "7B", "--nodes", "4", "--margin", "nan"], "argument --margin: must be a finite number"),
    (["advise", "--params", "7B", "--nodes", "4", "--margin", "inf"], "argument --margin: must be a finite number"),
    (["advise", "--params", "7B", "--nodes", "4", "--gpu", "custom", "--mfu", "5"], "argument --mfu: must be in (0, 1]"),
    (["advise", "--params", "7B", "--nodes", "4", "--gpu", "custom", "--mfu", "0"], "argument --mfu: must be in (0, 1]"),
    (["advise", "--params", "1e30", "--nodes", "4"], "at most 1e+13 parameters"),
    (["advise", "--params", "7B", "--measure"], "--measure runs under torchrun"),
    (["bench", "volume", "--model", "gpt5"], "argument --model: invalid choice: 'gpt5'"),
    (["check", "--device", "tpu"], "argument --device: 'tpu' is not cpu, cuda or cuda:N"),
])
def test_a_bad_input_to_any_subcommand_is_one_error_line(argv, words, tmp_path, corpus, capsys):
    if argv[0] == "train":
        argv = [*argv, "--data", corpus, "--out", str(tmp_path / "out")]
    assert words in one_error(argv, capsys)
    assert not (tmp_path / "out").exists()  # a refused run leaves no empty --out


@pytest.mark.parametrize("argv", [["bench", "volume", "--steps", "1"], ["check", "--steps", "1"],
                                  ["bench", "codecs"], ["bench", "simulate"]])
def test_a_directory_as_save_is_refused_before_the_work(argv, tmp_path, capsys):
    line = one_error([*argv, "--save", str(tmp_path)], capsys)
    assert f"argument --save: '{tmp_path}' is a directory" in line
    assert capsys.readouterr().out == ""  # nothing was measured


def test_a_json_error_in_config_or_kernels_names_the_file(tmp_path, capsys):
    bad = tmp_path / "model.json"
    bad.write_text('{"n_layer": 2,')
    for flag in ("--config", "--kernels"):
        argv = ["advise", "--nodes", "2", *(["--params", "7B"] if flag == "--kernels" else []), flag, str(bad)]
        assert f"{flag} {bad}: not valid JSON" in one_error(argv, capsys)


def test_an_unexpected_exception_is_one_line_with_the_traceback_file(tmp_path, capsys, monkeypatch):
    import qsdp.preset_table

    def broken(argv):
        raise ZeroDivisionError("a bug no check foresaw")

    monkeypatch.setattr(qsdp.preset_table, "main", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    assert main(["presets"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    m = re.fullmatch(r"qsdp: error: unexpected ZeroDivisionError: a bug no check foresaw \(traceback: (.+)\)", lines[0])
    assert m, lines
    text = Path(m.group(1)).read_text()
    assert Path(m.group(1)).parent == tmp_path and "Traceback" in text and "in broken" in text


def test_a_stray_local_world_size_does_not_decide_the_hsdp_layout(tmp_path, corpus, capsys, monkeypatch):
    """Local workers see LOCAL_WORLD_SIZE = --nproc (one node), whatever the launching shell has:
    preflight refuses --hsdp on one node, as the workers would, naming no flag never passed."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    line = one_error(["train", "--hsdp", "--nproc", "4", "--data", corpus, "--out", str(tmp_path / "o")], capsys)
    assert "--hsdp needs at least 2 nodes" in line and "4 rank(s) at 4 per node make 1" in line


def test_comms_state_and_gradient_check_refuse_foreign_input_by_name():
    from qsdp.fsdp import QuantizedComms
    from qsdp.gradient_check import check_gradients

    handle = QuantizedComms.__new__(QuantizedComms)  # the key check comes before any comm is touched
    with pytest.raises(ValueError, match=r"unexpected keys 'foo'; missing keys 'all_gather', 'reduce_scatter'$"):
        handle.load_state_dict({"foo": 1})
    with pytest.raises(TypeError, match=r"comms must be the handle qsdp.quantize_comms returned, or a list of them "
                                        r"\(one per model part of this rank\); got str"):
        check_gradients("sdp4bit", None)


def test_root_cause_is_the_rank_that_died_first_not_the_peer_that_saw_it(tmp_path):
    peer = {"rank": 0, "time": 5.0, "type": "DistBackendError", "attempt": 0, "user": False, "secondary": False,
            "message": "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242",
            "traceback": "tb0"}
    (tmp_path / "rank0.json").write_text(json.dumps(peer))
    # The launcher saw both exits in the same poll; the agent reported rank 0's (it comes first).
    deaths = {(0, 0): (7, None, 1), (0, 1): (7, "SIGKILL", None), (0, 2): (9, "SIGTERM", None)}
    failure = root_cause(tmp_path, {}, str(tmp_path), deaths)
    assert str(failure) == "rank 1 died first (killed by SIGKILL) without reporting an error; rank 0 then lost the connection"
    assert failure.code == 1


def test_the_agents_failures_name_the_first_death_when_the_launchers_watch_missed_it(tmp_path):
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    peer = {"rank": 0, "time": 5.0, "type": "DistBackendError", "attempt": 0, "user": False, "secondary": False,
            "message": "Connection closed by peer [127.0.0.1]:4242", "traceback": "tb0"}
    (tmp_path / "rank0.json").write_text(json.dumps(peer))
    # The agent reaped rank 1 before the launcher's watch polled: no death of the watch's.
    failures = {1: ProcessFailure(local_rank=1, pid=4242, exitcode=-signal.SIGKILL,
                                  error_file=str(tmp_path / "none.json"))}
    failure = root_cause(tmp_path, failures, str(tmp_path), {})
    assert str(failure) == "rank 1 died first (killed by SIGKILL) without reporting an error; rank 0 then lost the connection"


@pytest.mark.timeout(240)
def test_a_killed_worker_is_named_as_the_root_cause_from_the_real_cli(tmp_path, corpus, capsys, monkeypatch):
    # rank 1 SIGKILLs itself in step 2. Its peer's record says only that the connection was
    # reset, and the elastic agent may see rank 0's exit first: the launcher's death watch
    # (qsdp.train.launcher.DeathWatch) saw rank 1 end first, forked (the fork server's child) or not.
    monkeypatch.setenv("QSDP_TEST_KILL_AT", "2:1")
    rc = main(["train", "--preset", "fsdp", "--nproc", "2", "--data", corpus, "--out", str(tmp_path / "run"),
               "--steps", "4", "--batch-size", "2", "--seq-len", "16", "--no-progress"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("qsdp: error: rank 1 died first (killed by SIGKILL) without reporting an error"), lines
