"""`qsdp bench simulate`'s HSDP rows: the performance model's HSDP bytes against the meter of a
real 2 x 2 HSDP step, and the rows in the result."""

from __future__ import annotations

import dataclasses

import pytest

import qsdp
from distributed import run_world
import fsdp_models as fm
from qsdp import perfmodel as pm
from qsdp.bench import simulate as sim
from test_bench_simulate import _fsdp_shard_sizes, _replica_numel
from test_hsdp import _hsdp_model

pytestmark = pytest.mark.timeout(120)

PRESETS = ("fsdp", "hsdp4", "sdp4bit", "qsdp")


def _metered_hsdp_steps(rank, world):
    out = {}
    for preset in PRESETS:
        model, groups = _hsdp_model(width=64)
        handle = qsdp.quantize_comms(model, preset, group=groups.shard_group, replicate_group=groups.replicate_group)
        fm.train(model, 1, rank)  # warm-up: establishes the weight-difference replicas
        qsdp.comm_stats(reset=True)
        fm.train(model, 1, rank)
        stats = qsdp.comm_stats(reset=True)
        out[preset] = {"sizes": _fsdp_shard_sizes(model, groups.shard_group.size()),
                       "meter": {k: {lv: stats[k][lv]["bytes"] for lv in ("intra", "inter")}
                                 for k in ("weights", "grads")},
                       "replica": _replica_numel(handle)}
    return out


@pytest.fixture(scope="module")
def metered():
    return run_world(_metered_hsdp_steps, 4, local_world_size=2)


@pytest.mark.parametrize("preset", PRESETS)
def test_hsdp_collectives_carry_the_bytes_the_meter_counts_in_a_real_step(metered, preset):
    for res in metered:
        r = res[preset]
        predicted = pm.collective_bytes(pm.hsdp_collectives(preset, r["sizes"], nodes=2, ranks_per_node=2,
                                                            zero3=True, param_bytes=4, grad_bytes=4))
        assert predicted == r["meter"]
        assert predicted["grads"]["inter"] > 0 and predicted["weights"]["inter"] == 0


@pytest.mark.parametrize("preset", PRESETS)
def test_hsdp_replicas_are_the_rows_a_real_rank_holds(metered, preset):
    # The shard group is one node: its gathers never cross a node, so no replica is held.
    for res in metered:
        r = res[preset]
        assert pm.replica_elements(preset, r["sizes"], nodes=1, ranks_per_node=2) == r["replica"]
        assert r["replica"] == 0


def test_quantized_hsdp_beats_native_hsdp_on_a_slow_link_and_not_on_an_infinite_one():
    setup = pm.Setup("1.3B", "a100", 128, 1, 1)
    slow = pm.HARDWARE["a100"]
    fast = dataclasses.replace(slow, inter_gbps=1e9, inter_latency_us=0.0, intra_gbps=1e9, intra_latency_us=0.0)
    native, quant = (pm.simulate_hsdp_step(setup, p, slow)["step_s"] for p in ("fsdp", "hsdp4"))
    assert quant < 0.5 * native
    native, quant = (pm.simulate_hsdp_step(setup, p, fast)["step_s"] for p in ("fsdp", "hsdp4"))
    assert quant >= native  # only the quantization kernels are left


def test_every_case_and_scale_row_has_hsdp_step_times():
    result = sim.run(["h800"], models=["1.3B"], scale_gpus=[16, 64])
    for row in [*result["cases"], *result["scale"]]:
        assert set(row["hsdp_step_ms"]) == set(sim.HSDP_PRESETS)
        assert all(t > 0 for t in row["hsdp_step_ms"].values())
    assert "HSDP" in sim.format_table(result)
