"""A loop of one's own saves and resumes bit for bit on every layout: 1-D and dp x tp (TP on the
MLP, FSDP2 over the dp dimension), with the plain, weight-difference and SDP4Bit presets.

On dp x tp every dp group holds its own weight-difference replica rows (of its own TP shards);
the checkpoint keys each row by the module's path and the group, so each group gets its rows
back, not another group's."""

from __future__ import annotations

import pytest
import torch

import qsdp
import fsdp_models as fm
import layouts
from distributed import run_pooled
from qsdp.train.checkpoint import load_checkpoint, save_checkpoint, step_dirname

pytestmark = pytest.mark.timeout(300)

PRESETS = ("fsdp", "qwd4", "sdp4bit")
SAVED_AT, MORE = 3, 3


def _save_and_go_on(rank, world, layout, out, presets):
    """Per preset: SAVED_AT steps, a checkpoint, MORE steps; the losses after the checkpoint."""
    losses = {}
    for preset in presets:
        built = layouts.build(layout)
        handle = qsdp.quantize_comms(built.model, preset)
        opt = torch.optim.Adam(built.model.parameters(), lr=1e-2)
        fm.optimizer_steps(built.model, opt, 0, SAVED_AT, built.data_rank)
        save_checkpoint(f"{out}/{preset}", SAVED_AT, built.model, opt, handle, meta={})
        losses[preset] = fm.optimizer_steps(built.model, opt, SAVED_AT, MORE, built.data_rank)
        handle.close()
    return losses


def _resume(rank, world, layout, out, presets):
    losses = {}
    for preset in presets:
        built = layouts.build(layout, seed=7)  # other initial weights: everything comes from the checkpoint
        handle = qsdp.quantize_comms(built.model, preset)
        opt = torch.optim.Adam(built.model.parameters(), lr=1e-2)
        load_checkpoint(f"{out}/{preset}/checkpoints/{step_dirname(SAVED_AT)}", built.model, opt, handle,
                        torch.device("cpu"))
        losses[preset] = fm.optimizer_steps(built.model, opt, SAVED_AT, MORE, built.data_rank)
        handle.close()
    return losses


def _resumes_bit_identically(tmp_path, layout, presets):
    world, per_node = layouts.WORLD[layout], layouts.PER_NODE[layout]
    args = (layout, str(tmp_path), presets)
    uninterrupted = run_pooled(_save_and_go_on, world, *args, local_world_size=per_node, timeout=240)
    resumed = run_pooled(_resume, world, *args, local_world_size=per_node, timeout=240)
    for rank in range(world):
        for preset in presets:
            assert resumed[rank][preset] == uninterrupted[rank][preset], (rank, preset)


@pytest.mark.slow  # the 1-D resume is also in tests/test_comm_checkpoint.py and tests/test_elastic.py
def test_an_own_loop_resumes_bit_identically_on_a_1d_mesh(tmp_path):
    _resumes_bit_identically(tmp_path, "1d", (*PRESETS, "qsdp", "zeropp"))


def test_an_own_loop_resumes_bit_identically_on_dp_x_tp(tmp_path):
    """Each dp group's weight-difference rows come back to that group (qwd4 resumed another
    group's rows when the rows were keyed without their group)."""
    _resumes_bit_identically(tmp_path, "dp_tp", ("fsdp", "qwd4"))


@pytest.mark.slow
def test_quantized_gradients_resume_bit_identically_on_dp_x_tp(tmp_path):
    """With quantized gradients too: the parameters TP replicates stay the same on both TP ranks
    (tests/test_tp_replicas.py), so the one copy DCP stores is each rank's own."""
    _resumes_bit_identically(tmp_path, "dp_tp", ("sdp4bit", "qsdp", "zeropp"))
