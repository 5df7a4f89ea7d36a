"""Pipeline parallelism x FSDP2 (torchtitan's PP x FSDP): stages of different depths, one or two
per rank, each FSDP-sharded over its dp group and quantized by its own ``quantize_comms`` call;
the step's check over all of them, and their resume from one checkpoint (``tests/pipeline.py``
builds the layouts).

Four ranks are ``(pp, dp) = (2, 2)``, each rank on a node of its own, so a dp group spans two
nodes and ``sdp4bit`` quantizes both its gathers and its reductions.
"""

from __future__ import annotations

import math

import pytest
import torch

import qsdp
from distributed import run_pooled
import pipeline as pl

pytestmark = pytest.mark.timeout(240)


def _shards(pipe) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in pipe.params]


def _train(pipe, steps: int, check: bool, poison_at: tuple[int, int] | None = None) -> dict:
    """``steps`` optimizer steps; with ``check``, each after ``qsdp.check_gradients`` over this
    rank's handles (norm, loss, weight-difference agreement ahead), skipped when it says
    non-finite. ``poison_at``: (step, rank) whose first stage back-propagates NaN."""
    import torch.distributed as dist

    opt = torch.optim.Adam(pipe.params, lr=1e-2)
    out: dict = {"losses": [], "checks": [], "changed": []}
    for step in range(steps):
        before = _shards(pipe)
        losses = pipe.step(step, poison=poison_at == (step, dist.get_rank()))
        mean = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        out["losses"].append(float(mean) if losses else None)
        out["grads"] = [p.grad.to_local().clone() for p in pipe.params]
        skip = False
        if check:
            c = qsdp.check_gradients(pipe.handles, pipe.params, sums=[mean], agree_ahead=True)
            out["checks"].append((c.nonfinite, c.grad_norm, c.sums[0]))
            skip = c.nonfinite
        if skip:
            opt.zero_grad()
        else:
            opt.step()
            opt.zero_grad()
        out["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, _shards(pipe))))
    out["shards"] = _shards(pipe)
    return out


def _native_and(rank, world, schedule, preset, steps=3, tp=1, replicate=1):
    """The same pipeline trained natively and with ``preset`` on one mesh."""
    mesh = pl.mesh(2, 2, tp, replicate)
    native = _train(pl.build(mesh, schedule), steps, check=False)
    quantized = _train(pl.build(mesh, schedule, preset), steps, check=True)
    return native, quantized


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_the_fsdp_preset_equals_native_fsdp2_bit_for_bit_on_unequal_stages(schedule):
    for native, fsdp in run_pooled(_native_and, 4, schedule, "fsdp", local_world_size=1):
        assert fsdp["losses"] == native["losses"]
        assert all(torch.equal(a, b) for a, b in zip(fsdp["grads"], native["grads"]))
        assert all(torch.equal(a, b) for a, b in zip(fsdp["shards"], native["shards"]))
        assert [c[0] for c in fsdp["checks"]] == [False] * 3


@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=pytest.mark.slow), "interleaved"])
def test_sdp4bit_trains_close_to_native_with_the_check_over_stages_of_different_group_counts(schedule):
    # Stages of 2 and 3 FSDP groups (1f1b), or 2 + 3 against 2 + 2 per rank (interleaved): the
    # weight-difference flags of each dp group are agreed in the check without a size mismatch.
    results = run_pooled(_native_and, 4, schedule, "sdp4bit", 8, local_world_size=1)
    for native, sdp4bit in results:
        assert [c[0] for c in sdp4bit["checks"]] == [False] * 8
        assert all(c[1] > 0 and math.isfinite(c[1]) for c in sdp4bit["checks"])
        assert any(not torch.equal(a, b) for a, b in zip(sdp4bit["shards"], native["shards"]))  # quantized
        if native["losses"][0] is None:
            continue  # not the last stage
        # The first forward gathers exact weights; then 4-bit weight differences and gradients.
        assert sdp4bit["losses"][0] == native["losses"][0]
        assert all(math.isfinite(x) for x in sdp4bit["losses"])
        assert sum(sdp4bit["losses"]) == pytest.approx(sum(native["losses"]), rel=0.15)
    # every rank read the same check
    assert len({tuple(r[1]["checks"]) for r in results}) == 1


