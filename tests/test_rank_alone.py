"""The one-rank group FSDP2's native HSDP all-reduce is routed to once qsdp's all-reduce across
the replicas replaces it: it leaves the gradient as it is, launches nothing, and belongs to no
world (``qsdp.comm.rank_alone``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from qsdp.comm.rank_alone import RANK_ALONE


@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG])
def test_its_all_reduce_leaves_the_tensor_as_it_is_without_any_process_group(op):
    assert not dist.is_initialized()
    t = torch.arange(6, dtype=torch.float32)
    dist.all_reduce(t, op=op, group=RANK_ALONE)
    assert torch.equal(t, torch.arange(6, dtype=torch.float32))


def test_its_async_work_is_complete_when_returned():
    t = torch.ones(3)
    work = dist.all_reduce(t, group=RANK_ALONE, async_op=True)
    assert work.is_completed() and work.wait()
    assert torch.equal(work.get_future().wait()[0], t)


def test_it_is_a_group_of_one_rank():
    assert (RANK_ALONE.rank(), RANK_ALONE.size()) == (0, 1)


def test_another_collective_is_refused_naming_the_group():
    with pytest.raises(ValueError, match="RankAloneGroup"):
        dist.broadcast(torch.ones(2), 0, group=RANK_ALONE)


def _routed(rank, world, preset):
    import fsdp_models as fm
    import qsdp
    from qsdp import _fsdp2
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = fm.TinyNet()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = qsdp.quantize_comms(model, preset)
    routed = [g.mesh_info.replicate_process_group is RANK_ALONE
              for m in model.modules() if isinstance(m, FSDPModule) for g in _fsdp2.param_groups(m)]
    handle.close()
    return routed


def test_quantize_comms_on_a_native_hsdp_mesh_routes_every_groups_all_reduce_to_it():
    for routed in run_world(_routed, 4, "sdp4bit", local_world_size=2):
        assert routed and all(routed)
