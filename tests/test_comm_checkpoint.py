"""The comm state in checkpoints: weight-difference replica rows saved through DCP, restored
bit-exactly by any layout of the same world size, re-established exactly in another one."""

from __future__ import annotations

import pytest
import torch

import qsdp
from distributed import run_pooled
import fsdp_models as fm
from qsdp.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.timeout(240)

# Weight differences with plain gradients: the reduce-scatter does not depend on the layout, so
# runs on 2 x 2 and 4 x 1 ranks compare bit for bit.
PRESET = "qwd4"


def _train_and_save(rank, world, path):
    model = fm.build()
    handle = qsdp.quantize_comms(model, PRESET)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    fm.optimizer_steps(model, opt, 0, 3, rank)
    save_checkpoint(path, 3, model, opt, handle, meta={})
    return fm.optimizer_steps(model, opt, 3, 3, rank)


def _gathered_weights_are_exact(model) -> list[bool]:
    """Hooks recording, at the next forward, whether each Linear's gathered weight equals the
    parameter's exact value."""
    exact = {id(m): m.weight.full_tensor().clone() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    seen: list[bool] = []
    hooks = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args: seen.append(torch.equal(mod.weight.detach(), exact[id(mod)]))))
    return seen, hooks


def _resume(rank, world, path, check_exact):
    model = fm.build(seed=5)  # other initial values: everything must come from the checkpoint
    handle = qsdp.quantize_comms(model, PRESET)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    load_checkpoint(path + "/checkpoints/step_00000003", model, opt, handle, torch.device("cpu"))
    seen, hooks = _gathered_weights_are_exact(model) if check_exact else ([], [])
    losses = fm.optimizer_steps(model, opt, 3, 3, rank)
    for h in hooks:
        h.remove()
    return losses, seen[:4], [tuple(ag.replica.shape) for ag in handle.all_gathers]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    return path, run_pooled(_train_and_save, 4, path, local_world_size=2)


@pytest.mark.parametrize("lws", [2, 1], ids=["same-layout-2x2", "4x1-full-replicas"])
def test_resume_on_the_same_world_size_is_bit_identical_whatever_the_ranks_per_node(saved, lws):
    path, uninterrupted = saved
    resumed = run_pooled(_resume, 4, path, False, local_world_size=lws)
    for rank, (losses, _, shapes) in enumerate(resumed):
        assert losses == uninterrupted[rank]
        assert all(s[0] == (2 if lws == 2 else 4) for s in shapes)  # the rows this layout holds


def test_resume_on_another_world_size_re_establishes_the_replicas_with_exact_values(saved):
    path, _ = saved
    for losses, exact, shapes in run_pooled(_resume, 2, path, True, local_world_size=1):
        assert exact == [True] * 4  # inp, blocks.0.fc1 / fc2, ...: the first gathers are exact
        assert all(s[0] == 2 for s in shapes)  # 2 nodes x 1: full replicas of the new shards
        assert all(torch.isfinite(torch.tensor(losses)))


def test_loading_the_run_directory_instead_of_a_checkpoint_names_latest_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / "step_00000005").mkdir(parents=True)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, torch.nn.Linear(2, 2), None, None, torch.device("cpu"))
    assert str(info.value) == (f"{tmp_path} is a run directory, not a checkpoint: pass latest_checkpoint("
                               f"{str(tmp_path)!r}) (a directory under {tmp_path / 'checkpoints'})")
