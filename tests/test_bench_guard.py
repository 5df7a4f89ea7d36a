"""`qsdp bench guard`: a round's extra bytes, from the byte meter, through the real launcher."""

import pytest

from qsdp.bench.guard_cost import format_table, measure
from qsdp.cli import main

pytestmark = pytest.mark.timeout(240)


def test_a_round_adds_one_exact_reduce_scatter_and_plain_steps_send_what_unguarded_ones_do():
    result = measure(["sdp4bit"], every=4, rounds=1)
    r = result["presets"]["sdp4bit"]
    phases = r["phases"]
    assert set(phases) == {"plain", "gradients", "weights", "decide"}
    assert r["plain_steps_same_bytes"] and r["escalations"] == 0
    # The guarded step carries the round's bytes: its exact fp32 reduce-scatter (the tiny GPT's
    # 0.87M parameters over 4 ranks, 3 of 4 chunks sent: about 2.6 MB a rank).
    assert phases["gradients"]["guard_bytes"] == phases["gradients"]["bytes"] - phases["plain"]["bytes"]
    assert 2.4e6 < phases["gradients"]["guard_bytes"] < 2.8e6
    assert phases["weights"]["bytes"] == phases["plain"]["bytes"]
    assert 0 < phases["decide"]["guard_bytes"] < 1000  # the round's sums
    assert 1 < r["bytes_per_step_every_50_vs_unguarded"] < 1.02
    assert "sdp4bit" in format_table(result)


def test_a_round_needs_room_between_rounds(capsys):
    assert main(["bench", "guard", "--every", "3"]) == 2
    assert "--every=3 must be at least 4" in capsys.readouterr().err
