"""Bad inputs to the command line: one clear line on stderr, exit code 2, nothing started.

Everything except the last two tests is caught before any worker starts, so these run in the
test process in milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qsdp.cli import _root_cause, main
from qsdp.train.checkpoint import CHECKPOINT_DIR, LATEST_FILE

QSDP = str(Path(sys.executable).with_name("qsdp"))


@pytest.fixture(autouse=True)
def _shell(outside_torchrun):
    pass


@pytest.fixture
def corpus(tiny_corpus) -> str:
    return tiny_corpus


def run_cli(argv, capsys) -> tuple[int, list[str]]:
    rc = main(argv)
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.strip()]


def _bad_inputs(tmp: Path, corpus: str) -> list[tuple[list[str], str]]:
    empty = tmp / "empty.txt"
    empty.write_bytes(b"")
    blank = tmp / "blank.txt"
    blank.write_bytes(b"  \n\n ")
    latin1 = tmp / "latin1.txt"
    latin1.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    a_file = tmp / "a_file"
    a_file.write_text("x")
    return [
        (["--data", str(tmp / "missing.txt")], "does not exist"),
        (["--data", str(empty)], "is empty"),
        (["--data", str(blank)], "empty"),
        (["--data", str(latin1)], "not valid UTF-8"),
        (["--data", str(tmp)], "not a regular file"),
        (["--model", "gpt5"], "unknown model 'gpt5'"),
        (["--preset", "qsdp9"], "unknown preset 'qsdp9'"),
        (["--set", "weights.bits=3"], "weights.bits=3"),
        (["--set", "weights.colour=red"], "unknown config field weights.colour"),
        (["--set", "grads.hadamard_block=3"], "hadamard_block"),
        (["--set", "novalue"], "KEY=VALUE"),
        (["--nproc", "0"], "--nproc"),
        (["--nproc", "-3"], "--nproc"),
        (["--nproc", "2", "--local-world-size", "3"], "must divide"),
        (["--local-world-size", "0"], "local_world_size"),
        (["--steps", "0"], "steps must be a positive integer"),
        (["--steps", "-5"], "steps must be a positive integer"),
        (["--steps", "many"], "invalid int value"),
        (["--batch-size", "0"], "batch_size"),
        (["--seq-len", "0"], "seq_len"),
        (["--seq-len", "100000"], "corpus too short"),
        (["--lr", "0"], "lr must be"),
        (["--lr", "nan"], "lr must be"),
        (["--grad-clip", "-1"], "grad_clip"),
        (["--tokenizer", "words"], "unknown tokenizer"),
        (["--param-dtype", "float8"], "param_dtype"),
        (["--timeout", "0"], "timeout"),
        (["--backend", "nccl", "--device", "cpu"], "backend nccl needs CUDA tensors"),
        (["--backend", "mpi"], "invalid choice: 'mpi'"),
        (["--out", str(a_file / "sub")], "cannot create --out"),
        (["--resume"], "no checkpoint"),
        (["--frobnicate"], "unrecognized arguments"),
    ]


def test_every_bad_input_gives_one_error_line_and_exit_code_2(tmp_path, corpus, capsys):
    for extra, expected in _bad_inputs(tmp_path, corpus):
        out = tmp_path / "out"
        argv = ["train", "--data", corpus, "--out", str(out), "--steps", "3", "--no-progress", *extra]
        rc, lines = run_cli(argv, capsys)
        assert rc == 2, (extra, lines)
        assert len(lines) == 1, (extra, lines)
        assert lines[0].startswith("qsdp: error: ") and expected in lines[0], (extra, lines)
        assert not (out / CHECKPOINT_DIR).exists() and not (out / "metrics.jsonl").exists(), extra


def test_unwritable_out_directory(tmp_path, corpus, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        rc, lines = run_cli(["train", "--data", corpus, "--out", str(ro)], capsys)
    finally:
        ro.chmod(0o700)
    assert rc == 2 and len(lines) == 1 and "not writable" in lines[0]


def test_fresh_run_refuses_a_directory_that_holds_a_run(tmp_path, corpus, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    rc, lines = run_cli(["train", "--data", corpus, "--out", str(tmp_path)], capsys)
    assert rc == 2 and len(lines) == 1 and "--resume" in lines[0]


def test_other_commands_report_bad_input_in_one_line(tmp_path, capsys):
    rc, lines = run_cli(["plot", str(tmp_path / "nope")], capsys)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("qsdp: error: ")
    rc, lines = run_cli(["nonsense"], capsys)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("qsdp: error: ")
    rc, lines = run_cli(["bench", "nonsense"], capsys)
    assert rc == 2 and len(lines) == 1


def test_root_cause_is_the_first_primary_failure(tmp_path):
    records = [
        {"rank": 0, "time": 5.0, "type": "PeerError", "message": "rank 0 failed", "user": False,
         "secondary": True, "traceback": "tb0"},
        {"rank": 1, "time": 7.0, "type": "RuntimeError", "message": "Connection closed by peer",
         "user": False, "secondary": False, "traceback": "tb1"},
        {"rank": 3, "time": 6.0, "type": "ZeroDivisionError", "message": "division by zero",
         "user": False, "secondary": False, "traceback": "Traceback ... ZeroDivisionError"},
    ]
    for r in records:
        (tmp_path / f"rank{r['rank']}.json").write_text(json.dumps(r))
    failure = _root_cause(tmp_path, {}, str(tmp_path))
    assert failure.code == 1
    assert str(failure).startswith("rank 3: ZeroDivisionError: division by zero")
    assert (tmp_path / "error.txt").read_text() == "Traceback ... ZeroDivisionError"
    user = {"rank": 2, "time": 6.5, "type": "DataError", "message": "corpus file 'x' is empty",
            "user": True, "secondary": False, "traceback": ""}
    (tmp_path / "rank3.json").unlink()
    (tmp_path / "rank2.json").write_text(json.dumps(user))
    failure = _root_cause(tmp_path, {}, str(tmp_path))
    assert (failure.code, str(failure)) == (2, "corpus file 'x' is empty")


def _make_checkpoint(rank, world, out, corpus):
    from qsdp.train.loop import TrainArgs, train_worker

    return train_worker(TrainArgs(preset="fsdp", out=out, data=corpus, steps=2, batch_size=2,
                                  seq_len=16, eval_batches=2, progress=False))


@pytest.mark.timeout(150)
def test_error_inside_the_workers_is_one_line_from_the_real_cli(tmp_path, corpus):
    """A corrupt checkpoint is found by the workers (its digests): the console script prints the
    root cause once, exits 2, and `latest` still names the (corrupt) last checkpoint."""
    from distributed import run_pooled

    out = tmp_path / "run"
    run_pooled(_make_checkpoint, 2, str(out), corpus, timeout=90)
    ckpt = out / CHECKPOINT_DIR / "step_00000002"
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    env = {**os.environ, "QSDP_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("RANK", None)
    proc = subprocess.run(
        [QSDP, "train", "--preset", "fsdp", "--nproc", "2", "--data", corpus, "--out", str(out),
         "--steps", "4", "--batch-size", "2", "--seq-len", "16", "--resume", "--no-progress"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("qsdp: error: checkpoint "), proc.stderr
    assert f"is damaged: {shard.name} has another size than at save" in lines[0], proc.stderr
    assert (out / CHECKPOINT_DIR / LATEST_FILE).read_text().strip() == "step_00000002"
    assert not (out / CHECKPOINT_DIR / "step_00000004").exists()
