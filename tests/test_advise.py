"""`qsdp advise`: predictions from the simulator, the recommendation, the command line and
the measured inter-node bandwidth."""

from __future__ import annotations

import json
import math

import pytest

from qsdp import advise as adv
from qsdp.cli import main as cli_main
from distributed import run_world

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("text,n", [("1.3B", 1_300_000_000), ("350M", 350_000_000), ("7e9", 7_000_000_000)])
def test_parameter_counts_are_read_with_suffixes(text, n):
    assert adv.parse_params(text) == n


def test_a_shape_has_about_the_asked_parameters():
    for n in (125e6, 1.3e9, 7e9, 70e9):
        r = adv.advise(int(n), 2, 8)
        assert abs(r["params"] / n - 1) < 0.15


def test_a_slow_link_recommends_a_quantized_setup():
    r = adv.advise(int(1.3e9), 16, 4, "a100")
    rec = r["recommendation"]
    assert rec["preset"] != "fsdp" and rec["speedup_over_unquantized"] > 1.5
    assert {(row["layout"], row["preset"]) for row in r["rows"]} == {
        *(("fsdp", p) for p in adv.FLAT_PRESETS), *(("hsdp", p) for p in adv.HSDP_PRESETS)}


def test_when_nothing_pays_by_the_margin_the_unquantized_setup_is_recommended():
    r = adv.advise(int(1.3e9), 2, 8, "h800", inter_gbps=1e6, margin=10.0)
    assert r["recommendation"]["preset"] == "fsdp"
    assert "would not pay" in r["recommendation"]["reason"]


def test_one_node_has_no_hsdp_rows():
    r = adv.advise(int(1e9), 1, 8)
    assert {row["layout"] for row in r["rows"]} == {"fsdp"}


def test_the_command_prints_json_with_the_recommendation(capsys):
    assert cli_main(["advise", "--params", "2.7B", "--nodes", "4", "--gpu", "h800", "--inter-gbps", "12.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inter_gbps_per_gpu"] == 12.5 and out["nodes"] == 4 and out["ranks_per_node"] == 8
    rec = out["recommendation"]
    assert any((r["layout"], r["preset"], r["step_ms"]) == (rec["layout"], rec["preset"], rec["step_ms"]) for r in out["rows"])
    assert out["meta"]["command"].startswith("qsdp advise --params 2.7B")


def test_sdp4bit_state_per_gpu_exceeds_fsdps_by_its_replica(capsys):
    assert cli_main(["advise", "--params", "6.86B", "--nodes", "16", "--ranks-per-node", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["layout"], r["preset"]): r for r in out["rows"]}
    fsdp, sdp4bit = rows["fsdp", "fsdp"], rows["fsdp", "sdp4bit"]
    for p in ("fsdp", "qsdp", "zeropp"):  # no replica
        assert rows["fsdp", p]["replica_gb_per_gpu"] == 0 and rows["fsdp", p]["state_gb_per_gpu"] == fsdp["state_gb_per_gpu"]
    assert sdp4bit["state_gb_per_gpu"] == pytest.approx(fsdp["state_gb_per_gpu"] + sdp4bit["replica_gb_per_gpu"])
    # node replicas: 1/M of the model, bf16, on every GPU
    assert sdp4bit["replica_gb_per_gpu"] == pytest.approx(2 * out["params"] / 8 / 1e9, rel=0.05)
    # HSDP shards inside the node: its weights never cross a node, so they travel exactly and
    # no replica is held
    assert rows["hsdp", "sdp4bit"]["replica_gb_per_gpu"] == 0.0


def test_a_hugging_face_config_gives_the_shape(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                               "vocab_size": 32000}))
    assert cli_main(["advise", "--config", str(cfg), "--nodes", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"] == {"n_layer": 32, "n_embd": 4096, "n_head": 32, "vocab_size": 32000}
    assert 6.0e9 < out["params"] < 7.0e9


def test_the_command_prints_a_table_naming_the_recommendation(capsys):
    assert cli_main(["advise", "--params", "1.3B", "--nodes", "16", "--gpu", "a100"]) == 0
    out = capsys.readouterr().out
    assert "native HSDP" in out and "recommended:" in out


@pytest.mark.parametrize("argv,words", [
    (["--params", "lots", "--nodes", "2"], "--params='lots'"),
    (["--params", "1B"], "--nodes is required"),
    (["--params", "1B", "--nodes", "0"], "--nodes=0 must be positive"),
    (["--nodes", "2"], "one of the arguments --params --config is required"),
])
def test_bad_arguments_are_named(argv, words, capsys):
    assert cli_main(["advise", *argv]) == 2
    assert words in capsys.readouterr().err


def _measure(rank, world):
    gbps, nodes, per_node, speak = adv._measure()
    return gbps, nodes, per_node, speak


def test_measure_times_an_all_gather_between_the_nodes_of_the_world():
    results = run_world(_measure, 4, local_world_size=2)
    gbps = {r[0] for r in results}
    assert len(gbps) == 1 and all(math.isfinite(g) and g > 0 for g in gbps)  # the slowest rank's, everywhere
    assert [r[1:] for r in results] == [(2, 2, True), (2, 2, False), (2, 2, False), (2, 2, False)]


def _measure_one_node(rank, world):
    try:
        adv.measure_inter_gbps()
    except ValueError as e:
        return str(e)
    return None


def test_measure_on_one_node_says_it_needs_two():
    assert all("at least 2 nodes" in m for m in run_world(_measure_one_node, 2, local_world_size=2))
