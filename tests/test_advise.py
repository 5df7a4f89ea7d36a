"""`qsdp advise`: predictions from the simulator, the recommendation, the command line, the
links in the units of the hardware, what limits each setup, and the measured inter-node
bandwidth."""

from __future__ import annotations

import json
import math

import pytest

from qsdp import advise as adv
from qsdp import perfmodel as pm
from qsdp.cli import main as cli_main
from distributed import run_pooled

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
    r = adv.advise(int(1.3e9), 2, 8, "h800", link_gbit_per_gpu=8e6, margin=10.0)
    assert r["recommendation"]["preset"] == "fsdp"
    assert "would not pay" in r["recommendation"]["reason"]


def test_one_node_has_no_hsdp_rows():
    r = adv.advise(int(1e9), 1, 8)
    assert {row["layout"] for row in r["rows"]} == {"fsdp"}


def test_the_command_prints_json_with_the_recommendation(capsys):
    assert cli_main(["advise", "--params", "2.7B", "--nodes", "4", "--gpu", "h800", "--link", "800gbit", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["link"] == {"gbit_per_node": 800.0, "gbit_per_gpu": 100.0, "source": "given per node"}
    assert out["nodes"] == 4 and out["ranks_per_node"] == 8
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
    (["--params", "1B", "--nodes", "0"], "--nodes: must be an integer from 1 to"),
    (["--nodes", "2"], "one of the arguments --params --config is required"),
    (["--params", "1B", "--nodes", "2", "--link", "100"], "--link: '100' is not a link rate with its unit"),
    (["--params", "1B", "--nodes", "2", "--link", "100gbit", "--link-per-gpu", "12.5gbit"], "not allowed with"),
    (["--params", "1B", "--nodes", "2", "--inter-gbps", "12.5"], "write --link-per-gpu 12.5GB/s"),
    (["--params", "1B", "--nodes", "2", "--gpu", "custom", "--tflops", "300"],
     "--gpu custom needs --hbm, --intra-link, --link or --link-per-gpu, --ranks-per-node"),
    (["--params", "1B", "--nodes", "2", "--gpu", "h100", "--tflops", "300"], "--tflops describe a --gpu custom"),
])
def test_bad_arguments_are_named(argv, words, capsys):
    assert cli_main(["advise", *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("text,gbit", [("100gbit", 100.0), ("400Gbit/s", 400.0), ("3.2tbit", 3200.0),
                                       ("400Gbps", 400.0), ("50GB/s", 400.0), ("800 Mbit", 0.8)])
def test_a_rate_is_read_with_its_unit_in_gbit_per_second(text, gbit):
    assert pm.parse_rate(text) == pytest.approx(gbit)


@pytest.mark.parametrize("text", ["100", "100g", "12.5 GBit/z", "fast"])
def test_a_rate_without_its_unit_is_refused(text):
    with pytest.raises(ValueError, match="with its unit"):
        pm.parse_rate(text)


def test_a_nodes_nics_are_counted_times_their_rate():
    assert pm.parse_link("8x400gbit") == (8, 400.0)
    assert pm.parse_link("8 x 400 Gbit/s") == (8, 400.0)
    assert pm.parse_link("100gbit") == (1, 100.0)


def _advice(capsys, *args):
    assert cli_main(["advise", "--params", "7B", "--nodes", "4", "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    return out["rows"], out["recommendation"]


def test_a_nodes_link_gives_the_advice_of_the_per_gpu_share_it_stands_for(capsys):
    # 100 Gbit/s Ethernet shared by 8 GPUs: 12.5 Gbit/s, 1.5625 GB/s each
    per_node = _advice(capsys, "--gpu", "h100", "--link", "100gbit")
    assert per_node == _advice(capsys, "--gpu", "h100", "--link-per-gpu", "12.5gbit")
    assert per_node == _advice(capsys, "--gpu", "h100", "--link-per-gpu", "1.5625GB/s")
    rows, rec = per_node
    assert rec["preset"] == "sdp4bit" and rec["speedup_over_unquantized"] > 4


def test_the_python_api_and_the_command_take_the_same_units(capsys):
    rows, rec = _advice(capsys, "--gpu", "h100", "--link", "8x400gbit")
    api = adv.advise(int(7e9), 4, None, "h100", link_gbit=3200.0)
    assert api["rows"] == rows and api["recommendation"] == rec
    for row in rows:
        r = pm.predict_step(row["preset"], int(7e9), 4, 8, gpu="h100", link_gbit=3200.0, hsdp=row["layout"] == "hsdp")
        assert row["step_ms"] == pytest.approx(1e3 * r["step_s"], rel=1e-12)


def test_every_gpu_type_has_its_nvlink_memory_and_default_nics():
    assert {"a100", "h100", "h200", "h800"} <= set(pm.HARDWARE)
    for hw in pm.HARDWARE.values():
        assert hw.intra_gbps > 0 and hw.memory_gb > 0 and hw.nics >= 1
        # the model's link is the NICs' line rate at the type's efficiency, shared by the node's GPUs
        assert hw.inter_gbps == pytest.approx(hw.nics * hw.nic_gbit * hw.link_efficiency / 8 / hw.gpus_per_node, rel=1e-3)


def test_the_help_states_the_default_gpu_and_every_types_links(capsys):
    with pytest.raises(SystemExit):
        adv.main(["--help"])
    out = capsys.readouterr().out
    assert f"default {adv.DEFAULT_GPU}" in out and f"{adv.DEFAULT_GPU} (default)" in out
    for name in ("a100", "h100", "h200", "h800", "custom"):
        assert f"  {name}" in out
    assert "8 x 400 Gbit/s NICs at 80%" in out


def test_a_custom_gpu_is_priced_with_the_figures_given(capsys):
    custom = ["--gpu", "custom", "--tflops", "989", "--hbm", "3350GB/s", "--intra-link", "360GB/s",
              "--link", "100gbit", "--ranks-per-node", "8", "--memory-gb", "80"]
    assert _advice(capsys, *custom) == _advice(capsys, "--gpu", "h100", "--link", "100gbit")


def test_fewer_bytes_but_slower_is_explained_by_the_all_to_alls_fan_out():
    r = adv.advise(int(7e9), 4, 8, "h100", link_gbit=100.0)
    rows = {(x["layout"], x["preset"]): x for x in r["rows"]}
    fsdp, qsdp = rows["fsdp", "fsdp"], rows["fsdp", "qsdp"]
    assert qsdp["step_ms"] > fsdp["step_ms"] and qsdp["limit"] == "fan-out"
    assert qsdp["nic_gb_per_gpu"] > fsdp["nic_gb_per_gpu"]
    assert "24 ranks on other nodes" in qsdp["why"] and "more than fsdp's" in qsdp["why"]
    assert fsdp["limit"] == "link" and fsdp["why"].startswith("link bytes:")


def test_an_all_to_all_over_d_nodes_of_m_sends_about_m_times_a_rings_nic_bytes():
    for d, m in ((4, 8), (2, 4), (16, 8)):
        colls = [c for c in pm.step_collectives("qsdp", [1 << 20], d, m) if c.kind == "grads"]
        parts = pm.step_parts(colls, pm.HARDWARE["h100"], d, m)
        assert pm.fan_out(parts) == pytest.approx(m * m * (d - 1) / (d * m - 1))


def test_a_setup_whose_state_does_not_fit_names_memory_and_is_not_recommended():
    r = adv.advise(int(70e9), 4, 8, "h100")
    hsdp = [x for x in r["rows"] if x["layout"] == "hsdp"]
    assert all(not x["fits"] and x["limit"] == "memory" and "more than the h100's 80 GB" in x["why"] for x in hsdp)
    assert r["recommendation"]["layout"] == "fsdp"


def test_a_slow_intra_node_link_prices_the_node_replicas_exact_weights():
    nvlink, pcie = (adv.advise(int(7e9), 4, 8, "h100", link_gbit=100.0, intra_gbps=g) for g in (None, 25.0))
    rows = {k: {(x["layout"], x["preset"]): x for x in r["rows"]} for k, r in (("nvlink", nvlink), ("pcie", pcie))}
    sdp4bit, zeropp = ("fsdp", "sdp4bit"), ("fsdp", "zeropp")
    # the same bytes; on PCIe sdp4bit's exact intra-node weights, not its NIC bytes, bound it
    assert rows["pcie"][sdp4bit]["intra_gb_per_gpu"] == rows["nvlink"][sdp4bit]["intra_gb_per_gpu"]
    assert rows["nvlink"][sdp4bit]["limit"] == "link" and rows["pcie"][sdp4bit]["limit"] == "intra"
    assert "node replicas' exact weights" in rows["pcie"][sdp4bit]["why"]
    assert rows["nvlink"][sdp4bit]["step_ms"] < rows["nvlink"][zeropp]["step_ms"]
    assert rows["pcie"][sdp4bit]["step_ms"] > rows["pcie"][zeropp]["step_ms"]


def test_the_table_names_what_limits_each_setup(capsys):
    assert cli_main(["advise", "--params", "7B", "--nodes", "4", "--gpu", "h100", "--link", "100gbit"]) == 0
    out = capsys.readouterr().out
    assert "100 Gbit/s per node, 12.5 Gbit/s per GPU (given)" in out
    assert "limited by" in out and "what limits each setup" in out
    assert "  qsdp          all-to-all fan-out:" in out


def _measure(rank, world):
    gbps, nodes, per_node, speak = adv._measure()
    return gbps, nodes, per_node, speak


def test_measure_times_an_all_gather_between_the_nodes_of_the_world():
    results = run_pooled(_measure, 4, local_world_size=2)
    gbps = {r[0] for r in results}
    assert len(gbps) == 1 and all(math.isfinite(g) and g > 0 for g in gbps)  # the slowest rank's, everywhere
    assert [r[1:] for r in results] == [(2, 2, True), (2, 2, False), (2, 2, False), (2, 2, False)]


def _measure_one_node(rank, world):
    try:
        adv.measure_link_gbit()
    except ValueError as e:
        return str(e)
    return None


def test_measure_on_one_node_says_it_needs_two():
    assert all("at least 2 nodes" in m for m in run_pooled(_measure_one_node, 2, local_world_size=2))


# ----------------------------------------------------------------------------- the host's time


def _rows(r: dict) -> dict:
    return {(row["layout"], row["preset"]): row for row in r["rows"]}


def test_at_400_gbit_on_the_h200s_host_sdp4bit_pays_for_its_host_time():
    r = adv.advise(int(7e9), 4, gpu="h200", link_gbit_per_gpu=400)
    rows = _rows(r)
    sdp, fsdp = rows["fsdp", "sdp4bit"], rows["fsdp", "fsdp"]
    assert r["host_factor"] == pm.HARDWARE["h200"].host_factor > 0
    assert sdp["host_ms"] > 0 and fsdp["host_ms"] == 0
    assert sdp["step_ms"] < fsdp["step_ms"] and "costs more than it saves" not in sdp["why"]


def test_on_a_host_slow_enough_quantization_costs_more_than_it_saves():
    r = adv.advise(int(7e9), 4, gpu="h200", link_gbit_per_gpu=400, host_factor=60)
    rows = _rows(r)
    sdp, fsdp = rows["fsdp", "sdp4bit"], rows["fsdp", "fsdp"]
    assert sdp["step_ms"] > fsdp["step_ms"] and sdp["limit"] == "host"
    assert "quantization costs more than it saves" in sdp["why"]
    assert (r["recommendation"]["layout"], r["recommendation"]["preset"]) != ("fsdp", "sdp4bit")


def test_at_10_gbit_quantizing_still_pays_with_the_host_priced():
    r = adv.advise(int(1.3e9), 4, gpu="h200", link_gbit=10)
    rows = _rows(r)
    assert rows["fsdp", "sdp4bit"]["host_ms"] > 0
    assert rows["fsdp", "sdp4bit"]["step_ms"] < rows["fsdp", "fsdp"]["step_ms"]
    assert r["recommendation"]["preset"] != "fsdp" and r["recommendation"]["speedup_over_unquantized"] > 1.5


def test_with_no_host_cost_the_old_answers_hold():
    r = adv.advise(int(7e9), 4, gpu="h200", link_gbit_per_gpu=400, host_factor=0)
    assert all(row["host_ms"] == 0 for row in r["rows"])
    assert all(row["step_ms"] == pytest.approx(row["compute_ms"] + row["comm_ms"]) for row in r["rows"])
    rows = _rows(r)
    assert rows["fsdp", "sdp4bit"]["step_ms"] < rows["fsdp", "fsdp"]["step_ms"]
    assert "costs more than it saves" not in rows["fsdp", "sdp4bit"]["why"]
    assert r["recommendation"]["preset"] != "fsdp"


def test_the_command_takes_the_host_factor(capsys):
    assert cli_main(["advise", "--params", "1.3B", "--nodes", "4", "--gpu", "h200", "--link", "400gbit",
                     "--host-factor", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["host_factor"] == 0 and r["host_source"] == "given"
    assert all(row["host_ms"] == 0 for row in r["rows"])
    assert cli_main(["advise", "--params", "1.3B", "--nodes", "4", "--gpu", "h200", "--link", "400gbit"]) == 0
    assert "x each collective's census host floor (measured on the h200's host)" in capsys.readouterr().out
