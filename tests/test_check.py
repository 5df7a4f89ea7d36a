"""``qsdp check``: the emulated collectives are the real ones, and the check orders the variants
as the committed convergence result does."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from qsdp.check import CheckSpec, emulate, measure_many, result
from qsdp.check.cli import main as check_main
from qsdp.check.verdict import CALIBRATION_GAP, CALIBRATION_WEIGHT_RATIO, GRAD_RATIO_VALIDATED, TOLERANCE
from qsdp.cli import main as qsdp_main
from qsdp.comm import (DifferenceAllGather, PlainAllGather, PlainReduceScatter, QuantizedAllGather,
                       QuantizedReduceScatter, build_topology)
from qsdp.config import resolve_config

from distributed import run_pooled

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
# The convergence result the thresholds were calibrated on, and every committed run of the same
# setting since (a verdict must agree with each run's measured gaps, not only the calibration's).
CALIBRATION_GAPS = ROOT / "benchmarks" / "results" / "convergence_2026-11-24.json"
CONVERGENCE_RUNS = (CALIBRATION_GAPS, ROOT / "benchmarks" / "results" / "convergence.json")
CALIBRATION = ROOT / "benchmarks" / "results" / "check_tiny.json"
LLAMA = ROOT / "examples" / "check" / "llama-tiny.json"
WORLD, PER_NODE, COMM_ID = 4, 2, 3


def _tensor(rank: int, numel: int, trial: int) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(100 * trial + rank))
    x[::37] *= 15  # outliers, as gradients have
    return x


def _sdp4bit_small_groups(**overrides):
    # Groups small enough that a short tensor holds several groups and pipeline slices (sdp4bit's
    # pipeline_slices="auto": 8 slices, on gloo in one exchange per hop).
    return resolve_config("sdp4bit", {"grads.group_size": 32, "grads.pipeline_min_slice": 64,
                                      "weights.group_size": 64, **overrides})


def _real_reduce_scatter(rank, world, cfg, s):
    comm = QuantizedReduceScatter(cfg, build_topology(), COMM_ID)
    outs = []
    for call in (1, 2):
        out = torch.empty(s)
        comm(output_tensor=out, input_tensor=_tensor(rank, world * s, call), group=dist.group.WORLD,
             op=dist.ReduceOp.AVG)
        outs.append(out)
    return outs


@pytest.mark.parametrize("preset", ["sdp4bit", "sdp4bit-8-exchanges", "qsdp", "zeropp"])
def test_emulated_reduce_scatter_gives_the_collectives_bits(preset):
    if preset.startswith("sdp4bit"):
        cfg = _sdp4bit_small_groups(**({"grads.pipeline_slices": 8} if preset != "sdp4bit" else {}))
    else:
        cfg = resolve_config(preset)
    s = 1000
    real = run_pooled(_real_reduce_scatter, WORLD, cfg, s, local_world_size=PER_NODE, timeout=120)
    for call in (1, 2):
        grads = torch.stack([_tensor(r, WORLD * s, call).view(WORLD, s) for r in range(WORLD)])
        emulated = emulate.reduce_scatter(grads, cfg, PER_NODE, COMM_ID, call)
        for rank in range(WORLD):
            assert torch.equal(emulated[rank], real[rank][call - 1])


def _real_gathers(rank, world, direct_cfg, diff_cfg, n):
    topo = build_topology()
    direct = QuantizedAllGather(direct_cfg, topo, COMM_ID)
    diff = DifferenceAllGather(diff_cfg, topo, COMM_ID)
    seen = []
    for trial in (1, 2, 3):  # the first difference gather sends exact values
        shard = _shard(rank, n, trial)
        for comm in (direct, diff):
            out = torch.empty(world * n)
            out[rank * n:(rank + 1) * n] = shard
            comm(output_tensor=out, input_tensor=out[rank * n:(rank + 1) * n], group=dist.group.WORLD)
            seen.append(out.view(world, n))
    return seen


def _shard(rank: int, n: int, trial: int) -> torch.Tensor:
    return _tensor(rank, n, 0) + 0.01 * trial * _tensor(rank, n, trial)  # weights moving by small steps


def test_emulated_weight_gathers_give_the_collectives_bits():
    direct_cfg = resolve_config("qsdp", {"weights.group_size": 64})
    diff_cfg = _sdp4bit_small_groups()
    n = 300
    real = run_pooled(_real_gathers, WORLD, direct_cfg, diff_cfg, n, local_world_size=PER_NODE, timeout=120)
    replica = None
    for k, trial in enumerate((1, 2, 3)):
        rows = torch.stack([_shard(r, n, trial) for r in range(WORLD)])
        direct = emulate.direct_gather(rows, direct_cfg, COMM_ID, trial)
        if replica is None:
            replica = rows.clone()  # the exact first gather
        else:
            emulate.difference_gather(rows, replica, diff_cfg, COMM_ID, trial - 1)
            assert not torch.equal(replica, rows)  # a 4-bit difference is not exact
        for rank in range(WORLD):
            assert torch.equal(direct, real[rank][2 * k])
            assert torch.equal(replica, real[rank][2 * k + 1])


class _Recording(PlainAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        super().__call__(output_tensor, input_tensor, group, async_op)
        self.seen = output_tensor.clone()


class _RecordingRS(PlainReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.seen = input_tensor.clone()
        super().__call__(output_tensor, input_tensor, group, op, async_op)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 2, bias=False))


def _fsdp_buffers(rank, world):
    model = _model()
    fully_shard(model)
    cfg, topo = resolve_config("fsdp"), build_topology()
    ag, rs = _Recording(cfg, topo, 0), _RecordingRS(cfg, topo, 0)
    model.set_custom_all_gather(ag)
    model.set_custom_reduce_scatter(rs)
    model(torch.randn(3, 5, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    return ag.seen, rs.seen


def test_flat_rows_is_the_layout_fsdp2_hands_the_collectives():
    world = 3  # 7 rows over 3 ranks: padded chunks
    real = run_pooled(_fsdp_buffers, world, timeout=120)
    model = _model()
    assert torch.equal(emulate.flat_rows(list(model.parameters()), world).view(-1), real[0][0].view(-1))
    for rank in range(world):
        model.zero_grad()
        model(torch.randn(3, 5, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
        rows = emulate.flat_rows([p.grad for p in model.parameters()], world)
        torch.testing.assert_close(rows.view(-1), real[rank][1].view(-1))


# The tiny setting of the committed convergence result, measured briefly.
QUICK = CheckSpec(model="tiny", warmup_steps=10, steps=3)
VARIANTS = ("qw4", "qwd4", "sdp4bit", "qsdp")


@pytest.fixture(scope="module")
def tiny_results():
    cfgs = [resolve_config(v) for v in VARIANTS]
    return {v: result(m) for v, m in zip(VARIANTS, measure_many(QUICK, cfgs))}


def _gaps(path) -> dict:
    return {v: p["rel_gap_vs_fsdp"] for v, p in json.loads(path.read_text())["presets"].items()}


def test_check_puts_qw4_weight_error_far_above_qwd4_as_convergence_does(tiny_results):
    for run in CONVERGENCE_RUNS:
        gaps = _gaps(run)
        assert gaps["qw4"]["ci_low"] > gaps["qwd4"]["ci_high"], run.name
    qw4 = tiny_results["qw4"]["total"]["weight_ratio"]
    others = [tiny_results[v]["total"]["weight_ratio"] for v in VARIANTS if v != "qw4"]
    assert qw4 > 5 * max(others)
    assert tiny_results["qw4"]["total"]["weight_ratio"] > 20 * tiny_results["qwd4"]["total"]["weight_ratio"]


def test_check_verdicts_agree_with_each_variants_measured_gap_in_every_run(tiny_results):
    for run in CONVERGENCE_RUNS:
        gaps = _gaps(run)
        for v in VARIANTS:
            harmful = gaps[v]["ci_low"] > TOLERANCE
            assert (tiny_results[v]["verdict"] == "fail") == harmful, (run.name, v, tiny_results[v]["total"])


def test_weight_difference_compressor_is_delta_approximate_and_direct_modes_have_no_delta(tiny_results):
    for v in ("qwd4", "sdp4bit"):
        assert 0 < tiny_results[v]["total"]["delta"] < 0.2
    assert tiny_results["qw4"]["total"]["delta"] is None


def test_only_presets_with_a_quantized_gradient_path_add_gradient_variance(tiny_results):
    for v in VARIANTS:
        t = tiny_results[v]["total"]
        assert t["grad_sgd"] > 0
        assert (t["grad_ratio"] > 1e-6) == (v in ("sdp4bit", "qsdp")), (v, t["grad_ratio"])


def test_thresholds_are_those_of_the_committed_calibration():
    checked = {r["preset"]: r for r in json.loads(CALIBRATION.read_text())["results"]}
    gaps = _gaps(CALIBRATION_GAPS)
    assert round(checked["qw4"]["total"]["weight_ratio"], 1) == CALIBRATION_WEIGHT_RATIO
    assert round(gaps["qw4"]["mean"], 3) == CALIBRATION_GAP
    assert round(max(x["grad_ratio"] for x in checked["sdp4bit"]["layers"]), 2) == GRAD_RATIO_VALIDATED
    for run in CONVERGENCE_RUNS:  # the calibration's own verdicts agree with every gap of every run
        gaps = _gaps(run)
        for v, res in checked.items():
            assert (res["verdict"] == "fail") == (gaps[v]["ci_low"] > TOLERANCE), (run.name, v)


def _cli_json(capsys, *argv) -> dict:
    assert check_main([*argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_check_runs_on_a_hugging_face_llama_config(capsys):
    res = _cli_json(capsys, "--model", str(LLAMA), "--warmup-steps", "1", "--steps", "1",
                    "--batch-size", "2", "--seq-len", "32")
    assert [x["layer"] for x in res["layers"]] == ["root", "model.layers.0", "model.layers.1"]
    assert all(math.isfinite(x["grad_ratio"]) and math.isfinite(x["weight_ratio"]) for x in res["layers"])
    assert res["meta"]["command"].startswith("qsdp check --model")


FACTORY = """
import torch.nn as nn


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 256)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x).relu()
        return self.head(x)


