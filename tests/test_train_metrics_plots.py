"""Specification of run metrics on disk and the loss-curve plots."""

import json
import math
import os

import numpy as np
import pytest

from qsdp.train.metrics import MetricsWriter, read_metrics, read_summary, write_summary
from qsdp.train.plots import LOSS_VS_BYTES, ema_smooth, loss_figures, plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_run(run_dir, name, bytes_per_step, n_steps=30, val_every=10, inter_per_step=0.0):
    """A run directory as the training loop writes it, with a synthetic decaying loss;
    ``inter_per_step`` of the bytes go between nodes, half weights, half gradients."""
    with MetricsWriter(run_dir) as w:
        for step in range(1, n_steps + 1):
            w.write({"step": step, "loss": 5.5 * math.exp(-step / 20) + 1.0, "lr": 1e-3,
                     "step_time_s": 0.1, "tokens_per_s": 1e4,
                     "wire_bytes_total": step * bytes_per_step,
                     "wire_bytes_weights_inter": step * inter_per_step / 2,
                     "wire_bytes_grads_inter": step * inter_per_step / 2, "wire_bytes_control_inter": 0})
            if step % val_every == 0:
                w.write({"step": step, "val_loss": 5.5 * math.exp(-step / 20) + 1.1})
    write_summary(run_dir, {"config": {"name": name}, "final_loss": 1.5})


def test_metrics_round_trip_and_append(tmp_path):
    records = [{"step": 1, "loss": 2.5, "lr": np.float32(0.001)}, {"step": 1, "val_loss": 2.7}]
    with MetricsWriter(tmp_path) as w:
        for r in records:
            w.write(r)
        # Flushed line by line: a reader sees the records before the writer closes.
        assert len(read_metrics(tmp_path)) == 2
    with MetricsWriter(tmp_path) as w:  # a resumed run appends
        w.write({"step": 2, "loss": 2.0})
    got = read_metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 1, 2]
    assert got[0]["lr"] == pytest.approx(0.001)


def test_disabled_writer_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "run", enabled=False)
    w.write({"step": 1, "loss": 1.0})
    w.close()
    assert not (tmp_path / "run").exists()


def test_partial_last_line_is_ignored_then_cut_on_append(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]
    with MetricsWriter(tmp_path) as w:
        w.write({"step": 2, "loss": 1.9})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9}]


def test_corrupt_line_and_missing_file_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_summary_written_atomically(tmp_path, monkeypatch):
    write_summary(tmp_path, {"config": {"name": "qsdp"}, "loss": 1.0})
    assert read_summary(tmp_path)["config"]["name"] == "qsdp"

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_summary(tmp_path, {"config": {"name": "other"}})
    monkeypatch.undo()
    # The old summary is intact and no temporary file is left behind.
    assert json.loads((tmp_path / "summary.json").read_text())["config"]["name"] == "qsdp"
    assert os.listdir(tmp_path) == ["summary.json"]


def test_ema_smooth_is_debiased():
    np.testing.assert_allclose(ema_smooth(np.full(5, 3.0), weight=0.9), np.full(5, 3.0))
    assert len(ema_smooth(np.arange(1000.0))) == 1000


def test_plots_are_written_as_png(tmp_path):
    runs = [tmp_path / "run_a", tmp_path / "run_b", tmp_path / "run_c"]
    _fake_run(runs[0], "fsdp", bytes_per_step=4e6)
    _fake_run(runs[1], "qsdp", bytes_per_step=1e6)
    _fake_run(runs[2], "qsdp", bytes_per_step=1e6)  # same preset twice: labels disambiguated
    paths = plot_runs([str(r) for r in runs], str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in paths] == ["loss_vs_step.png", "loss_vs_bytes.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        assert os.path.getsize(p) > 10_000


def _curve_ends(ax) -> dict[str, float]:
    return {line.get_label(): float(line.get_xdata()[-1]) for line in ax.lines
            if line.get_label().endswith(" train")}


def test_loss_vs_bytes_has_a_panel_for_inter_node_bytes_and_one_for_all_bytes(tmp_path):
    # 30 steps; fsdp: 4 MB a step, 2 MB of them between nodes; sdp4bit: 3 MB, 0.2 MB between nodes
    _fake_run(tmp_path / "fsdp", "fsdp", bytes_per_step=4e6, inter_per_step=2e6)
    _fake_run(tmp_path / "sdp4bit", "sdp4bit", bytes_per_step=3e6, inter_per_step=0.2e6)
    inter, total = loss_figures([str(tmp_path / "fsdp"), str(tmp_path / "sdp4bit")])[LOSS_VS_BYTES].axes
    assert inter.get_xlabel() == "bytes between nodes (MB, cumulative)"
    assert total.get_xlabel() == "bytes on all links, inside and between nodes (MB, cumulative)"
    assert _curve_ends(inter) == pytest.approx({"fsdp train": 60.0, "sdp4bit train": 6.0})
    assert _curve_ends(total) == pytest.approx({"fsdp train": 120.0, "sdp4bit train": 90.0})


def test_runs_on_one_node_get_only_the_all_bytes_panel(tmp_path):
    _fake_run(tmp_path / "run", "qsdp", bytes_per_step=1e6)  # nothing between nodes
    (total,) = loss_figures([str(tmp_path / "run")])[LOSS_VS_BYTES].axes
    assert total.get_xlabel().startswith("bytes on all links")


def test_plot_errors_name_the_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plot_runs([str(tmp_path / "nope")], str(tmp_path / "plots"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"'.*empty' has no metrics.jsonl"):
        plot_runs([str(tmp_path / "empty")], str(tmp_path / "plots"))
    with MetricsWriter(tmp_path / "nobytes") as w:
        w.write({"step": 1, "loss": 3.0})
    with pytest.raises(ValueError, match="wire_bytes_total"):
        plot_runs([str(tmp_path / "nobytes")], str(tmp_path / "plots"))
    with pytest.raises(ValueError, match="at least one"):
        plot_runs([], str(tmp_path / "plots"))
