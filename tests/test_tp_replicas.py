"""Parameters that tensor parallelism replicates stay the same on every TP rank, whatever qsdp
quantizes.

An FSDP group beside TP holds, in one flat shard, parameters that TP replicates (norms, biases
after a row-wise layer, embeddings, the head) and this rank's TP shards of others. Peers of one
TP group hold the same values of the first and different values of the second. Were one
quantization group or Hadamard block to span both, the peers would round the replicated values
differently, step apart, and a checkpoint (DCP stores one copy of a replicated parameter) would
resume one peer with the other's values."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import qsdp
import fsdp_models as fm
import layouts
from distributed import run_pooled

pytestmark = pytest.mark.timeout(200)


def _tp_replicated(model) -> list[tuple[str, torch.Tensor]]:
    """This rank's shard of every parameter TP replicates: Replicate on the mesh's ``tp``
    dimension, or no such dimension (a plain parameter FSDP2 sharded over the dp dimensions)."""
    out = []
    for name, p in model.named_parameters():
        on_tp = [pl for dim, pl in zip(p.device_mesh.mesh_dim_names or (), p.placements) if dim == "tp"]
        if all(pl.is_replicate() for pl in on_tp):
            out.append((name, p.to_local().detach().clone()))
    return out


def _train_and_compare(rank, world, layout, preset, steps, native=False):
    built = layouts.build(layout, native_hsdp=native)
    handle = qsdp.quantize_comms(built.model, preset, replicate_group=None if native else built.replicate_group)
    opt = torch.optim.Adam(built.model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = fm.batch(step, built.data_rank)
        torch.nn.functional.mse_loss(built.model(x), y).backward()
        opt.step()
        opt.zero_grad()
    mine = _tp_replicated(built.model)
    handle.close()
    # This rank's TP peer: the other rank of its pair (ranks 2k, 2k + 1 form a TP group).
    peer = rank ^ 1
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    theirs = dict(everyone[peer])
    return len(mine), [name for name, value in mine if not torch.equal(value, theirs[name])]


@pytest.mark.parametrize("preset", ["sdp4bit", "qsdp"])
def test_tp_replicated_parameters_stay_identical_on_dp_x_tp(preset):
    for compared, differing in run_pooled(_train_and_compare, 4, "dp_tp", preset, 3, local_world_size=2):
        assert compared == 10 and differing == []


@pytest.mark.slow
@pytest.mark.parametrize("native", [False, True], ids=["recipe", "native"])
@pytest.mark.parametrize("preset", ["sdp4bit", "hsdp4"])
def test_tp_replicated_parameters_stay_identical_on_3d(preset, native):
    """HSDP x TP (2 replicas x 2 shards x 2 TP ranks): the all-reduce across replicas too."""
    for compared, differing in run_pooled(_train_and_compare, 8, "3d", preset, 3, native, local_world_size=4,
                                         timeout=300):
        assert compared == 10 and differing == []


def _uneven_tp(rank, world, preset):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 7 if preset != "even" else 8))
    parallelize_module(model, mesh["tp"], {"1": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    try:
        handle = qsdp.quantize_comms(model, "sdp4bit" if preset == "even" else preset)
    except qsdp.ConfigError as e:
        return str(e)
    handle.close()
    return None


def test_an_uneven_tensor_parallel_split_is_refused_on_every_rank_under_a_quantizing_config():
    for message in run_pooled(_uneven_tp, 4, "sdp4bit", local_world_size=2):
        assert message is not None and "splits 1.weight, 1.bias unevenly" in message
    assert run_pooled(_uneven_tp, 4, "fsdp", local_world_size=2) == [None] * 4
    assert run_pooled(_uneven_tp, 4, "even", local_world_size=2) == [None] * 4
