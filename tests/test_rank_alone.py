"""The one-rank group FSDP2's native HSDP all-reduce is routed to once qsdp's all-reduce across
the replicas replaces it: it leaves the gradient as it is, launches nothing, belongs to no
world, and tells its caller when it is used (``qsdp.comm.rank_alone``)."""

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
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = fm.TinyNet()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = qsdp.quantize_comms(model, preset)
    # Each group its own: it tells that group's comm when FSDP2's all-reduce arrives.
    routed = [g.mesh_info.replicate_process_group is rs.rank_alone
              for m, rs in zip(handle.modules, handle.reduce_scatters) for g in _fsdp2.param_groups(m)]
    handle.close()
    return routed


def test_quantize_comms_on_a_native_hsdp_mesh_routes_every_groups_all_reduce_to_it():
    for routed in run_world(_routed, 4, "sdp4bit", local_world_size=2):
        assert routed == [True] * 3


def test_its_all_reduce_tells_the_callback_it_was_given_and_passes_on_what_it_raises():
    from qsdp.comm.rank_alone import RankAloneGroup

    seen = []
    group = RankAloneGroup(on_all_reduce=lambda: seen.append("all-reduce"))
    dist.all_reduce(torch.ones(2), group=group)
    assert seen == ["all-reduce"]

    def refuse():
        raise RuntimeError("no all-reduce expected")

    with pytest.raises(RuntimeError, match="no all-reduce expected"):
        dist.all_reduce(torch.ones(2), group=RankAloneGroup(on_all_reduce=refuse))