# The matrix's feature columns on pipeline stages (docs/layouts.md). Accumulation is the
# schedule's own: its micro-batches reduce gradients once, on the last backward.
FEATURES = {
    "zero2": {"reshard": False},  # torchtitan's default beside pipeline parallelism
    "checkpoint": {"checkpoint": True},
    "bf16-fp32-reduce": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "compile": {"compile_blocks": True},
}
FEATURE_STEPS = 6


def _feature_cell(rank, world, schedule, feature, tp=1):
    """Native FSDP2 and each preset on the same stages, with ``feature``."""
    out = {}
    for preset in (None, "fsdp", "qsdp", "sdp4bit"):
        pipe = pl.build(pl.mesh(2, 2, tp), schedule, preset, **FEATURES[feature])
        out[preset] = _train(pipe, FEATURE_STEPS, check=preset is not None)
        for handle in pipe.handles:
            handle.close()
    return out


def _feature_cells():
    for schedule in ("1f1b", "interleaved"):
        for feature in FEATURES:
            slow = feature != "zero2"  # make test: ZeRO-2, torchtitan's setting beside PP
            yield pytest.param(schedule, feature, id=f"{schedule}-{feature}",
                               marks=[pytest.mark.slow] if slow else [])
    # The other schedules of torch.distributed.pipelining, with ZeRO-2: under ZeRO-3 the
    # zero-bubble ones leave the last stage without gradients in native FSDP2 itself.
    for schedule in ("gpipe", "zbv", "interleaved-zb", "dualpipev"):
        yield pytest.param(schedule, "zero2", id=f"{schedule}-zero2",
                           marks=[] if schedule == "zbv" else [pytest.mark.slow])


def _feature_cells_with_tp():
    for feature in FEATURES:
        yield pytest.param("1f1b", feature, 2, id=f"1f1b-{feature}-tp2", marks=[pytest.mark.slow])


@pytest.mark.timeout(540)
@pytest.mark.parametrize("schedule,feature,tp", [*(pytest.param(*c.values, 1, id=c.id, marks=c.marks)
                                                   for c in _feature_cells()), *_feature_cells_with_tp()])
def test_pipeline_stages_train_with_every_preset(schedule, feature, tp):
    # tp = 2: (pp, dp, tp) = (2, 2, 2), 8 ranks, tensor parallelism on each block's MLP.
    for by_preset in run_pooled(_feature_cell, 4 * tp, schedule, feature, tp, local_world_size=tp, timeout=480):
        native, fsdp = by_preset[None], by_preset["fsdp"]
        assert fsdp["losses"] == native["losses"]
        assert all(torch.equal(a, b) for a, b in zip(fsdp["shards"], native["shards"]))
        for preset in ("qsdp", "sdp4bit"):
            quantized = by_preset[preset]
            assert [c[0] for c in quantized["checks"]] == [False] * FEATURE_STEPS, preset
            assert any(not torch.equal(a, b) for a, b in zip(quantized["shards"], native["shards"])), preset
            if native["losses"][0] is not None:  # the last stage
                assert all(math.isfinite(x) for x in quantized["losses"]), preset
                assert sum(quantized["losses"]) == pytest.approx(sum(native["losses"]), rel=0.15), preset


def _norm(rank, world, schedule, preset, tp=1, replicate=1):
    pipe = pl.build(pl.mesh(2, 2, tp, replicate), schedule, preset)
    losses = pipe.step(0)
    mean = torch.stack(losses).mean().detach() if losses else torch.zeros(())
    check = qsdp.check_gradients(pipe.handles, pipe.params, sums=[mean], agree_ahead=True)
    return check.grad_norm, check.norm.item(), check.sums[0], pl.reference_norm(schedule, 0, 2 * replicate)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_the_norm_over_stages_is_the_unsharded_models_gradient_norm(schedule):
    for norm, norm_tensor, loss_sum, (reference, reference_loss) in run_pooled(
            _norm, 4, schedule, "fsdp", local_world_size=1):
        assert norm == pytest.approx(reference, rel=1e-5)  # fp32 gradients against a float64 norm
        assert norm_tensor == pytest.approx(norm, rel=1e-6)
        assert loss_sum / 2 == pytest.approx(reference_loss, rel=1e-5)  # the last stage's 2 dp ranks


