"""Host-device syncs made by qsdp during a training step: the weight gathers decide on the host
whether a shard changed; the weight-difference gathers agree across ranks once per step."""

from __future__ import annotations

import sys

import pytest
import torch

import qsdp
from distributed import run_world
import fsdp_models as fm

pytestmark = pytest.mark.timeout(180)

_SYNCS = [(torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.Tensor, "__bool__"), (torch, "equal")]


def _count_qsdp_syncs(log: list[str]) -> None:
    """Wrap every sync entry point so that calls made from qsdp's own modules are logged (a
    forked child: the patches die with it)."""
    for owner, name in _SYNCS:
        original = getattr(owner, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller == "qsdp" or caller.startswith("qsdp."):
                log.append(f"{_name} from {caller}")
            return _original(*args, **kwargs)

        setattr(owner, name, wrapped)


def _syncs_in_one_step(rank, world, preset):
    model = fm.build(depth=3)  # 4 FSDP groups
    qsdp.quantize_comms(model, preset)
    fm.train(model, 2, rank)  # warm-up: replicas established, one ordinary step done
    log: list[str] = []
    _count_qsdp_syncs(log)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = fm.batch(10 + step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return log


@pytest.mark.parametrize("preset,expected", [
    ("fsdp", []), ("qsdp", []), ("zeropp", []),
    # the weight-difference gathers' one agreement per optimizer step, for all groups at once
    ("sdp4bit", ["tolist from qsdp.comm.versions"] * 2),
])
def test_a_training_step_makes_at_most_one_host_sync_inside_qsdp(preset, expected):
    for log in run_world(_syncs_in_one_step, 4, preset, local_world_size=2):
        assert log == expected


def _syncs_with_nonfinite_check(rank, world):
    model = fm.build(depth=3)
    handle = qsdp.quantize_comms(model, "sdp4bit")
    fm.train(model, 2, rank)
    log: list[str] = []
    _count_qsdp_syncs(log)
    x, y = fm.batch(10, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    handle.nonfinite_gradients()
    return log


def test_the_nonfinite_check_adds_exactly_one_sync_for_all_groups():
    for log in run_world(_syncs_with_nonfinite_check, 2, local_world_size=1):
        # the forward's agreement after the warm-up's step, then the check's all-reduce, read
        # once after the groups' flags were combined on the device
        assert log == ["tolist from qsdp.comm.versions", "item from qsdp.fsdp"]


def _rank_local_optimizer(rank, world):
    model = fm.build(depth=3)
    qsdp.quantize_comms(model, "sdp4bit")
    probe = torch.nn.Linear(4, 1)  # rank 0's own model: its optimizer sees none of the shards
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = fm.batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank == 0:  # between the forward's gathers and the backward's
            probe(torch.ones(4)).sum().backward()
            probe_opt.step()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


def test_an_optimizer_of_one_rank_alone_starts_no_agreement():
    # Were rank 0's probe step taken for a change, its next gather would agree alone: a hang.
    params = run_world(_rank_local_optimizer, 2, timeout=60)
    for a, b in zip(*params):
        assert torch.equal(a, b)
