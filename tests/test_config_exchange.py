"""``quantize_comms`` compares the config over the ranks of the model part's mesh (its dp and tp
dimensions), not over the world: ranks of other pipeline stages join no call of it."""

from __future__ import annotations

import pytest

import qsdp
from distributed import run_pooled
import pipeline as pl

pytestmark = pytest.mark.timeout(120)


def _per_stage(rank, world):
    mesh = pl.mesh(2, 2)
    preset = "sdp4bit" if mesh["pp"].get_local_rank() == 0 else "qsdp"
    pipe = pl.build(mesh, "1f1b", preset)
    return [h.config.name for h in pipe.handles]


def test_each_stage_compares_its_config_over_its_own_ranks():
    # Stage 0 (ranks 0, 1) and stage 1 (ranks 2, 3) quantize differently; neither is compared
    # with the other.
    assert run_pooled(_per_stage, 4, local_world_size=1) == [["sdp4bit"]] * 2 + [["qsdp"]] * 2


def _dp_tp(rank, world, odd_rank):
    import layouts

    built = layouts.build("dp_tp")  # dp groups {0, 2}, {1, 3}; tp groups {0, 1}, {2, 3}
    try:
        qsdp.quantize_comms(built.model, "qsdp" if rank == odd_rank else "sdp4bit")
    except qsdp.ConfigError as e:
        return str(e)
    return ""


def test_on_a_dp_x_tp_mesh_a_differing_rank_is_named_on_every_rank():
    # Rank 3 differs: its dp peer (1) and tp peer (2) see it directly, rank 0 through them.
    for rank, message in enumerate(run_pooled(_dp_tp, 4, 3, local_world_size=2)):
        assert "config differs across ranks" in message and "weights.mode" in message
        assert f"rank {rank} vs rank {0 if rank == 3 else 3}" in message

