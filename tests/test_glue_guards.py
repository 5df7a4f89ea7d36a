"""The FSDP2 glue is never silently wrong: what ``quantize_comms`` set up and FSDP2 later does
otherwise (a replaced all-reduce hook, FSDP2 all-reducing the replicas itself, a divide factor
set afterwards, frozen parameters beside tensor parallelism, an uneven TP split) is an error
naming the cause on every rank, or handled exactly. Real gloo worlds: native HSDP as 2 nodes x
2 ranks, dp x tp as 2 x 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import fsdp_models as fm
import layouts
import qsdp
from distributed import run_world
from qsdp.comm.row_layout import _unused_gradient_fix

pytestmark = pytest.mark.timeout(240)


def _fsdp_modules(model) -> dict[str, FSDPModule]:
    return {name or "<root>": m for name, m in model.named_modules() if isinstance(m, FSDPModule)}


def _backward_error(built) -> str | None:
    """One forward and backward on this rank's batch: the error it raised, or ``None``."""
    x, y = fm.batch(0, built.data_rank)
    try:
        torch.nn.functional.mse_loss(built.model(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return None


# ------------------------------------------------------------------ native HSDP: the all-reduce hook

def _hook_replaced(rank, world, module):
    built = layouts.build("hsdp", native_hsdp=True)
    qsdp.quantize_comms(built.model, "hsdp4")
    _fsdp_modules(built.model)[module].set_all_reduce_hook(lambda output: None)
    return _backward_error(built)


# blocks.1 reduces first in backward, the root last (its check is the end of the backward's).
@pytest.mark.parametrize("module", ["blocks.1", "<root>"])
def test_an_all_reduce_hook_set_after_quantize_comms_is_an_error_at_the_first_backward(module):
    for message in run_world(_hook_replaced, 4, module, local_world_size=2):
        assert message is not None and "hook did not run" in message and "set_all_reduce_hook" in message


def _fsdp2_all_reduces_itself(rank, world):
    from qsdp import _fsdp2

    built = layouts.build("hsdp", native_hsdp=True)
    qsdp.quantize_comms(built.model, "fsdp")
    # What a torch that reads the replicate group from another field would do: FSDP2's own
    # all-reduce goes over the real replicas again, beside qsdp's hook.
    for m in _fsdp_modules(built.model).values():
        for g in _fsdp2.param_groups(m):
            g.mesh_info.replicate_process_group = _fsdp2.native_replicate_group(m)
    return _backward_error(built)


def test_fsdp2_all_reducing_the_replicas_itself_beside_the_hook_is_an_error():
    for message in run_world(_fsdp2_all_reduces_itself, 4, local_world_size=2):
        assert message is not None and "FSDP2 summed the replicas itself" in message


def _steps_with_the_hook(rank, world):
    built = layouts.build("hsdp", native_hsdp=True)
    handle = qsdp.quantize_comms(built.model, "hsdp4")
    losses = layouts.train(built, 2, accumulate=2)
    return losses, [rs.all_reduce.calls for rs in handle.reduce_scatters]


def test_the_checks_pass_quietly_when_the_hook_runs_after_every_all_reduce():
    for losses, calls in run_world(_steps_with_the_hook, 4, local_world_size=2):
        assert len(losses) == 2 and calls == [2, 2, 2]


# ------------------------------------------------------------------ the gradient divide factor

def _late_divide_factor(rank, world, layout):
    built = layouts.build(layout, native_hsdp=layout == "hsdp")
    qsdp.quantize_comms(built.model, "fsdp", replicate_group=None if layout == "hsdp" else built.replicate_group)
    for m in _fsdp_modules(built.model).values():
        m.set_gradient_divide_factor(2.0)  # the shard group's size: FSDP2 would pass AVG
    return _backward_error(built)


@pytest.mark.parametrize("layout", ["hsdp", "1d"])
def test_a_gradient_divide_factor_set_after_quantize_comms_is_refused_at_the_first_reduction(layout):
    # Native HSDP would have divided by the factor and again by the replicas, without a word.
    for message in run_world(_late_divide_factor, 4, layout, local_world_size=2):
        assert message is not None and "set_gradient_divide_factor(2.0) was called on group" in message
        assert "after quantize_comms" in message


def _factor_before(rank, world):
    built = layouts.build("hsdp", native_hsdp=True)
    for m in _fsdp_modules(built.model).values():
        m.set_gradient_divide_factor(2.0)
    qsdp.quantize_comms(built.model, "fsdp")
    return _backward_error(built), [p.grad.full_tensor() for p in built.model.parameters()]


def _native_sum(rank, world):
    built = layouts.build("hsdp", native_hsdp=True)
    for m in _fsdp_modules(built.model).values():
        m.set_gradient_divide_factor(2.0)  # the shard group's size: gloo has no PREMUL_SUM
    return _backward_error(built), [p.grad.full_tensor() for p in built.model.parameters()]


def test_a_gradient_divide_factor_set_before_quantize_comms_divides_as_native_hsdp():
    # The sum over all 4 ranks divided by the factor alone (qsdp sums, FSDP2 divides after).
    for (err, ours), (native_err, native) in zip(run_world(_factor_before, 4, local_world_size=2),
                                                 run_world(_native_sum, 4, local_world_size=2)):
        assert err is None and native_err is None
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(ours, native))


# ------------------------------------------------------------------ frozen parameters beside TP

def _tp_replicated(model) -> list[tuple[str, torch.Tensor]]:
    from test_tp_replicas import _tp_replicated as replicated

    return replicated(model)


def _frozen_tp(rank, world, frozen: str, preset: str = "sdp4bit", steps: int = 3):
    """dp x tp with each block's ``frozen`` layer frozen: the reduce-scatter's row holds the
    block's norm and its row-parallel bias (TP-replicated) and TP shards of the others."""
    built = layouts.build("dp_tp")
    for block in built.model.blocks:
        getattr(block, frozen).requires_grad_(False)
    handle = qsdp.quantize_comms(built.model, preset)
    layouts.train(built, steps)
    mine = _tp_replicated(built.model)
    handle.close()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    theirs = dict(everyone[rank ^ 1])  # the TP peer: ranks 2k and 2k + 1
    return len(mine), [name for name, value in mine if not torch.equal(value, theirs[name])]


@pytest.mark.parametrize("frozen", ["fc1", "norm"])
def test_frozen_parameters_beside_tp_keep_the_replicated_ones_identical_on_tp_peers(frozen):
    for compared, differing in run_world(_frozen_tp, 4, frozen, local_world_size=2):
        assert compared == 10 and differing == []


def _flipped_tp(rank, world, frozen_at_attach: bool, steps: int = 8, flip_at: int = 3):
    """dp x tp with each block's fc1 (TP-sharded) frozen at quantize_comms and unfrozen at step
    ``flip_at``, or the reverse; the norms and fc2's bias (TP-replicated, 32 elements: no whole
    quantization group) share the reduce-scatter's row with the TP shards."""
    built = layouts.build("dp_tp")
    fc1 = [p for block in built.model.blocks for p in block.fc1.parameters()]
    for p in fc1:
        p.requires_grad_(not frozen_at_attach)
    handle = qsdp.quantize_comms(built.model, "sdp4bit")
    opt = torch.optim.Adam(built.model.parameters(), lr=1e-2)
    for step in range(steps):
        if step == flip_at:
            for p in fc1:
                p.requires_grad_(frozen_at_attach)
        x, y = fm.batch(step, built.data_rank)
        torch.nn.functional.mse_loss(built.model(x), y).backward()
        opt.step()
        opt.zero_grad()
    mine = _tp_replicated(built.model)
    handle.close()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    theirs = dict(everyone[rank ^ 1])  # the TP peer: ranks 2k and 2k + 1
    return len(mine), [name for name, value in mine if not torch.equal(value, theirs[name])]


@pytest.mark.parametrize("frozen_at_attach", [True, False], ids=["unfrozen-later", "frozen-later"])
def test_parameters_frozen_or_unfrozen_after_quantize_comms_keep_the_replicated_ones_identical_on_tp_peers(
        frozen_at_attach):
    for compared, differing in run_world(_flipped_tp, 4, frozen_at_attach, local_world_size=2):
        assert compared == 10 and differing == []


def _frozen_tp_resume(rank, world, path):
    from qsdp.train.checkpoint import load_checkpoint, save_checkpoint

    def build():
        built = layouts.build("dp_tp")
        for block in built.model.blocks:
            block.fc1.requires_grad_(False)
        trainable = [p for p in built.model.parameters() if p.requires_grad]
        return built, qsdp.quantize_comms(built.model, "sdp4bit"), torch.optim.Adam(trainable, lr=1e-2)

    built, handle, opt = build()
    fm.optimizer_steps(built.model, opt, 0, 3, built.data_rank)
    save_checkpoint(path, 3, built.model, opt, handle, {})
    straight = fm.optimizer_steps(built.model, opt, 3, 3, built.data_rank)
    expected = layouts.full_params(built.model)
    handle.close()

    built, handle, opt = build()
    fm.optimizer_steps(built.model, opt, 0, 1, built.data_rank)  # state exists before the load
    load_checkpoint(f"{path}/checkpoints/step_00000003", built.model, opt, handle, torch.device("cpu"))
    resumed = fm.optimizer_steps(built.model, opt, 3, 3, built.data_rank)
    return straight == resumed, all(torch.equal(a, b) for a, b in zip(expected, layouts.full_params(built.model)))


@pytest.mark.slow
def test_frozen_parameters_beside_tp_resume_bit_for_bit(tmp_path):
    assert run_world(_frozen_tp_resume, 4, str(tmp_path), local_world_size=2) == [(True, True)] * 4


def _unused_tp_layer(rank, world, unused_params: bool):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Skipping(nn.Module):
        """A block whose side layer (TP-sharded) gets no gradient in this step."""

        def __init__(self):
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16)
            self.side = nn.Linear(16, 64)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(self.norm(x))))

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Skipping()
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
                                           "side": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    if unused_params:
        model.set_reduce_scatter_unused_params(True)
    qsdp.quantize_comms(model, "sdp4bit")
    built = layouts.Built(model, mesh["dp"].get_local_rank())
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(built.data_rank))
    try:
        model(x).square().mean().backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_a_tp_parameter_without_a_gradient_in_a_step_is_an_error_naming_the_fix():
    # the fix named is one the installed torch has
    for message in run_world(_unused_tp_layer, 4, False, local_world_size=2):
        assert message is not None and _unused_gradient_fix() in message
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        assert "set_reduce_scatter_unused_params(True)" in _unused_gradient_fix()
        assert run_world(_unused_tp_layer, 4, True, local_world_size=2) == [None] * 4
    else:
        assert "gradient in every step" in _unused_gradient_fix()


