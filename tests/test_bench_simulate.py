"""`qsdp bench simulate` and the performance model under it: the byte and replica model against
the real byte meter and replicas, the JSON schema, and the time model's limits (a slow inter-node
link, an infinitely fast one). The errors against the paper are reported by the benchmark, not
asserted here."""

from __future__ import annotations

import json
import math

import pytest
import torch

import qsdp
from distributed import run_pooled
import fsdp_models as fm
from qsdp import perfmodel as pm
from qsdp.bench import simulate as sim

pytestmark = pytest.mark.timeout(120)

METERED_PRESETS = ("fsdp", "qsdp", "sdp4bit", "zeropp")


def _fsdp_shard_sizes(model, world: int) -> list[int]:
    """Per FSDP module (``model.modules()`` order), the all-gather input numel of one rank: the
    padded local shards of the parameters it manages directly (dim 0 padded to a multiple of
    the world size, divided by it, times the other dims)."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    sizes = []
    for mod in mods:
        nested = {id(p) for sub in mod.modules() if sub is not mod and isinstance(sub, FSDPModule)
                  for p in sub.parameters()}
        n = 0
        for p in mod.parameters():
            if id(p) in nested:
                continue
            shape = p.shape  # the global shape of the DTensor
            n += -(-shape[0] // world) * math.prod(shape[1:])
        sizes.append(n)
    return sizes


def _replica_numel(handle) -> int:
    """Elements of the weight-difference replica rows this rank holds, over its groups."""
    return sum(r.numel() for ag in handle.all_gathers if ag.holds_replicas() for r in ag.replica_rows().values())


def _record_calls(handle, log: list):
    """Swap each comm object's class for a subclass that logs what FSDP2 hands it."""
    for i, ag in enumerate(handle.all_gathers):
        base = type(ag)

        def ag_call(self, output_tensor, input_tensor, group, async_op=False, _i=i, _b=base):
            log.append(("ag", _i, input_tensor.numel()))
            return _b.__call__(self, output_tensor, input_tensor, group, async_op)

        ag.__class__ = type(f"Recording{base.__name__}", (base,), {"__call__": ag_call})
    for i, rs in enumerate(handle.reduce_scatters):
        base = type(rs)

        def rs_call(self, output_tensor, input_tensor, group, op, async_op=False, _i=i, _b=base):
            log.append(("rs", _i, output_tensor.numel()))
            return _b.__call__(self, output_tensor, input_tensor, group, op, async_op)

        rs.__class__ = type(f"Recording{base.__name__}", (base,), {"__call__": rs_call})


def _one_step_per_preset(rank, world, presets):
    out = {}
    for preset in presets:
        model = fm.build(width=64)
        handle = qsdp.quantize_comms(model, preset)
        log: list = []
        _record_calls(handle, log)
        fm.train(model, 1, rank)  # warm-up: establishes the weight-difference replicas
        qsdp.comm_stats(reset=True)
        log.clear()
        fm.train(model, 1, rank)
        stats = qsdp.comm_stats(reset=True)
        out[preset] = {
            "sizes": _fsdp_shard_sizes(model, world),
            "log": list(log),
            "meter": {k: {lv: stats[k][lv]["bytes"] for lv in ("intra", "inter")} for k in ("weights", "grads")},
            "replica": _replica_numel(handle),
        }
    return out


@pytest.fixture(scope="module")
def metered():
    return run_pooled(_one_step_per_preset, 4, METERED_PRESETS, local_world_size=2)


@pytest.mark.parametrize("preset", METERED_PRESETS)
def test_step_bytes_equals_the_byte_meter_of_a_real_2x2_training_step(metered, preset):
    for res in metered:
        r = res[preset]
        sizes = r["sizes"]
        assert len(sizes) == 3 and sizes[1] == sizes[2]  # root, two blocks
        # What the comm objects saw: every gather input and reduce-scatter output is the shard.
        for op, i, numel in r["log"]:
            assert numel == sizes[i], (op, i, numel, sizes)
        gathers = [sum(1 for op, j, _ in r["log"] if op == "ag" and j == i) for i in range(len(sizes))]
        scatters = [sum(1 for op, j, _ in r["log"] if op == "rs" and j == i) for i in range(len(sizes))]
        assert gathers == [2, 2, 2] and scatters == [1, 1, 1]  # ZeRO-3: forward + backward gathers
        predicted = pm.step_bytes(preset, sizes, nodes=2, ranks_per_node=2, zero3=True,
                                  param_bytes=4, grad_bytes=4)
        assert predicted == r["meter"]
        assert predicted["grads"]["inter"] > 0 and predicted["weights"]["inter"] > 0


@pytest.mark.parametrize("preset", METERED_PRESETS)
def test_replica_elements_equal_the_replica_rows_a_real_rank_holds(metered, preset):
    for res in metered:
        r = res[preset]
        assert pm.replica_elements(preset, r["sizes"], nodes=2, ranks_per_node=2) == r["replica"]
        # node replicas: the rows of the D = 2 ranks sharing this local rank, in every group
        assert r["replica"] == (2 * sum(r["sizes"]) if preset == "sdp4bit" else 0)


