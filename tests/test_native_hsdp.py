"""quantize_comms on FSDP2's native HSDP mesh (``fully_shard(mesh=<2-D (replicate, shard)>)``,
or those two dimensions of a 3-D mesh with TP), with no ``group=`` and no ``replicate_group=``:
2 nodes x 2 ranks (replicas across nodes, shards inside), gloo."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_models as fm
import layouts
import qsdp
from distributed import run_pooled

pytestmark = pytest.mark.timeout(240)

PER_NODE = 2


def _native(preset: str | None, layout: str = "hsdp", **build):
    """``layouts.build(layout, **build)`` on FSDP2's native HSDP mesh, quantized with ``preset``
    (``None``: native FSDP2) and nothing else named."""
    built = layouts.build(layout, native_hsdp=True, **build)
    handle = qsdp.quantize_comms(built.model, preset) if preset else None
    return built, handle


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def _steps(built, steps: int, accumulate: int = 1, start: int = 0, opt=None):
    """Adam steps of ``accumulate`` micro-batches each; the replicas all-reduce only on the last
    (``set_requires_all_reduce(False)`` before the others: HSDP's accumulation). Returns the
    losses, the gradients of the last step and the optimizer."""
    model = built.model
    opt = opt or torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(start, start + steps):
        for micro in range(accumulate):
            model.set_requires_all_reduce(micro == accumulate - 1)
            x, y = fm.batch(step * accumulate + micro, built.data_rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
        grads = _grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, opt


def _train(rank, world, preset, layout, steps, accumulate):
    built, handle = _native(preset, layout)
    losses, grads, _ = _steps(built, steps, accumulate)
    calls = [rs.all_reduce.calls for rs in handle.reduce_scatters] if handle else None
    return losses, layouts.full_params(built.model), grads, calls


def _assert_bit_identical(native, ours):
    for (l1, p1, g1, _), (l2, p2, g2, _) in zip(native, ours):
        assert l1 == l2
        assert all(torch.equal(a, b) for a, b in zip(p1, p2))
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_the_fsdp_preset_is_native_hsdp_bit_for_bit():
    native = run_pooled(_train, 4, None, "hsdp", 4, 1, local_world_size=PER_NODE)
    ours = run_pooled(_train, 4, "fsdp", "hsdp", 4, 1, local_world_size=PER_NODE)
    _assert_bit_identical(native, ours)


def test_accumulation_all_reduces_once_a_step_and_stays_native_bit_for_bit():
    native = run_pooled(_train, 4, None, "hsdp", 2, 3, local_world_size=PER_NODE)
    ours = run_pooled(_train, 4, "fsdp", "hsdp", 2, 3, local_world_size=PER_NODE)
    _assert_bit_identical(native, ours)
    for *_, calls in ours:
        assert calls == [2, 2, 2]  # 3 FSDP groups, one all-reduce per step, not per micro-batch


def _tiny_3d(rank, world, preset, steps):
    """A (dp_replicate, dp_shard, tp) = (2, 1, 2) mesh: TP on each block's MLP, FSDP2's native
    HSDP on the two data-parallel dimensions (a shard group of one rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = fm.TinyNet(32, 2)
    full = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    layouts._tensor_parallel(model, full["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=full["dp_replicate", "dp_shard"])
    fully_shard(model, mesh=full["dp_replicate", "dp_shard"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a shard group of one rank: nothing for the custom comms
        handle = qsdp.quantize_comms(model, preset) if preset else None
    built = layouts.Built(model, full["dp_replicate"].get_local_rank())
    losses, grads, _ = _steps(built, steps)
    calls = [rs.all_reduce.calls for rs in handle.reduce_scatters] if handle else None
    return losses, layouts.full_params(model), grads, calls


def test_3d_with_a_one_rank_shard_dimension_is_native_bit_for_bit():
    native = run_pooled(_tiny_3d, 4, None, 3, local_world_size=2)
    ours = run_pooled(_tiny_3d, 4, "fsdp", 3, local_world_size=2)
    _assert_bit_identical(native, ours)
    assert all(calls == [3, 3, 3] for *_, calls in ours)  # the hook ran without a reduce-scatter


@pytest.mark.slow
def test_3d_2x2x2_is_native_bit_for_bit():
    native = run_pooled(_train, 8, None, "3d", 4, 2, local_world_size=4, timeout=300)
    ours = run_pooled(_train, 8, "fsdp", "3d", 4, 2, local_world_size=4, timeout=300)
    _assert_bit_identical(native, ours)


@pytest.fixture(scope="module")
def native_losses():
    return run_pooled(_train, 4, None, "hsdp", 30, 1, local_world_size=PER_NODE)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["sdp4bit", "hsdp4"])
def test_quantized_presets_train_close_to_native_hsdp(preset, native_losses):
    for (ours, params, _, _), (native, *_) in zip(run_pooled(_train, 4, preset, "hsdp", 30, 1, local_world_size=PER_NODE),
                                                 native_losses):
        last, base = sum(ours[-5:]) / 5, sum(native[-5:]) / 5
        assert last < 0.5 * sum(ours[:5]) / 5
        assert abs(last - base) < 0.25 * base + 0.02


def _replica_shards(rank, world, preset):
    built, _ = _native(preset)
    _steps(built, 5, accumulate=2)
    mesh = next(iter(built.model.parameters())).device_mesh
    return mesh.get_local_rank(1), [p.to_local().clone() for p in built.model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["sdp4bit", "hsdp4"])
def test_quantized_replicas_stay_bit_identical(preset):
    by_slot: dict[int, list] = {}
    for slot, shards in run_pooled(_replica_shards, 4, preset, local_world_size=PER_NODE):
        by_slot.setdefault(slot, []).append(shards)
    for a, b in by_slot.values():
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _meter(rank, world, preset):
    built = layouts.build("hsdp", native_hsdp=True)
    handle = qsdp.quantize_comms(built.model, preset)
    _steps(built, 1)
    handle.comm_stats(reset=True)
    _steps(built, 1, start=1)
    return handle.comm_stats()


# hsdp4: only the all-reduce between the nodes is quantized; sdp4bit also quantizes the
# gradients inside the node (one 8-bit hop) and gathers weights exactly inside it.
@pytest.mark.slow
@pytest.mark.parametrize("preset,intra_grads", [("hsdp4", 32.0), ("sdp4bit", None)])
def test_the_meter_shows_the_quantized_all_reduce_between_nodes(preset, intra_grads):
    for stats in run_pooled(_meter, 4, preset, local_world_size=PER_NODE):
        assert 4.0 < stats["grads"]["inter"]["bits_per_element"] < 5.0  # codes, scales, padding
        if intra_grads:
            assert stats["grads"]["intra"]["bits_per_element"] == intra_grads
        else:
            assert 8.0 < stats["grads"]["intra"]["bits_per_element"] < 9.0
        assert stats["weights"]["inter"]["bytes"] == 0


def _resume(rank, world, path, preset):
    from qsdp.train.checkpoint import load_checkpoint, save_checkpoint

    built, handle = _native(preset)
    _, _, opt = _steps(built, 3)
    save_checkpoint(path, 3, built.model, opt, handle, {})
    straight, _, _ = _steps(built, 3, start=3, opt=opt)
    expected = layouts.full_params(built.model)
    handle.close()

    built, handle = _native(preset)
    _, _, opt = _steps(built, 1)  # optimizer state exists before the load, as in a restarted run
    load_checkpoint(f"{path}/checkpoints/step_00000003", built.model, opt, handle, torch.device("cpu"))
    resumed, _, _ = _steps(built, 3, start=3, opt=opt)
    return straight == resumed, all(torch.equal(a, b) for a, b in zip(expected, layouts.full_params(built.model)))


@pytest.mark.parametrize("preset", ["sdp4bit", *(pytest.param(p, marks=pytest.mark.slow)
                                                 for p in ("fsdp", "hsdp4", "qsdp", "zeropp"))])
def test_own_loop_checkpoint_resumes_bit_identically(preset, tmp_path):
    assert run_pooled(_resume, 4, str(tmp_path), preset, local_world_size=PER_NODE) == [(True, True)] * 4


def _across_nodes(rank, world, preset):
    """A native HSDP mesh whose shard dimension pairs ranks of different nodes."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2).T, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = fm.TinyNet()
    fully_shard(model, mesh=mesh)
    qsdp.comm_stats(reset=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            qsdp.quantize_comms(model, preset)
        except qsdp.ConfigError as e:
            return "error", str(e), qsdp.comm_stats()["grads"]["total"]["bytes"]
    return "ok", [str(w.message) for w in seen if "spans" in str(w.message)], None


def test_a_shard_dimension_across_nodes_is_refused_for_hsdp4():
    for kind, message, moved in run_pooled(_across_nodes, 4, "hsdp4", local_world_size=PER_NODE):
        assert kind == "error" and "shard dimension" in message and "spans 2 nodes" in message
        assert moved == 0


@pytest.mark.slow
def test_a_shard_dimension_across_nodes_is_warned_about_once_for_sdp4bit_and_accepted_for_fsdp():
    results = run_pooled(_across_nodes, 4, "sdp4bit", local_world_size=PER_NODE)
    assert [len(w) for _, w, _ in results] == [1, 0, 0, 0]
    assert all(kind == "ok" and not w for kind, w, _ in run_pooled(_across_nodes, 4, "fsdp", local_world_size=PER_NODE))


def _with_replicate_group(rank, world):
    built = layouts.build("hsdp", native_hsdp=True)
    try:
        qsdp.quantize_comms(built.model, "sdp4bit", replicate_group=built.replicate_group)
    except qsdp.ConfigError as e:
        return str(e)
    return None


def test_replicate_group_beside_a_native_mesh_is_refused_naming_the_native_way():
    for message in run_pooled(_with_replicate_group, 4, local_world_size=PER_NODE):
        assert "native HSDP mesh" in message and "leave replicate_group= out" in message


def _mixed_meshes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = fm.TinyNet()
    fully_shard(model.blocks[0], mesh=mesh)
    fully_shard(model, mesh=mesh["shard"])
    try:
        qsdp.quantize_comms(model, "sdp4bit", group=mesh["shard"].get_group())
    except qsdp.ConfigError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_blocks_on_a_native_mesh_beside_a_1d_root_are_refused():
    for message in run_pooled(_mixed_meshes, 4, local_world_size=PER_NODE):
        assert message is not None and "different data-parallel meshes" in message


def _hook_kept(rank, world):
    built, handle = _native("hsdp4")
    groups = [m for m in built.model.modules() if isinstance(m, FSDPModule)]
    return len(groups) == len(handle.reduce_scatters), handle.replicas, repr(handle)


@pytest.mark.slow
def test_the_handle_counts_the_replicas_of_the_mesh():
    for same, replicas, text in run_pooled(_hook_kept, 4, local_world_size=PER_NODE):
        assert same and replicas == 2 and "HSDP over 2 replicas" in text


def _state_dict_keys(rank, world, preset):
    built, _ = _native(preset)
    _steps(built, 1)
    sd = built.model.state_dict()
    return {k: (type(v).__name__, tuple(str(p) for p in v.placements)) for k, v in sd.items()}


@pytest.mark.slow
def test_the_state_dict_keeps_fsdp2s_native_placements():
    assert run_pooled(_state_dict_keys, 4, "sdp4bit", local_world_size=PER_NODE) == \
        run_pooled(_state_dict_keys, 4, None, local_world_size=PER_NODE)


def _step_check(rank, world):
    built, handle = _native("sdp4bit")
    x, y = fm.batch(0, built.data_rank)
    torch.nn.functional.mse_loss(built.model(x), y).backward()
    check = qsdp.check_gradients(handle, built.model.parameters())
    full = torch.cat([p.grad.full_tensor().flatten() for p in built.model.parameters()]).norm().item()
    return check.nonfinite, check.grad_norm, full


def test_the_steps_gradient_norm_counts_each_element_once_across_the_replicas():
    for nonfinite, norm, full in run_pooled(_step_check, 4, local_world_size=PER_NODE):
        assert not nonfinite
        assert norm == pytest.approx(full, rel=1e-6)


def _checked_step_reads(rank, world, preset):
    from test_sync_policy import _count_qsdp_reads

    built, handle = _native(preset)
    opt = torch.optim.Adam(built.model.parameters(), lr=1e-2)

    def step(n):
        x, y = fm.batch(n, built.data_rank)
        loss = torch.nn.functional.mse_loss(built.model(x), y)
        loss.backward()
        params = list(built.model.parameters())
        result = qsdp.check_gradients(handle, params, sums=[loss.detach()], agree_ahead=True)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, result.norm)
        if not result.nonfinite:
            opt.step()
        opt.zero_grad()

    for n in range(2):  # warm-up: replicas established, one ordinary step done
        step(n)
    log: list[str] = []
    _count_qsdp_reads(log)
    per_step = []
    for n in range(3):
        step(10 + n)
        per_step.append(list(log))
        log.clear()
    return per_step


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["sdp4bit", "hsdp4"])
def test_a_checked_step_reads_the_host_once(preset):
    # The hook across the replicas reads nothing: the check's one read is the step's only one.
    for per_step in run_pooled(_checked_step_reads, 4, preset, local_world_size=PER_NODE):
        assert per_step == [["tolist from qsdp.gradient_check"]] * 3


# ------------------------------------------------------------------ the layouts matrix, native rows

def _matrix_cell(rank, world, layout, feature):
    from test_layouts import FEATURES, PRESETS, STEPS

    kw = dict(FEATURES[feature])
    accumulate = kw.pop("accumulate", 1)
    out = {}
    for preset in PRESETS:
        built, handle = _native(preset, layout, **kw)
        losses = layouts.train(built, STEPS, accumulate)
        out[preset] = (losses, layouts.full_params(built.model))
        if handle is not None:
            handle.close()
    return out


def _matrix_cells():
    from test_layouts import FEATURES

    for layout in ("hsdp", "3d"):
        for feature in FEATURES:
            if feature != "hpz":  # a shard group of 2: reshard_after_forward=2 is ZeRO-3
                yield pytest.param(layout, feature, id=f"native-{layout}-{feature}", marks=[pytest.mark.slow])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout,feature", list(_matrix_cells()))
def test_native_hsdp_layout_trains_with_every_preset(layout, feature):
    """docs/layouts.md's native HSDP rows: ``fsdp`` bit-identical to FSDP2's native HSDP,
    ``qsdp`` and ``sdp4bit`` finite and close to it."""
    results = run_pooled(_matrix_cell, layouts.WORLD[layout], layout, feature,
                        local_world_size=layouts.PER_NODE[layout], timeout=540)
    for by_preset in results:
        native_losses, native_params = by_preset[None]
        losses, params = by_preset["fsdp"]
        assert losses == native_losses
        assert all(torch.equal(a, b) for a, b in zip(params, native_params))
        for preset in ("qsdp", "sdp4bit"):
            losses, _ = by_preset[preset]
            assert all(math.isfinite(x) for x in losses), preset
            assert sum(losses[-3:]) / 3 < sum(native_losses[-3:]) / 3 * 1.5 + 0.05, preset