def make():
    return LM()
"""


def test_check_runs_on_a_module_factory(tmp_path, capsys):
    factory = tmp_path / "lm.py"
    factory.write_text(FACTORY)
    res = _cli_json(capsys, "--model", f"{factory}:make", "--preset", "qw4", "--warmup-steps", "0",
                    "--steps", "1", "--batch-size", "2", "--seq-len", "8")
    assert [x["layer"] for x in res["layers"]] == ["root", "layers.0", "layers.1"]
    assert res["preset"] == "qw4" and res["total"]["weight_ratio"] > 0


def test_a_module_factory_is_imported_from_the_current_directory_as_python_m_would(tmp_path, monkeypatch):
    from qsdp.check.models import build_model

    (tmp_path / "lm_in_cwd.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    # the `qsdp` console script's import path: its own directory first, not the current one
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    model = build_model("lm_in_cwd:make", vocab_size=256, seq_len=8, seed=0)
    assert type(model).__name__ == "LM"


def test_bad_model_is_a_one_line_usage_error(capsys):
    assert qsdp_main(["check", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown model 'no-such-model'" in err[0]


def test_a_config_json_without_model_type_is_a_one_line_usage_error(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text('{"hidden_size": 64}')
    assert qsdp_main(["check", "--model", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no model_type" in err[0]


def test_layers_below_the_calibrated_sgd_variance_are_flagged_with_the_fix():
    from qsdp.check.verdict import CALIBRATION_SGD_VAR, sgd_var_note

    note = sgd_var_note([("root", 0.3), ("blocks.0", 0.06), ("blocks.1", None), ("blocks.2", 0.04)],
                        resolve_config("sdp4bit"))
    assert note.startswith("outside the calibration: SGD var 0.04-0.06 in blocks.0, blocks.2, under half the 0.2-0.48")
    assert "more --warmup-steps" in note
    assert sgd_var_note([("root", CALIBRATION_SGD_VAR[0] / 2)], resolve_config("sdp4bit")) is None
    # an exact gradient path has no q/SGD to overstate
    assert sgd_var_note([("root", 0.01)], resolve_config("qwd4")) is None


def test_the_calibrated_sgd_variance_is_the_calibration_runs():
    from qsdp.check.verdict import CALIBRATION_SGD_VAR

    checked = {r["preset"]: r for r in json.loads(CALIBRATION.read_text())["results"]}
    sgd = [x["grad_sgd"] for x in checked["sdp4bit"]["layers"]]
    assert (round(min(sgd), 2), round(max(sgd), 2)) == CALIBRATION_SGD_VAR


def test_a_check_without_warm_up_prints_the_calibration_note(capsys):
    assert check_main(["--model", "tiny", "--warmup-steps", "0", "--steps", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "outside the calibration: SGD var" in out and "more --warmup-steps" in out
