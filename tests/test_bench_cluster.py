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

from qsdp.bench.cluster import format_table, ideal_speedup, missing_requirements

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
    proc = subprocess.Popen(_cluster_cmd("--presets", "fsdp", "--steps", "50", "--rate", "1", "--delay-ms", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