def _nan(rank, world, schedule, preset, dp=2):
    mesh = pl.mesh(world // dp, dp)
    return _train(pl.build(mesh, schedule, preset), 3, check=True, poison_at=(1, 0))


@pytest.mark.parametrize("schedule,preset", [("1f1b", "sdp4bit"),
                                             pytest.param("interleaved", "qsdp", marks=pytest.mark.slow)])
def test_a_nan_in_one_stage_skips_the_step_on_every_rank(schedule, preset):
    # Rank 0's first stage alone back-propagates NaN at step 1: the other stage's ranks reduce
    # finite gradients, and skip with it.
    results = run_pooled(_nan, 4, schedule, preset, local_world_size=1)
    for r in results:
        assert [c[0] for c in r["checks"]] == [False, True, False]
        assert r["changed"] == [True, False, True]
        assert all(torch.isfinite(s).all() for s in r["shards"])


def test_with_one_rank_per_dp_group_a_nan_is_flagged_without_qsdps_reduce_scatter():
    # (pp, dp) = (2, 1): FSDP2 reduces a one-rank group without calling the custom reduce-scatter.
    results = run_pooled(_nan, 2, "1f1b", "sdp4bit", 1)
    for r in results:
        assert [c[0] for c in r["checks"]] == [False, True, False]
        assert r["changed"] == [True, False, True]
        assert all(torch.isfinite(s).all() for s in r["shards"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp_x_fsdp_x_tp_equals_native_and_its_norm_is_the_unsharded_models():
    # (pp, dp, tp) = (2, 2, 2): tensor parallelism on each block's MLP inside every stage.
    for native, fsdp in run_pooled(_native_and, 8, "1f1b", "fsdp", 3, 2, local_world_size=2, timeout=540):
        assert fsdp["losses"] == native["losses"]
        assert all(torch.equal(a, b) for a, b in zip(fsdp["shards"], native["shards"]))
    for norm, _, _, (reference, _) in run_pooled(_norm, 8, "interleaved", "fsdp", 2, local_world_size=2, timeout=540):
        assert norm == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp_x_fsdp_x_tp_sdp4bit_trains_close_to_native():
    for native, sdp4bit in run_pooled(_native_and, 8, "interleaved", "sdp4bit", 8, 2, local_world_size=2, timeout=540):
        assert [c[0] for c in sdp4bit["checks"]] == [False] * 8
        if native["losses"][0] is not None:
            assert all(math.isfinite(x) for x in sdp4bit["losses"])
            assert sum(sdp4bit["losses"]) == pytest.approx(sum(native["losses"]), rel=0.15)


# ------------------------------------------------------------------ PP x native HSDP
# (pp, dp_replicate, dp_shard) = (2, 2, 2): each stage on FSDP2's native HSDP mesh, its shard
# dimension inside a node of 2 ranks, its replicas across nodes (torchtitan's PP x HSDP).


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp_x_native_hsdp_equals_native_and_its_norm_is_the_unsharded_models():
    for native, fsdp in run_pooled(_native_and, 8, "1f1b", "fsdp", 3, 1, 2, local_world_size=2, timeout=540):
        assert fsdp["losses"] == native["losses"]
        assert all(torch.equal(a, b) for a, b in zip(fsdp["grads"], native["grads"]))
        assert all(torch.equal(a, b) for a, b in zip(fsdp["shards"], native["shards"]))
    for norm, _, loss_sum, (reference, reference_loss) in run_pooled(
            _norm, 8, "interleaved", "fsdp", 1, 2, local_world_size=2, timeout=540):
        assert norm == pytest.approx(reference, rel=1e-5)  # each element once across stages and replicas
        assert loss_sum / 4 == pytest.approx(reference_loss, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset", ["sdp4bit", "hsdp4"])
def test_pp_x_native_hsdp_trains_close_to_native(preset):
    for native, quantized in run_pooled(_native_and, 8, "1f1b", preset, 8, 1, 2, local_world_size=2, timeout=540):
        assert [c[0] for c in quantized["checks"]] == [False] * 8
        assert any(not torch.equal(a, b) for a, b in zip(quantized["shards"], native["shards"]))
        if native["losses"][0] is not None:
            assert all(math.isfinite(x) for x in quantized["losses"])
            assert sum(quantized["losses"]) == pytest.approx(sum(native["losses"]), rel=0.15)


def _steps(pipe, opt, steps) -> list:
    losses = []
    for step in steps:
        out = pipe.step(step)
        mean = torch.stack(out).mean().detach() if out else torch.zeros(())
        check = qsdp.check_gradients(pipe.handles, pipe.params, sums=[mean], agree_ahead=True)
        assert not check.nonfinite
        for o in opt if isinstance(opt, list) else [opt]:
            o.step()
            o.zero_grad()
        losses.append(float(mean))
    return losses


def _resume(rank, world, schedule, preset, out, before=2, after=2, as_list=False, per_block=True, tp=1,
            replicate=1, reshard=True):
    """``before + after`` steps uninterrupted, against ``before`` steps, a checkpoint of each
    rank's stages, a fresh process state (new model, optimizers and comms) loaded from it, and
    ``after`` more steps. ``as_list``: the checkpoint API gets lists of the rank's parts, their
    optimizers (one each, as torchtitan keeps them) and their handles; otherwise the rank's one
    part, its optimizer and its handle. ``tp``: tensor parallelism of that degree inside each
    dp group's ranks. ``replicate``: each stage on a native HSDP mesh of that many replicas.
    ``reshard``: FSDP2's ``reshard_after_forward``."""
    from qsdp.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    def optimizers(pipe):
        if as_list:
            return [torch.optim.Adam(part.parameters(), lr=1e-2) for part in pipe.parts]
        return torch.optim.Adam(pipe.params, lr=1e-2)

    def args(pipe, opt):
        return (pipe.parts, opt, pipe.handles) if as_list else (pipe.parts[0], opt, pipe.handles[0])

    mesh = pl.mesh(2, 2, tp, replicate)
    whole = pl.build(mesh, schedule, preset, per_block=per_block, reshard=reshard)
    uninterrupted = _steps(whole, optimizers(whole), range(before + after))
    first = pl.build(mesh, schedule, preset, per_block=per_block, reshard=reshard)
    opt = optimizers(first)
    losses = _steps(first, opt, range(before))
    save_checkpoint(out, before, *args(first, opt), {})
    # Other initial weights: all of them come from the checkpoint.
    second = pl.build(mesh, schedule, preset, seed=1, per_block=per_block, reshard=reshard)
    opt = optimizers(second)
    load_checkpoint(latest_checkpoint(out), *args(second, opt), torch.device("cpu"))
    losses += _steps(second, opt, range(before, before + after))
    return uninterrupted, losses, _shards(whole), _shards(second)


def _assert_resumed_bit_for_bit(results):
    for uninterrupted, resumed, whole, again in results:
        assert resumed == uninterrupted
        assert all(torch.equal(a, b) for a, b in zip(whole, again))


def test_a_pipeline_stage_resumes_with_its_own_optimizer_param_groups(tmp_path):
    # Both stages' optimizer param_groups in one checkpoint (keyed by parameter), one step on
    # each side of the resume.
    _assert_resumed_bit_for_bit(run_pooled(_resume, 4, "1f1b", "fsdp", str(tmp_path), 1, 1, local_world_size=1))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "sdp4bit", "qsdp", "zeropp"])
def test_a_pipeline_resumes_from_a_checkpoint_bit_for_bit(preset, tmp_path):
    # sdp4bit: stages of 2 and 3 FSDP groups agree on their weight-difference replicas each
    # within its own dp group.
    _assert_resumed_bit_for_bit(run_pooled(_resume, 4, "1f1b", preset, str(tmp_path), local_world_size=1))


@pytest.mark.slow
def test_pp_x_fsdp_x_tp_resumes_from_a_checkpoint_bit_for_bit(tmp_path):
    # (pp, dp, tp) = (2, 2, 2): each dp group's replica rows, and the parameters TP replicates,
    # the same on both TP ranks so that DCP's one copy of them is each rank's own.
    _assert_resumed_bit_for_bit(run_pooled(_resume, 8, "1f1b", "sdp4bit", str(tmp_path), tp=2, local_world_size=2,
                                          timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["sdp4bit", "hsdp4"])
def test_pp_x_native_hsdp_resumes_from_a_checkpoint_bit_for_bit(preset, tmp_path):
    # Each stage's replica rows agreed over its shard group and its replicas; FSDP2's own
    # placements in the checkpoint.
    _assert_resumed_bit_for_bit(run_pooled(_resume, 8, "1f1b", preset, str(tmp_path), replicate=2, local_world_size=2,
                                          timeout=300))


@pytest.mark.parametrize("preset,per_block", [pytest.param("fsdp", True, marks=pytest.mark.slow),
                                              pytest.param("sdp4bit", True, marks=pytest.mark.slow),
                                              ("sdp4bit", False)])
def test_two_stages_a_rank_resume_from_one_checkpoint_bit_for_bit(preset, per_block, tmp_path):
    # Interleaved: each rank saves and loads both its model parts, their optimizers and their
    # handles. Without per-block groups, each part is one FSDP group at its root: a rank's two
    # parts gather over one dp group at one module path, and their replica rows keep apart.
    _assert_resumed_bit_for_bit(run_pooled(_resume, 4, "interleaved", preset, str(tmp_path), as_list=True,
                                          per_block=per_block, local_world_size=1))


@pytest.mark.slow
def test_zero_bubble_v_stages_resume_from_one_checkpoint_bit_for_bit(tmp_path):
    # ScheduleZBVZeroBubble with ZeRO-2: rank 0 holds the first and the last stage.
    _assert_resumed_bit_for_bit(run_pooled(_resume, 4, "zbv", "sdp4bit", str(tmp_path), as_list=True, reshard=False,
                                          local_world_size=1))


def test_model_parts_and_handles_of_different_counts_are_refused_before_any_collective(tmp_path):
    from qsdp.train.checkpoint import load_checkpoint, save_checkpoint

    # No process group here: the error comes before any collective.
    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    opts = [torch.optim.Adam(p.parameters()) for p in parts]
    with pytest.raises(ValueError, match=r"^checkpoint: 2 model part\(s\), 2 optimizer\(s\) and 1 handle\(s\)"):
        save_checkpoint(tmp_path, 1, parts, opts, [object()], {})
    with pytest.raises(ValueError, match=r"^checkpoint: 2 model part\(s\), 1 optimizer\(s\) and 2 handle\(s\)"):
        load_checkpoint(tmp_path, parts, opts[0], [object(), object()], torch.device("cpu"))


def test_model_parts_sharing_parameter_names_are_refused_before_any_collective(tmp_path):
    from qsdp.train.checkpoint import save_checkpoint

    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]  # both "weight" and "bias"
    with pytest.raises(ValueError, match=r"^checkpoint: model parts share parameter names \(bias, weight\)"):
        save_checkpoint(tmp_path, 1, parts, [torch.optim.Adam(p.parameters()) for p in parts], [None, None], {})


def _reads(rank, world, schedule, preset):
    from test_sync_policy import _count_qsdp_reads

    pipe = pl.build(pl.mesh(2, 2), schedule, preset)
    opt = torch.optim.Adam(pipe.params, lr=1e-2)
    _steps(pipe, opt, range(2))  # warm-up: replicas established
    log: list[str] = []
    _count_qsdp_reads(log)
    per_step = []
    for step in range(2, 4):
        _steps(pipe, opt, [step])
        per_step.append(list(log))
        log.clear()
    return per_step


def test_a_pipeline_step_reads_the_host_once_for_every_stage_of_the_rank():
    # Two stages a rank, their dp group's weight-difference flags in an all-reduce of their own:
    # still one read, the check's.
    for per_step in run_pooled(_reads, 4, "interleaved", "sdp4bit", local_world_size=1):
        assert per_step == [["tolist from qsdp.gradient_check"]] * 2


# --------------------------------------------------------------------------- another layout


def _save_pipeline(rank, world, out, preset, schedule="1f1b", steps=2):
    """``steps`` steps of ``schedule`` on ``(pp, dp) = (2, 2)``, then a checkpoint of each rank's
    stages (one optimizer a stage)."""
    from qsdp.train.checkpoint import save_checkpoint

    pipe = pl.build(pl.mesh(2, 2), schedule, preset)
    opts = [torch.optim.Adam(part.parameters(), lr=1e-2) for part in pipe.parts]
    _steps(pipe, opts, range(steps))
    save_checkpoint(out, steps, pipe.parts, opts, pipe.handles, {})


def _observed_load(path, module, opt, handle, train) -> dict:
    """``path`` loaded into ``module`` and ``opt``: the gathered state at the load, what the
    first gathers delivered, and the losses of ``train()``."""
    from test_elastic import FirstGathers, _full_state
    from qsdp.train.checkpoint import load_checkpoint

    load_checkpoint(path, module, opt, handle, torch.device("cpu"))
    loaded = _full_state(module, opt)
    first = FirstGathers(module)
    losses = train()
    first.close()
    exact = sorted(k for k, v in first.weights.items() if torch.equal(v, loaded[k]))
    return {"loaded": loaded, "gathered": sorted(first.weights), "exact": exact, "losses": losses}


def _assert_loaded_exactly(results, expected) -> None:
    """Each rank's state at the load is the checkpoint's, bit for bit, and its first gathers
    delivered exactly those weights."""
    for r in results:
        assert [k for k in r["loaded"] if not torch.equal(r["loaded"][k], expected[k])] == []
        assert r["gathered"] and r["exact"] == r["gathered"]


def _load_without_stages(rank, world, path, preset):
    """The whole model (the pipeline's depth) FSDP2-sharded over the world, no stages, loaded
    from ``path`` (:func:`_observed_load`, two more steps)."""
    import fsdp_models as fm

    model = fm.build(seed=1, width=pl.WIDTH, depth=pl.depth("1f1b"))  # other weights: all from the checkpoint
    handle = qsdp.quantize_comms(model, preset)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return _observed_load(path, model, opt, handle, lambda: fm.optimizer_steps(model, opt, 2, 2, rank))


@pytest.mark.parametrize("preset", ["sdp4bit", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_pipeline_checkpoint_loads_into_the_whole_model_on_fewer_ranks(preset, tmp_path):
    # The stages keep the whole model's parameter names, so their checkpoint is the whole
    # model's: two stages of (pp, dp) = (2, 2) load into one FSDP2 model on 2 ranks, state bit
    # for bit, the weight-difference replicas rebuilt exactly by the first gathers.
    from test_elastic import _checkpoint_state

    run_pooled(_save_pipeline, 4, str(tmp_path), preset, local_world_size=1)
    path = tmp_path / "checkpoints" / "step_00000002"
    results = run_pooled(_load_without_stages, 2, str(path), preset, local_world_size=1)
    expected = _checkpoint_state(path, tmp_path)
    assert all(r["loaded"].keys() == expected.keys() for r in results)
    _assert_loaded_exactly(results, expected)
    assert all(math.isfinite(v) for r in results for v in r["losses"])


def _save_without_stages(rank, world, out, preset, steps=2):
    import fsdp_models as fm
    from qsdp.train.checkpoint import save_checkpoint

    model = fm.build(width=pl.WIDTH, depth=pl.depth("1f1b"))
    handle = qsdp.quantize_comms(model, preset)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    fm.optimizer_steps(model, opt, 0, steps, rank)
    save_checkpoint(out, steps, model, opt, handle, {})


def _load_into_stages(rank, world, path, preset, schedule="1f1b"):
    """This rank's stage of ``schedule`` (one a rank) on ``(pp, dp) = (2, 2)`` loaded from
    ``path`` (:func:`_observed_load`, two more steps)."""
    pipe = pl.build(pl.mesh(2, 2), schedule, preset, seed=1)
    opt = torch.optim.Adam(pipe.params, lr=1e-2)
    return _observed_load(path, pipe.parts[0], opt, pipe.handles[0], lambda: _steps(pipe, opt, range(2, 4)))


def _assert_loaded_into_stages(tmp_path, save, save_world, save_args, schedule):
    """``save`` on ``save_world`` ranks writes a step-2 checkpoint; ``(pp, dp) = (2, 2)`` stages of
    ``schedule`` (one a rank) load it: each rank's state the checkpoint's bit for bit, every
    parameter held by one stage, the first gathers exact, training going on."""
    from test_elastic import _checkpoint_state

    run_pooled(save, save_world, str(tmp_path), *save_args, local_world_size=1)
    path = tmp_path / "checkpoints" / "step_00000002"
    results = run_pooled(_load_into_stages, 4, str(path), "sdp4bit", schedule, local_world_size=1)
    expected = _checkpoint_state(path, tmp_path)
    # ranks 0, 1 hold stage 0, ranks 2, 3 stage 1
    assert sorted([*results[0]["loaded"], *results[2]["loaded"]]) == sorted(expected)
    _assert_loaded_exactly(results, expected)
    assert all(math.isfinite(v) for v in results[2]["losses"])


@pytest.mark.slow  # make test keeps the other direction and another pipeline layout
def test_a_checkpoint_of_the_whole_model_loads_into_pipeline_stages(tmp_path):
    # The other way: a 1-D FSDP2 run of 2 ranks, resumed as two stages of (pp, dp) = (2, 2);
    # each stage loads its own parameters and their optimizer state.
    _assert_loaded_into_stages(tmp_path, _save_without_stages, 2, ("sdp4bit",), "1f1b")


def test_a_pipeline_checkpoint_loads_into_another_pipeline_layout(tmp_path):
    # Four stages, two a rank (interleaved), into two stages of other depths (1F1B): each new
    # stage takes its parameters from the old stages that held them.
    _assert_loaded_into_stages(tmp_path, _save_pipeline, 4, ("sdp4bit", "interleaved"), "1f1b-deep")
