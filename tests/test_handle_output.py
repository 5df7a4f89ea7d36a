"""What a user sees of a ``quantize_comms`` handle: a one-line repr, the byte meter as a table,
and the warning when a preset's inter-node settings go unused on one node."""

from __future__ import annotations

import warnings

import pytest

import qsdp
from distributed import run_pooled
import fsdp_models as fm
from qsdp.comm.meter import stats_table

pytestmark = pytest.mark.timeout(120)


def _one_step(rank, world):
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit")
    fm.train(model, 1, rank)
    return repr(handle), handle.comm_stats()


@pytest.fixture(scope="module")
def rank0():
    return run_pooled(_one_step, 4, local_world_size=2)[0]


def test_the_handle_prints_as_one_line_naming_preset_groups_and_layout(rank0):
    text, _ = rank0
    assert text == "QuantizedComms('sdp4bit', 3 FSDP groups, 4 ranks = 2 nodes x 2)"


def test_format_stats_prints_every_kind_and_link_of_a_real_step(rank0):
    _, stats = rank0
    lines = qsdp.format_stats(stats).splitlines()
    assert lines[0].split() == ["kind", "link", "bytes", "elements", "bits/elt"]
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in lines[2:]}
    for kind in ("weights", "grads"):
        for link in ("intra", "inter", "total"):
            c = stats[kind][link]
            bits = f"{c['bits_per_element']:.3f}" if c["elements"] else "-"
            assert rows[(kind, link)] == [f"{c['bytes']:,}", f"{c['elements']:,}", bits]
    assert all(rows[(kind, link)][0] != "0" for kind in ("weights", "grads") for link in ("intra", "inter"))


def test_control_rows_appear_only_when_control_messages_were_sent():
    quiet = stats_table({("weights", "intra"): (1000, 2000)})
    assert "control" not in qsdp.format_stats(quiet)
    assert "4.000" in qsdp.format_stats(quiet)
    agreed = stats_table({("control", "inter"): (8, 0)})
    assert [line.split()[:3] for line in qsdp.format_stats(agreed).splitlines() if "control" in line] == [
        ["control", "intra", "0"], ["control", "inter", "8"], ["control", "total", "8"]]


CASES = {  # preset, overrides, whether rank 0 warns
    "one node": ("sdp4bit", None, True),                     # torchrun's LOCAL_WORLD_SIZE: one node of 4
    "emulated": ("sdp4bit", {"local_world_size": 2}, False),  # 2 nodes x 2
    "nothing inter-node": ("qsdp", None, False),
}


def _warnings(rank, world):
    said = {}
    for case, (preset, overrides, _) in CASES.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qsdp.quantize_comms(fm.build(), preset, overrides=overrides)
        said[case] = [str(w.message) for w in caught if "local_world_size" in str(w.message)]
    return said


def test_one_node_warns_on_rank_0_naming_the_override_when_inter_node_settings_go_unused():
    results = run_pooled(_warnings, 4, local_world_size=4)
    for case, (_, _, warned) in CASES.items():
        assert all(not r[case] for r in results[1:]), case
        if warned:
            assert len(results[0][case]) == 1
            message = results[0][case][0]
            assert "overrides={'local_world_size': M}" in message and "grads.bits_inter=4 unused" in message
        else:
            assert results[0][case] == [], case
