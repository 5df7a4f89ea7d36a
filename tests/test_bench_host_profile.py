"""``python -m benchmarks.host_profile`` on the CPU: the files it writes per preset."""

from __future__ import annotations

from benchmarks import host_profile
from in_child import in_child


@in_child
def test_each_preset_gets_its_syncs_its_operators_and_its_python_profile(tmp_path):
    assert host_profile.main(["sdp4bit", "--model", "tiny", "--batch-size", "1", "--seq-len", "32",
                              "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sdp4bit-cprofile.txt", "sdp4bit-ops.txt", "sdp4bit-syncs.txt"]
    assert (tmp_path / "sdp4bit-syncs.txt").read_text().startswith("0 synchronizations in one step")  # none on a CPU
    assert "qsdp.comm.QuantizedReduceScatter" in (tmp_path / "sdp4bit-ops.txt").read_text()
    assert "_two_hops" in (tmp_path / "sdp4bit-cprofile.txt").read_text()