# ------------------------------------------------------------------ an uneven TP split

def _uneven_stage(rank, world):
    """Two pipeline stages of a (pp, dp, tp) = (2, 1, 2) mesh: the second stage (ranks 2 and 3,
    not rank 0) splits a layer unevenly across its TP ranks."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh["pp"].get_local_rank()
    torch.manual_seed(stage)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 7 if stage == 1 else 8))
    parallelize_module(model, mesh["tp"], {"1": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a one-rank FSDP group
            qsdp.quantize_comms(model, "sdp4bit")
    except qsdp.ConfigError as e:
        return str(e)
    return None


def test_an_uneven_tp_split_on_a_stage_without_rank_0_is_refused_on_each_of_its_ranks():
    messages = run_world(_uneven_stage, 4, local_world_size=2)
    assert messages[:2] == [None, None]
    assert all(m is not None and "splits 1.weight, 1.bias unevenly" in m for m in messages[2:])


# ------------------------------------------------------------------ quantize_comms once training started

def _quantized_after_a_step(rank, world):
    model = fm.build()
    fm.train(model, 1, rank)  # one step on FSDP2's own comms
    try:
        qsdp.quantize_comms(model, "sdp4bit")
    except RuntimeError as e:
        return str(e)
    return None


def test_quantize_comms_after_a_training_step_is_refused_naming_the_first_forward():
    assert run_world(_quantized_after_a_step, 2) == [
        "quantize_comms after the model's first forward (FSDP2 already ran it with its own comms): call "
        "quantize_comms after fully_shard and before the first forward"] * 2


def _requantized_after_training(rank, world):
    model = fm.build()
    first = qsdp.quantize_comms(model, "sdp4bit")
    fm.train(model, 1, rank)
    before = first.comm_stats()
    first.close()
    second = qsdp.quantize_comms(model, "qsdp")
    losses = fm.train(model, 1, rank)
    return before["weights"]["total"]["bytes"], first.comm_stats(), second.comm_stats(), losses


def test_a_trained_model_takes_new_comms_after_close_and_they_carry_its_traffic():
    """The way to change a model's comms once it trained: close() the handle, quantize again."""
    for first_step, first_after, second, losses in run_world(_requantized_after_training, 2):
        assert first_step > 0 and first_after["weights"]["total"]["bytes"] == 0
        assert second["weights"]["total"]["bytes"] > 0 and second["grads"]["total"]["bytes"] > 0
        assert all(torch.isfinite(torch.tensor(losses)))
