"""The performance model's entry point, ``predict_step``: the step of the functions it stands on
(and of ``qsdp advise``), the inter-node link given per node in Gbit/s, a measured compute
time in place of the FLOPs model, and its argument errors."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from qsdp import perfmodel as pm
from qsdp.advise import advise
from qsdp.config import resolve_config
from qsdp.gpt_shape import GPTConfig, n_params


@pytest.mark.parametrize("hsdp", [False, True])
def test_predict_step_is_the_simulated_step_of_the_job_it_describes(hsdp):
    r = pm.predict_step("sdp4bit", int(1.3e9), 4, 8, gpu="h800", hsdp=hsdp)
    setup = pm.ShapeSetup("custom", "h800", 32, 1, 1, layout="layer", zero3=True, **pm.gpt_shape(int(1.3e9)))
    hw = dataclasses.replace(pm.HARDWARE["h800"], gpus_per_node=8)
    expected = (pm.simulate_hsdp_step if hsdp else pm.simulate_step)(setup, "sdp4bit", hw)
    assert {k: v for k, v in r.items() if k not in ("params", "inter_gbps_per_gpu")} == expected
    assert r["params"] == n_params(setup.gpt()) and r["inter_gbps_per_gpu"] == 40.0


def test_advise_predicts_the_steps_of_predict_step():
    rows = advise(int(2.7e9), 4, 8, "h800", link_gbit_per_gpu=100.0)["rows"]
    for row in rows:
        r = pm.predict_step(row["preset"], int(2.7e9), 4, 8, gpu="h800", link_gbit=12.5 * 8 * 8,
                            hsdp=row["layout"] == "hsdp")
        assert row["step_ms"] == pytest.approx(1e3 * r["step_s"], rel=1e-12)


def test_a_nodes_link_is_shared_by_its_ranks():
    hw = pm.cluster_hardware("a100", 4, link_gbit=100.0, link_latency_us=1000.0, intra_gbps=5.0)
    assert (hw.gpus_per_node, hw.inter_gbps, hw.inter_latency_us, hw.intra_gbps) == (4, 100.0 / 8 / 4, 1000.0, 5.0)
    slow, fast = (pm.predict_step("fsdp", int(1e9), 4, 4, gpu="a100", link_gbit=g)["comm_s"] for g in (10.0, 100.0))
    assert slow > 5 * fast
    share = pm.predict_step("fsdp", int(1e9), 4, 4, gpu="a100", link_gbit_per_gpu=2.5)
    assert share == pm.predict_step("fsdp", int(1e9), 4, 4, gpu="a100", link_gbit=10.0)


def test_a_measured_compute_time_replaces_the_flops_model():
    r = pm.predict_step("qsdp", int(1e9), 2, 4, compute_s=2.0, overlap=0.5)
    assert r["compute_s"] == 2.0
    assert r["step_s"] == pytest.approx(2.0 + max(0.0, r["comm_s"] - 1.0))


def test_a_given_shape_on_an_fp32_wire():
    shape = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256}
    r = pm.predict_step("sdp4bit", shape=shape, nodes=2, ranks_per_node=2, seq_len=64, micro_batch=4,
                        param_bytes=4, grad_bytes=4)
    assert r["params"] == n_params(GPTConfig(block_size=64, **shape))
    assert r["replica_bytes"] > 0 and r["bytes"]["weights"]["inter"] > 0


@pytest.mark.parametrize("change,words", [
    ({"params": None}, "give either params or shape"),
    ({"shape": {"n_layer": 2, "n_embd": 64, "n_head": 4}}, "give either params or shape"),
    ({"link_gbit": 0.0}, "link_gbit=0.0 must be positive"),
    ({"gpu": "v100"}, "gpu='v100'; known: a100, h100, h200, h800"),
    ({"link_gbit": 100.0, "link_gbit_per_gpu": 12.5}, "not both"),
    ({"nodes": 0}, "nodes=0 and ranks_per_node=4 must be positive"),
    ({"overlap": 2.0}, "overlap=2.0 must be in [0, 1]"),
])
def test_bad_arguments_are_named(change, words):
    args = {"params": int(1e9), "nodes": 2, "ranks_per_node": 4, **change}
    with pytest.raises(ValueError, match=re.escape(words)):
        pm.predict_step("fsdp", **args)


def _host_cluster(**changes) -> pm.Hardware:
    """A CPU cluster of 2 ranks per node: 1 GB/s host copies, 1 ms per step, a 0.1 GB/s link."""
    return dataclasses.replace(pm.HARDWARE["a100"], **{"gpus_per_node": 2, "intra_gbps": 1.0, "inter_gbps": 0.1,
                                                      "intra_latency_us": 1000.0, "inter_latency_us": 1000.0,
                                                      **changes})


def test_every_codec_call_pays_its_fixed_cost():
    c = pm.Collective("grads", "a2a", 1000, 10**6, 1, 2, quantize=10**6, dequantize=4 * 10**6)
    plain = pm.kernel_times(c, _host_cluster(), {"quantize": 1.0, "dequantize": 2.0})
    called = pm.kernel_times(c, _host_cluster(codec_call_us=500.0), {"quantize": 1.0, "dequantize": 2.0})
    assert plain == pytest.approx((4e-3, 8e-3))
    assert called == pytest.approx((4.5e-3, 8.5e-3))
    assert pm.kernel_times(dataclasses.replace(c, quantize=0, dequantize=0), _host_cluster(codec_call_us=500.0),
                           None) == (0.0, 0.0)


def test_a_reduce_scatter_run_as_a_ring_all_reduce_costs_twice_a_ring():
    ring = pm.Collective("grads", "ring", 10**6, 250_000, 1, 2)
    twice = dataclasses.replace(ring, algo="ring_allreduce")
    hw = _host_cluster()
    assert pm.wire_parts(twice, hw, 2, 2) == pytest.approx(tuple(2 * x for x in pm.wire_parts(ring, hw, 2, 2)))
    # a ring over 2 x 2 ranks: 3 chunks in and out of each rank, 3 across the node's boundary (2 ranks)
    assert pm.wire_parts(ring, hw, 2, 2) == pytest.approx((3e-3, 3e6 / 2 / 0.1e9, 3e6 / 2 / 1e9, 3e-3))


def test_host_staged_copies_add_up_and_the_link_runs_alongside():
    c = pm.Collective("weights", "a2a", 10**6, 250_000, 1, 2)
    dedicated, staged = _host_cluster(), _host_cluster(host_staged=True)
    # dedicated links: the slower of the two; host-staged: every byte is copied by the host ...
    assert pm.wire_time(c, dedicated, 2, 2) == pytest.approx(max(1e-3, 2e-2) + 3e-3)
    assert pm.wire_time(c, staged, 2, 2) == pytest.approx(max(1e-3 + 2e-3, 2e-2) + 3e-3)
    # ... and comm_time keeps the link's own time apart, for the step to overlap
    ct = pm.comm_time([c], staged, 2, 2)
    assert (ct["weights"], ct["link"]) == pytest.approx((1e-3 + 2e-3 + 3e-3, 2e-2))
    assert pm.comm_time([c], dedicated, 2, 2)["link"] == 0.0


def test_every_collective_names_the_comm_step_it_starts():
    shards = [4096, 65536]
    for preset in ("fsdp", "qsdp", "sdp4bit", "zeropp"):
        for c in pm.step_collectives(preset, shards, 2, 2, param_bytes=4, grad_bytes=4):
            # the second hop of a two-level slice continues the slice its first hop started
            assert c.call in pm.CALLS if c.hop != 2 else c.call is None


def test_a_measured_comm_step_costs_its_fixed_part_and_its_elements():
    hw = _host_cluster(host_staged=True, call_us={"one_level_reduce_scatter": 2000.0},
                       call_ns_per_element={"one_level_reduce_scatter": 10.0})
    c = pm.Collective("grads", "a2a", 10**6, 10**5, 1, 2, quantize=10**5, dequantize=10**5,
                      call="one_level_reduce_scatter")
    # instead of its latency, copies and codecs: 2 ms + 10 ns x 1e5 elements
    assert pm.host_time(c, hw, 2, 2, {"quantize": 1.0, "dequantize": 1.0}) == pytest.approx(3e-3)
    unmeasured = dataclasses.replace(c, call="reduce_scatter")
    assert pm.host_time(unmeasured, hw, 2, 2, {"quantize": 1.0, "dequantize": 1.0}) > 3e-3


def test_the_second_hop_of_a_measured_two_level_slice_is_in_the_slices_cost():
    hop2 = pm.Collective("grads", "a2a_inter", 1000, 1000, 0, 1, quantize=2000, dequantize=2000, pipeline=0, hop=2)
    assert pm.host_time(hop2, _host_cluster(host_staged=True, call_us={"two_level_slice": 500.0}), 2, 2, None) == 0.0
    assert pm.host_time(hop2, _host_cluster(host_staged=True), 2, 2, None) > 0.0


def test_a_host_staged_ring_copies_each_chunk_once():
    ring = pm.Collective("weights", "ring", 10**6, 250_000, 1, 2)
    # 3 chunks to one neighbour at 1 GB/s, and 3 steps of 1 ms: the boundary's share is not copied twice
    assert pm.host_time(ring, _host_cluster(host_staged=True), 2, 2, None) == pytest.approx(3e-3 + 3e-3)


def test_a_synchronous_step_adds_compute_and_every_collectives_host_time_on_an_unshaped_link():
    hw = _host_cluster(host_staged=True, inter_gbps=float("inf"), call_us={"gather": 1000.0})
    colls = [pm.Collective("weights", "ring", 10**6, 250_000, 1, 2, call="gather")] * 4
    step = pm.synchronous_step(0.1, colls, hw, 2, 2)
    assert step == {"step_s": pytest.approx(0.104), "host_s": pytest.approx(0.104), "link_wait_s": 0.0}


def test_the_shaped_links_bucket_passes_a_burst_at_once_and_the_rest_at_its_rate():
    c = pm.Collective("grads", "a2a_inter", 10**6, 10**5, 0, 1, call="difference_update")
    slow = dict(host_staged=True, inter_gbps=0.01, call_us={"difference_update": 0.0})
    # 1 MB over 10 MB/s: 0.1 s, less the host's own copy of it (1 ms at 1 GB/s) ...
    assert pm.synchronous_step(0.0, [c], _host_cluster(**slow), 2, 2)["link_wait_s"] == pytest.approx(0.099)
    # ... nothing where a full bucket holds it, half where it holds half
    assert pm.synchronous_step(0.0, [c], _host_cluster(**slow, inter_burst_bytes=2e6), 2, 2)["link_wait_s"] == 0.0
    half = pm.synchronous_step(0.0, [c], _host_cluster(**slow, inter_burst_bytes=5e5), 2, 2)["link_wait_s"]
    assert half == pytest.approx(0.049)


def test_the_bucket_refills_while_the_host_works():
    c = pm.Collective("grads", "a2a_inter", 10**6, 10**5, 0, 1, call="difference_update")
    hw = _host_cluster(host_staged=True, inter_gbps=0.01, inter_burst_bytes=1e6, call_us={"difference_update": 0.0})
    # two 1 MB sends: the second finds an empty bucket unless 0.1 s of compute (1 MB of tokens) came between
    assert pm.synchronous_step(0.0, [c, c], hw, 2, 2)["link_wait_s"] == pytest.approx(0.099)
    assert pm.synchronous_step(0.2, [c, c], hw, 2, 2)["link_wait_s"] == 0.0


def test_the_bucket_refills_while_the_host_works_on_a_collective_inside_the_node():
    c = pm.Collective("grads", "a2a_inter", 10**6, 10**5, 0, 1, call="difference_update")
    inside = pm.Collective("grads", "a2a_intra", 10**6, 10**5, 1, 0, call="two_level_slice")
    hw = _host_cluster(host_staged=True, inter_gbps=0.01, inter_burst_bytes=1e6,
                       call_us={"difference_update": 0.0, "two_level_slice": 1e5})
    # the 0.1 s the host spends on the collective inside the node refills 1 MB of tokens
    assert pm.synchronous_step(0.0, [c, c], hw, 2, 2)["link_wait_s"] == pytest.approx(0.099)
    assert pm.synchronous_step(0.0, [c, inside, c], hw, 2, 2)["link_wait_s"] == 0.0


def _grad_exchanges(config, shards, host_staged):
    grads = [c for c in pm.step_collectives(config, shards, 2, 2, host_staged=host_staged) if c.kind == "grads"]
    return grads, [sum(c.pipeline == gi and c.hop == 1 for c in grads) for gi in range(len(shards))]


def test_auto_slices_travel_in_exchanges_of_at_least_the_minimum_bytes_on_gpus_and_one_on_host_staged():
    shards = [4096, 1 << 20, 1 << 24]
    auto = resolve_config("sdp4bit")
    on_gpus, per_group = _grad_exchanges(auto, shards, host_staged=False)
    # one rounding slice for the small shard, 8 for the others; hop 2 of 2 nodes moves about
    # 2 x 0.53 bytes an element: the 8 slices of 1M elements together make one exchange of
    # 1.1 MB, each slice of 16M elements reaches 1 MiB alone
    assert per_group == [1, 1, 8]
    for c in on_gpus:
        buffer = 2 * c.row_bytes  # this rank's send buffer: its rows to the 2 ranks of each hop
        if per_group[c.pipeline] > 1:
            assert buffer >= auto.grads.pipeline_min_bytes
    staged, per_group_staged = _grad_exchanges(auto, shards, host_staged=True)
    assert per_group_staged == [1, 1, 1]
    assert pm.collective_bytes(staged) == pm.collective_bytes(on_gpus)
    assert sum(c.elements for c in staged) == sum(c.elements for c in on_gpus)
    # the threshold is the config's: 1 byte gives every slice its exchange (the small shard has one)
    _, per_slice = _grad_exchanges(resolve_config("sdp4bit", {"grads.pipeline_min_bytes": 1}), shards, False)
    assert per_slice == [1, 8, 8]
    # a slice count is what it says, host-staged or not
    eight = resolve_config("sdp4bit", {"grads.pipeline_slices": 8})
    assert _grad_exchanges(eight, shards, host_staged=True)[1] == [1, 8, 8]


def test_the_advisor_prices_each_exchange_the_rule_leaves_with_its_latency():
    # Small layers on GPUs: "auto" sends each group's slices in one exchange per hop where 8
    # slices pay 16 all-to-all latencies; the codec work and the bytes are the same.
    small = dict(n_layer=4, n_embd=256, n_head=4)
    auto = pm.predict_step("sdp4bit", shape=small, nodes=2, ranks_per_node=8)
    eight = pm.predict_step(resolve_config("sdp4bit", {"grads.pipeline_slices": 8}), shape=small, nodes=2,
                            ranks_per_node=8)
    assert auto["bytes"] == eight["bytes"]
    assert auto["grads_s"] < eight["grads_s"]
    assert auto["weights_s"] == eight["weights_s"]
    rows = {(r["layout"], r["preset"]): r for r in advise(None, 2, 8, shape=small)["rows"]}
    assert rows[("fsdp", "sdp4bit")]["comm_ms"] == pytest.approx(1e3 * auto["comm_s"])


# ----------------------------------------------------------------------------- the host on a GPU


def _group_launches(preset: str, host_staged: bool, counts=None) -> int:
    from qsdp.perfmodel import launches as ln

    colls = pm.step_collectives(preset, [1 << 22], 2, 4, gathers=0, host_staged=host_staged,
                                counts=counts or ln.CENSUS)
    return sum(c.launches for c in colls if c.kind == "grads")


def test_at_c14eb26_a_two_level_reduce_scatter_launched_per_group_and_per_slice():
    from qsdp.perfmodel import launches as ln

    old = ln.AT_C14EB26
    assert _group_launches("zeropp", host_staged=False, counts=old) == 6 + 9  # one rounding slice
    # eight slices: in several exchanges on GPUs, one on gloo; the same launches
    assert (_group_launches("sdp4bit", host_staged=False, counts=old)
            == _group_launches("sdp4bit", host_staged=True, counts=old) == 6 + 9 * 8)


def test_a_two_level_reduce_scatter_launches_per_group_and_per_exchange_whatever_its_slices():
    # one exchange per hop where the host moves the bytes: the same launches for 1 and 8 slices
    assert _group_launches("zeropp", host_staged=True) == _group_launches("sdp4bit", host_staged=True) == 1 + 3
    # pipelined on GPUs: each exchange of the 8 slices of a 4M-element group adds its 3 kernels
    sdp = pm.step_collectives("sdp4bit", [1 << 22], 2, 4, gathers=0)
    exchanges = sum(1 for c in sdp if c.call == "two_level_slice")
    assert exchanges > 1 and _group_launches("sdp4bit", host_staged=False) == 1 + 3 * exchanges


def test_the_models_launch_counts_are_those_the_census_committed():
    from qsdp.perfmodel import launches as ln

    census = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/census.json").read_text())
    rows = {(r["preset"], r["collective"]): r["launches"] for r in census["rows"]}
    c = ln.CENSUS
    assert rows["qsdp", "gather_direct"] == rows["zeropp", "gather_direct"] == c.per_call["quantized_gather"]
    assert rows["sdp4bit", "gather_difference"] == c.per_call["difference_update"] + c.per_call["replica_fill"]
    assert rows["qsdp", "reduce_scatter"] == c.per_call["one_level_reduce_scatter"]
    for preset in ("sdp4bit", "zeropp"):  # one exchange per hop in the census (gloo's grouping)
        assert rows[preset, "reduce_scatter"] == c.two_level(slices=8, first=True)
    for preset in ("qsdp", "sdp4bit", "zeropp"):
        assert rows[preset, "hsdp_all_reduce"] == sum(c.hsdp_all_reduce)


def test_fsdps_collectives_launch_nothing_beyond_fsdp2s_own():
    colls = pm.step_collectives("fsdp", [4096] * 3, 2, 4)
    assert colls and all(c.launches == 0 for c in colls)


def test_the_h200_host_factor_is_each_presets_wall_beyond_fsdps_over_its_reduce_scatters_census_floor():
    from qsdp.perfmodel import host_census, host_cost, launches as ln

    walls = {p: wall for p, (_, wall) in ln.H200_CODEC_SHARE.items()}
    factors = host_cost.host_factors()
    # 13 FSDP groups, one reduce-scatter each: qsdp +9.43 ms for 243 us, zeropp +24.04 for 521, sdp4bit +107.72 for 2843
    for preset, floor in host_cost.C14EB26_REDUCE_SCATTER_US.items():
        assert factors[preset] == pytest.approx((walls[preset] - walls["fsdp"]) * 1e3 / (13 * floor))
    assert sorted(round(f, 2) for f in factors.values()) == [2.91, 2.99, 3.55]
    assert round(host_cost.host_factor(), 1) == host_census.H200_HOST_FACTOR == pm.HARDWARE["h200"].host_factor


def test_the_models_host_floors_are_those_the_census_committed():
    from qsdp.perfmodel import host_census

    census = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/census-host.json").read_text())
    assert host_census.HOST_US == {(r["preset"], r["collective"]): r["host_us"] for r in census["rows"]}


def test_each_comm_step_is_priced_at_its_census_floor():
    from qsdp.perfmodel.host_census import HOST_US, call_host_us

    assert call_host_us("qsdp", "one_level_reduce_scatter") == HOST_US["qsdp", "reduce_scatter"]
    assert call_host_us("zeropp", "quantized_gather") == HOST_US["zeropp", "gather_direct"]
    # a difference's exchange is what a step's gather adds to the gather that only fills and agrees
    assert call_host_us("sdp4bit", "difference_update") == pytest.approx(
        HOST_US["sdp4bit", "gather_difference_step"] - HOST_US["sdp4bit", "gather_difference"])
    assert call_host_us("fsdp", "gather") == call_host_us("fsdp", "reduce_scatter") == 0.0
    # a config the census did not measure: the largest floor of its kind
    assert call_host_us("custom", "quantized_gather") == max(HOST_US["qsdp", "gather_direct"],
                                                             HOST_US["zeropp", "gather_direct"])
    sdp = pm.step_collectives("sdp4bit", [1 << 22], 2, 4, gathers=0)
    priced = [c for c in sdp if c.host_us]
    assert len(priced) == 1 and priced[0].host_us == HOST_US["sdp4bit", "reduce_scatter"]  # its first exchange


def _step(host_factor: float, host_staged: bool = False) -> dict:
    hw = dataclasses.replace(pm.HARDWARE["h200"], host_factor=host_factor, host_staged=host_staged)
    setup = pm.fsdp2_setup("h200", 2, 8, pm.gpt_shape(int(1.3e9)))
    return pm.simulate_step(setup, "sdp4bit", hw)


def test_a_gpu_step_adds_its_collectives_census_floors_times_the_host_factor():
    r, one, free = _step(3.0), _step(1.0), _step(0.0)
    assert one["host_s"] > 0 and r["host_s"] == pytest.approx(3 * one["host_s"])
    assert r["step_s"] == pytest.approx(r["compute_s"] + r["exposed_comm_s"] + r["host_s"])
    assert free["host_s"] == 0 and r["step_s"] - free["step_s"] == pytest.approx(r["host_s"])


def test_a_host_staged_step_prices_no_census_floor_its_measured_host_time_holds_it():
    assert _step(3.0, host_staged=True)["host_s"] == 0
