"""`qsdp bench volume`: measured bits per element, through the real elastic launcher."""

import json
import subprocess
import sys

import pytest

from qsdp.bench.volume import format_table, measure

pytestmark = pytest.mark.timeout(240)


def test_volume_reports_meter_figures_for_fsdp_and_sdp4bit():
    result = measure(("fsdp", "sdp4bit"), steps=1)
    fsdp, sdp = result["presets"]["fsdp"], result["presets"]["sdp4bit"]
    assert fsdp["weights_bits_per_elt"] == 32.0 and fsdp["grads_inter_bits_per_elt"] == 32.0
    # node replicas on 2 x 2: 4 + 32/2048 bits (plus group padding of small shards) between
    # nodes, the node's rows in fp32 inside
    assert 4.0 < sdp["weights_inter_bits_per_elt"] < 4.3
    assert sdp["weights_intra_bits_per_elt"] == 32.0
    assert 8.25 <= sdp["grads_intra_bits_per_elt"] < 8.4
    assert 4.25 <= sdp["grads_inter_bits_per_elt"] < 4.4
    assert sdp["grads_inter_reduction_vs_fsdp"] > 6
    assert "sdp4bit" in format_table(result)


@pytest.mark.slow  # 11 s; the same measurement as above, through the command line
def test_volume_cli_prints_one_json_object():
    out = subprocess.run(
        [sys.executable, "-m", "qsdp.cli", "bench", "volume", "--presets", "qsdp", "--steps", "1", "--json"],
        capture_output=True, text=True, timeout=200,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert set(data["presets"]["qsdp"]) >= {"weights_bits_per_elt", "grads_intra_bits_per_elt", "grads_inter_bits_per_elt"}
    assert 8.0 < data["presets"]["qsdp"]["weights_bits_per_elt"] < 8.5
