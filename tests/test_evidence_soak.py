"""``python -m benchmarks.soak``: the analysis on synthetic samples, and a short real soak (schema)."""

from __future__ import annotations

import json

import pytest

from benchmarks import soak
from benchmarks._cli import run_script


def _samples(rss_per_hour: float, n: int = 40, dt: float = 30.0, base: float = 500.0,
             step_time: float = 0.2, time_growth: float = 0.0):
    return [{"t_s": i * dt, "step": 10 * (i + 1),
             "rss_mb": [base + rss_per_hour * i * dt / 3600 + (50.0 if i < 4 else 0.0), base],
             "step_time_s": [step_time * (1 + time_growth * i), step_time * (1 + time_growth * i)],
             "loss": 3.0} for i in range(n)]


def test_least_squares_slope():
    assert soak.least_squares_slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert soak.least_squares_slope([0, 1, 2, 3], [4, 4, 4, 4]) == 0.0
    assert soak.least_squares_slope([1.0], [2.0]) is None
    assert soak.least_squares_slope([2, 2], [1, 3]) is None


def test_analysis_leaves_out_the_warmup_and_reports_the_worst_worker():
    # Rank 0 grows 120 MB/hour after a 50 MB jump in the first 4 samples (the warm-up); rank 1 is flat.
    r = soak.analyse(_samples(120.0), warmup_s=120.0, max_slope=10.0)
    assert r["samples_after_warmup"] == 36
    assert r["memory"]["slope_mb_per_hour_per_worker"][0] == pytest.approx(120.0)
    assert r["memory"]["slope_mb_per_hour_per_worker"][1] == pytest.approx(0.0)
    assert r["memory"]["slope_mb_per_hour"] == pytest.approx(120.0)
    assert r["memory"]["flat"] is False
    flat = soak.analyse(_samples(0.0), warmup_s=120.0, max_slope=10.0)
    assert flat["memory"]["slope_mb_per_hour"] == pytest.approx(0.0) and flat["memory"]["flat"] is True
    assert flat["step_time"]["drift_pct"] == pytest.approx(0.0)
    slower = soak.analyse(_samples(0.0, time_growth=0.01), warmup_s=120.0, max_slope=10.0)
    assert slower["step_time"]["drift_pct"] > 20 and slower["step_time"]["slope_pct_per_hour"] > 0
    none = soak.analyse(_samples(0.0, n=3), warmup_s=1e9, max_slope=10.0)
    assert none["memory"]["slope_mb_per_hour"] is None and none["memory"]["flat"] is None


def test_rss_is_read_in_mb():
    mb, source = soak.rss_mb()
    assert 10 < mb < 1e6 and source in ("VmRSS", "maxrss")


@pytest.mark.slow  # the evidence script, not the package
@pytest.mark.timeout(150)
def test_a_short_soak_reports_the_memory_slope(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    data = tmp_path / "text.txt"
    from qsdp.train.data import load_corpus

    data.write_text(load_corpus(None)[:200_000], encoding="utf-8")
    save = tmp_path / "results" / "soak.json"
    argv = ["--minutes", "0.15", "--sample-every", "2", "--warmup-minutes", "0.03", "--seq-len", "32",
            "--batch-size", "4", "--data", str(data), "--json", "--save", str(save)]
    assert soak.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(save.read_text())
    assert printed == saved
    r = saved
    assert r["preset"] == "sdp4bit" and r["nproc"] == 2 and r["model"] == "tiny"
    assert r["duration_s"] >= 9.0 and r["steps"] >= 4 and r["nonfinite_skipped"] == 0
    assert r["samples_after_warmup"] >= 2
    m = r["memory"]
    assert isinstance(m["slope_mb_per_hour"], float)
    assert len(m["slope_mb_per_hour_per_worker"]) == 2 and isinstance(m["flat"], bool)
    assert len(m["rss_mb_last"]) == 2 and all(50 < v < 10_000 for v in m["rss_mb_last"])
    assert set(r["step_time"]) >= {"median_s", "drift_pct", "slope_pct_per_hour"}
    assert r["step_time"]["median_s"] > 0
    s0 = r["samples"][0]
    assert set(s0) == {"t_s", "step", "rss_mb", "step_time_s", "loss"} and len(s0["rss_mb"]) == 2
    assert [s["step"] for s in r["samples"]] == list(range(2, r["steps"] + 1, 2))
    meta = r["meta"]
    assert meta["command"].startswith("python -m benchmarks.soak --minutes 0.15")
    assert {"torch", "date", "device"} <= set(meta) and meta["device"].startswith("cpu")
    assert "memory (RSS" in soak.format_report(r)


def test_bad_soak_arguments_are_usage_errors(capsys):
    for argv, msg in ((["--minutes", "0"], "--minutes"), (["--nproc", "0"], "--nproc"),
                      (["--sample-every", "0"], "--sample-every"), (["--preset", "nope"], "unknown preset"),
                      (["--minutes", "1", "--warmup-minutes", "2"], "--warmup-minutes")):
        assert run_script(soak.main, soak.PROGRAM, argv) == 2, argv
        assert msg in capsys.readouterr().err, argv
