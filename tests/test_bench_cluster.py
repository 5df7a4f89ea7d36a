"""`qsdp bench cluster`: emulated nodes in network namespaces joined by a shaped veth link.

The end-to-end tests need root and iproute2 (`ip`, `tc`) and are skipped, with the reason, where
either is missing; the requirement checks themselves run everywhere.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from distributed import run_world
from qsdp.bench.cluster import (
    _job_args,
    baseline_row,
    format_table,
    ideal_speedup,
    main,
    missing_requirements,
    select_rows,
    train_result,
)
from qsdp.train.loop import TrainArgs, train_worker

_MISSING = missing_requirements()
needs_netns = pytest.mark.skipif(
    bool(_MISSING), reason="needs " + "; ".join(_MISSING) if _MISSING else "")
_RUN_MAIN = "from qsdp.bench.cluster import main; raise SystemExit(main(sys.argv[1:]))"


def _ours(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"qsdp-{pid}-")]


def _cluster_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; " + _RUN_MAIN, *args]


@needs_netns
@pytest.mark.timeout(240)
def test_quick_cluster_run_reports_schema_and_fewer_inter_node_bytes(tmp_path):
    save = tmp_path / "cluster.json"
    proc = subprocess.Popen(
        _cluster_cmd("--presets", "fsdp", "sdp4bit", "--steps", "1", "--rate", "1000", "--delay-ms", "0",
                     "--no-unlimited", "--timeout", "200", "--json", "--save", str(save)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=230)
    assert proc.returncode == 0, err[-3000:]
    assert _ours(proc.pid) == []  # namespaces (and their veths) are gone
    data = json.loads(out)
    assert data == json.loads(save.read_text())
    assert data["link"]["rate_mbit"] == 1000 and data["link"]["delay_ms"] == 0
    assert data["nodes"] == 2 and data["ranks_per_node"] == 2
    assert set(data["meta"]) >= {"command", "torch", "date", "device"}
    keys = {"step_time_s", "tokens_per_s", "speedup_vs_fsdp", "ideal_speedup", "inter_bytes_per_step",
            "intra_bytes_per_step"}
    for name in ("fsdp", "sdp4bit"):
        r = data["presets"][name]
        assert set(r) >= keys, name
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert r["inter_bytes_per_step"] > 0 and r["intra_bytes_per_step"] > 0
        assert r["link_tx_bytes_per_run"] > 0  # traffic really crossed the veth link
    fsdp, sdp = data["presets"]["fsdp"], data["presets"]["sdp4bit"]
    assert fsdp["speedup_vs_fsdp"] == 1.0
    assert sdp["inter_bytes_per_step"] * 5 < fsdp["inter_bytes_per_step"]
    for r in (fsdp, sdp):  # timings on a shared machine: only their consistency is checked
        assert r["ideal_speedup"] > 0
        assert r["realised_fraction_of_ideal"] == pytest.approx(r["speedup_vs_fsdp"] / r["ideal_speedup"])
    assert "sdp4bit" in format_table(data)


@needs_netns
@pytest.mark.timeout(120)
def test_interrupt_removes_namespaces():
    # A shell's background job inherits SIGINT ignored (no job control): give the child the
    # default disposition, so that Python installs its KeyboardInterrupt handler, as in a terminal.
    proc = subprocess.Popen(_cluster_cmd("--presets", "fsdp", "--steps", "50", "--rate", "1", "--delay-ms", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while len(_ours(proc.pid)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.2)
        time.sleep(2)  # let the torchrun agents start inside the namespaces
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert _ours(proc.pid) == []


@needs_netns
@pytest.mark.timeout(60)
def test_stale_namespaces_of_dead_runs_are_removed():
    from qsdp.bench.cluster import remove_stale_namespaces

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"qsdp-{dead.pid}-n0"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        assert name in remove_stale_namespaces(shutil.which("ip"))
        assert _ours(dead.pid) == []
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def test_missing_tools_and_root_are_named():
    problems = missing_requirements(path="/nonexistent", euid=1000)
    text = "\n".join(problems)
    assert "root" in text and "`ip`" in text and "`tc`" in text


@pytest.mark.timeout(60)
def test_missing_tc_gives_clear_error_and_nonzero_exit(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    if shutil.which("ip"):
        (bindir / "ip").symlink_to(shutil.which("ip"))  # ip present, tc absent
    env = dict(os.environ, PATH=str(bindir))
    out = subprocess.run(_cluster_cmd("--presets", "fsdp"), env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode != 0
    assert "`tc`" in out.stderr and "lacks" in out.stderr
    assert out.stdout == ""


def test_serial_ideal_speedup_subtracts_the_saved_link_time():
    # fsdp: 10 s a step; the preset saves 8e6 bytes = 64 Mbit = 8 s at 8 Mbit/s -> 2 s ideal.
    assert ideal_speedup(10.0, 9e6, 1e6, 8.0) == pytest.approx(5.0)
    assert ideal_speedup(10.0, 9e6, 1e6, 8.0, t_floor=4.0) == pytest.approx(2.5)  # compute floor
    assert ideal_speedup(10.0, 9e6, 9e6, 8.0) == pytest.approx(1.0)


# --------------------------------------------------------------------------- HSDP rows


@needs_netns
@pytest.mark.timeout(300)
def test_quick_hsdp_rows_run_qsdp_train_hsdp_and_send_fewer_inter_node_bytes(tmp_path):
    proc = subprocess.Popen(
        _cluster_cmd("--presets", "hsdp:fsdp", "hsdp:sdp4bit", "--steps", "2", "--warmup", "1", "--rate", "1000",
                     "--delay-ms", "0", "--no-unlimited", "--timeout", "240", "--json"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=290)
    assert proc.returncode == 0, err[-3000:]
    assert _ours(proc.pid) == []
    rows = json.loads(out)["presets"]
    exact, quantized = rows["hsdp:fsdp"], rows["hsdp:sdp4bit"]
    assert exact["baseline"] == quantized["baseline"] == "hsdp:fsdp" and exact["speedup_vs_fsdp"] == 1.0
    assert len(quantized["step_times_s"]) == 2 and quantized["step_time_s"] > 0
    assert quantized["inter_bytes_per_step"] * 5 < exact["inter_bytes_per_step"]
    assert quantized["link_tx_bytes_per_run"] > 0


def test_hsdp_adds_each_presets_hsdp_row_after_the_presets_with_their_baseline_first():
    assert select_rows(["fsdp", "sdp4bit"], hsdp=True) == ["fsdp", "sdp4bit", "hsdp:fsdp", "hsdp:sdp4bit"]
    assert select_rows(["sdp4bit", "hsdp:zeropp"]) == ["sdp4bit", "hsdp:zeropp"]
    assert select_rows(["hsdp:zeropp", "qsdp"], hsdp=True) == ["hsdp:zeropp", "qsdp", "hsdp:fsdp", "hsdp:qsdp"]


def test_hsdp_rows_are_compared_with_the_exact_hsdp_route_and_the_others_with_fsdp():
    assert baseline_row("hsdp:sdp4bit") == baseline_row("hsdp:fsdp") == "hsdp:fsdp"
    assert baseline_row("sdp4bit") == baseline_row("fsdp") == "fsdp"


def test_a_bad_hsdp_row_is_refused_before_any_network_is_touched(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--presets", "fsdp", "hsdp:nope"])
    assert exc.value.code == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_an_hsdp_row_runs_the_training_job_with_hsdp_and_a_plain_row_the_workload(tmp_path):
    hsdp = _job_args("hsdp:sdp4bit", 2, 3, 1, "tiny", 64, 4, str(tmp_path / "run"), str(tmp_path))
    assert hsdp[:4] == ["-m", "qsdp.cli", "train", "--hsdp"]
    for flag, value in (("--preset", "sdp4bit"), ("--local-world-size", "2"), ("--steps", "4"),
                        ("--device", "cpu"), ("--backend", "gloo")):
        assert hsdp[hsdp.index(flag) + 1] == value
    plain = _job_args("sdp4bit", 2, 3, 1, "tiny", 64, 4, str(tmp_path / "r.json"), str(tmp_path))
    assert plain[:2] == ["-m", "qsdp.bench.workload"] and "--hsdp" not in plain


def _train(rank, world, args):
    return train_worker(args)


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory, corpus):
    """``qsdp train --hsdp`` runs of 3 steps on 2 x 2 gloo ranks, as the HSDP rows launch them."""
    runs = {}
    for preset in ("fsdp", "sdp4bit"):
        out = tmp_path_factory.mktemp(f"hsdp-{preset}")
        args = TrainArgs(preset=preset, hsdp=True, local_world_size=2, out=str(out), data=corpus, steps=3,
                         batch_size=2, seq_len=32, eval_every=0, eval_batches=4, ckpt_every=0, progress=False,
                         cache_dir=str(tmp_path_factory.getbasetemp() / "qsdp-cache"))
        run_world(_train, 4, args, local_world_size=2, timeout=120)
        runs[preset] = train_result(str(out), warmup=1, steps=2)
    return runs


@pytest.mark.timeout(240)
def test_an_hsdp_rows_result_has_its_timed_steps_and_keeps_weights_inside_the_node(hsdp_runs):
    for run in hsdp_runs.values():
        assert run["hsdp"] is True and len(run["step_times_s"]) == 2 and run["step_time_s"] > 0
        assert run["stats"]["weights"]["inter"]["bytes"] == 0  # gathers stay inside the node
        assert run["stats"]["weights"]["intra"]["bytes"] > 0 and run["stats"]["grads"]["inter"]["bytes"] > 0
        assert run["tokens_per_step"] == 2 * 32 * 4


@pytest.mark.timeout(240)
def test_an_hsdp_rows_inter_node_gradients_shrink_with_4_bit_hsdp(hsdp_runs):
    exact, quantized = (hsdp_runs[p]["stats"]["grads"]["inter"]["bytes"] for p in ("fsdp", "sdp4bit"))
    assert 5 * quantized < exact  # 4.25 b/elt against 32
