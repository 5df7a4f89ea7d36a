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
    # In two levels, as the gradients travel: inside the node first, then across the nodes only
    # the node's sums of this rank's chunk (0.87 MB a rank, a flat one would send 1.73 MB there).
    assert 0.8e6 < r["round_extra_inter_bytes"] < 0.95e6
    assert phases["weights"]["bytes"] == phases["plain"]["bytes"]
    assert 0 < phases["decide"]["guard_bytes"] < 1000  # the round's sums
    assert 1 < r["bytes_per_step_every_50_vs_unguarded"] < 1.02
    assert "sdp4bit" in format_table(result)


def test_a_round_needs_room_between_rounds(capsys):
    assert main(["bench", "guard", "--every", "3"]) == 2
    assert "--every=3 must be at least 4" in capsys.readouterr().err


def test_under_hsdp_a_round_also_sums_the_exact_shard_across_the_replicas():
    result = measure(["hsdp4"], every=4, rounds=1, hsdp=True)
    r = result["presets"]["hsdp4"]
    phases = r["phases"]
    assert r["plain_steps_same_bytes"] and r["escalations"] == 0 and result["hsdp"]
    # The tiny GPT's 0.87M parameters, sharded over the node's 2 ranks: the exact fp32
    # reduce-scatter inside the node sends half the row (1.73 MB a rank), the exact all-reduce
    # across the 2 replicas half the shard, twice (1.73 MB, between the nodes).
    assert 3.3e6 < phases["gradients"]["guard_bytes"] < 3.7e6
    assert 1.6e6 < r["round_extra_inter_bytes"] < 1.9e6
    assert 1 < r["bytes_per_step_every_50_vs_unguarded"] < r["inter_bytes_per_step_every_50_vs_unguarded"]
    assert "(HSDP)" in format_table(result)
