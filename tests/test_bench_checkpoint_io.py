"""``python -m benchmarks.checkpoint_io``: what it compares and what it reports."""

from __future__ import annotations

import json

import pytest

from benchmarks import checkpoint_io

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_the_load_without_digests_is_the_same_reader_and_each_part_of_the_load_with_them_is_timed(tmp_path):
    """The load with digests is compared with qsdp's own reader and planner without digests (DCP's
    own reader and planner are a row of their own); verify, read and agree are timed apart. The
    save with digests is compared with DCP's writer, and with DCP's writer cutting its writes in
    the same pieces without hashing."""
    out = tmp_path / "io.json"
    assert checkpoint_io.main(["--gb", "0.01", "--dim", "256", "--repeats", "1", "--json", "--save", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["load_without_digests"] == "PlainDataReader, PlainDataLoadPlanner"
    assert sorted(result["median_s"]) == ["load", "load_dcp", "load_digests", "save", "save_digests", "save_pieces"]
    assert sorted(result["overhead_pct"]) == ["load", "save", "save_vs_pieces"]
    assert sorted(result["load_phases"]) == ["agree", "read", "verify"]
    assert all(v["wall"] > 0 and v["cpu"] > 0 for v in result["load_phases"].values())
    assert set(result["plain_data_pct"]) == {"wall", "cpu"}