def test_step_bytes_bits_per_element_at_scale():
    s = 1 << 20
    full = qsdp.resolve_config("sdp4bit", {"weights.replica": "full"})
    b = pm.step_bytes(full, [s], nodes=4, ranks_per_node=8, zero3=False)
    assert b["weights"]["inter"] == pytest.approx(24 * s * (4 + 32 / 2048) / 8)  # 24 inter peers
    node = pm.step_bytes("sdp4bit", [s], nodes=4, ranks_per_node=8, zero3=False)  # node replicas
    assert node["weights"]["inter"] == pytest.approx(3 * s * (4 + 32 / 2048) / 8)  # 3 holders of my rows
    assert node["weights"]["intra"] == 7 * 4 * s * 2  # the node's rows, bf16, to 7 local peers
    assert b["grads"]["intra"] == pytest.approx(7 * 4 * s * 8.25 / 8)  # D rows to each local peer
    assert b["grads"]["inter"] == pytest.approx(3 * s * 4.25 / 8)
    # ZeRO-3: direct gathers twice, weight differences once.
    z = pm.step_bytes("zeropp", [s], nodes=4, ranks_per_node=8, zero3=True)
    d = pm.step_bytes(full, [s], nodes=4, ranks_per_node=8, zero3=True)
    assert z["weights"]["inter"] == 2 * d["weights"]["inter"]
    f = pm.step_bytes("fsdp", [s], nodes=4, ranks_per_node=8, zero3=False)
    assert f["weights"]["inter"] == 24 * s * 2 and f["grads"]["inter"] == 24 * s * 4


def test_json_schema_and_saved_file(capsys, tmp_path):
    out = tmp_path / "sim.json"
    assert sim.main(["--json", "--save", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == data
    assert len(data["cases"]) == 10
    for c in data["cases"]:
        assert {"model", "gpus", "gpu", "predicted_speedup", "paper_speedup", "rel_error"} <= set(c)
        assert c["gpus"] == 128 and c["gpu"] in ("a100", "h800")
        assert c["rel_error"] == pytest.approx((c["predicted_speedup"] - c["paper_speedup"]) / c["paper_speedup"])
    assert {(c["model"], c["gpu"]) for c in data["cases"]} == set(sim.PAPER_SPEEDUP)
    gpus = sorted({s["gpus"] for s in data["scale"]})
    assert gpus[0] == 16 and gpus[-1] == 1024
    assert all(s["predicted_speedup"] > 0 for s in data["scale"])
    assert data["meta"]["device"] == "analytic model" and data["meta"]["torch"] == torch.__version__
    assert data["assumptions"]


def test_table_output_names_the_cases(capsys):
    assert sim.main(["--gpu", "h800", "--models", "1.3B", "--scale-gpus", "16", "1024"]) == 0
    text = capsys.readouterr().out
    assert "1.3B" in text and "h800" in text and "1.53x" in text and "assumptions:" in text


def test_sdp4bit_wins_on_a_slow_link_and_ties_on_an_infinite_one():
    slow = sim.run(["h800"], overrides={"inter_gbps": 1.0}, models=["1.3B", "13B"], scale_gpus=[16, 1024])
    assert len(slow["cases"]) == 2 and len(slow["scale"]) == 2
    assert all(c["predicted_speedup"] > 1.5 for c in slow["cases"] + slow["scale"])
    fast = {"inter_gbps": 1e12, "intra_gbps": 1e12, "intra_latency_us": 0.0, "inter_latency_us": 0.0}
    free = sim.run(["a100", "h800"], overrides=fast, scale_gpus=[16])
    assert free["cases"]
    assert all(c["predicted_speedup"] <= 1.0 + 1e-9 for c in free["cases"])  # quantizing only costs
    assert all(c["predicted_speedup"] > 0.7 for c in free["cases"])
    ideal = sim.run(["a100", "h800"], overrides={**fast, "quant_hbm_fraction": 1e9}, scale_gpus=[16])
    assert ideal["cases"] and ideal["scale"]
    assert all(c["predicted_speedup"] == pytest.approx(1.0, abs=1e-3) for c in ideal["cases"] + ideal["scale"])


def test_overlap_hides_communication():
    none = sim.run(["a100"], models=["1.3B"], scale_gpus=[])
    full = sim.run(["a100"], models=["1.3B"], overlap=1.0, scale_gpus=[])
    a, b = none["cases"][0], full["cases"][0]
    assert b["step_ms"]["fsdp"] < a["step_ms"]["fsdp"]
    assert b["step_ms"]["fsdp"] >= b["breakdown_ms"]["fsdp"]["compute_s"]


def test_a_host_factor_adds_the_collectives_census_floors_to_each_step(capsys):
    none = sim.run(["h800"], models=["1.3B"], scale_gpus=[])["cases"][0]
    assert all(b["host_s"] == 0 for b in none["breakdown_ms"].values())  # the paper's GPU types: not priced
    assert sim.main(["--gpu", "h800", "--models", "1.3B", "--scale-gpus", "16", "--host-factor", "3", "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)["cases"][0]
    assert priced["breakdown_ms"]["fsdp"]["host_s"] == 0  # FSDP2's own collectives launch nothing more
    host = priced["breakdown_ms"]["sdp4bit"]["host_s"]
    assert host > 0 and priced["step_ms"]["sdp4bit"] == pytest.approx(none["step_ms"]["sdp4bit"] + host)


def test_kernel_benchmark_file_sets_quantization_speed(tmp_path, capsys):
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    fast.write_text(json.dumps({"kernels": {"quantize": {"gbps": 5000}, "dequantize": {"gbps": 5000}}}))
    slow.write_text(json.dumps({"kernels": {"quantize": {"gbps": 50}, "dequantize": {"gbps": 50}}}))
    speed = {}
    for name, f in (("fast", fast), ("slow", slow)):
        assert sim.main(["--json", "--gpu", "h800", "--models", "6.7B", "--kernels", str(f)]) == 0
        data = json.loads(capsys.readouterr().out)
        speed[name] = data["cases"][0]["predicted_speedup"]
        assert any("from --kernels" in a for a in data["assumptions"])
    assert speed["slow"] < speed["fast"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kernels": {}}))
    with pytest.raises(SystemExit):
        sim.main(["--kernels", str(bad)])
    with pytest.raises(SystemExit):
        sim.main(["--inter-gbps", "0"])
