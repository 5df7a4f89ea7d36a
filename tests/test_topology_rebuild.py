"""Process groups can be rebuilt: a process that destroys its world and initialises a new one
(twice) quantizes and trains with every preset in each world alike; a handle's close() gives
its node subgroups back to the world, and post-forward groups get none."""

from __future__ import annotations

import datetime
import os

import pytest

import qsdp
from distributed import run_pooled

pytestmark = pytest.mark.timeout(240)

HSDP_ONLY = ("hsdp4", "hsdp8")  # quantize only the replicas' all-reduce: need replicate_group


def _model(preset):
    """The shared tiny model: sharded over the world, or, for an HSDP-only preset, inside each
    node with its replicate group."""
    import fsdp_models as fm
    import torch
    from torch.distributed.fsdp import fully_shard

    if preset not in HSDP_ONLY:
        return fm.build(seed=1), None
    groups = qsdp.hsdp_groups(device_type="cpu")
    torch.manual_seed(1)
    model = fm.TinyNet()
    for b in model.blocks:
        fully_shard(b, mesh=groups.shard_mesh)
    fully_shard(model, mesh=groups.shard_mesh)
    return model, groups.replicate_group


def _three_worlds(rank, world, store_dir):
    import fsdp_models as fm
    import torch.distributed as dist

    worlds = []
    for k in range(3):
        if k:  # the harness made the first world; these are the second and third
            store = dist.FileStore(os.path.join(store_dir, f"world{k}"), world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=60))
        losses = {}
        for preset in qsdp.preset_names():
            model, replicate_group = _model(preset)
            handle = qsdp.quantize_comms(model, preset, replicate_group=replicate_group)
            losses[preset] = fm.train(model, 1, rank)
            handle.close()
        worlds.append(losses)
        dist.destroy_process_group()
    return worlds


def test_destroy_and_init_the_world_twice_in_one_process_trains_every_preset_alike(tmp_path):
    """The two-level reduce-scatter once raised 'not initialized in the world group map' in a
    second world: subgroups were cached by their ranks alone."""
    for first, second, third in run_pooled(_three_worlds, 4, str(tmp_path), local_world_size=2, timeout=200):
        assert set(first) == set(qsdp.preset_names())
        assert first == second == third


def _held_after(rank, world):
    import fsdp_models as fm
    import torch.distributed as dist
    from qsdp.comm.topology import pooled_subgroups

    held = lambda: len(dist.distributed_c10d._world.pg_names)  # noqa: E731
    before = held()
    model_b, model_c = fm.build(), fm.build()
    a = qsdp.quantize_comms(fm.build(), "sdp4bit")
    b = qsdp.quantize_comms(model_b, "sdp4bit")  # the same group: shares a's subgroups
    both = sorted(pooled_subgroups().values())
    shared = a.topology is b.topology
    a.close()
    fm.train(model_b, 1, rank)  # b still trains on the subgroups it holds
    b.close()
    idle = sorted(pooled_subgroups().values())
    c = qsdp.quantize_comms(model_c, "qsdp")  # takes the pooled subgroups back
    again = sorted(pooled_subgroups().values())
    fm.train(model_c, 1, rank)
    c.close()
    return held() - before, shared, both, idle, again


def test_close_gives_the_subgroups_back_to_the_world_for_the_next_handle():
    # two subgroups (intra- and inter-node) made once for three handles: held by the topology
    # that a and b share, idle once both closed, taken again by c
    assert run_pooled(_held_after, 4, local_world_size=2) == [(2, True, [1, 1], [0, 0], [1, 1])] * 4


def _post_forward(rank, world):
    import fsdp_models as fm
    import torch.distributed as dist

    held = lambda: len(dist.distributed_c10d._world.pg_names)  # noqa: E731
    model = fm.build(reshard_after_forward=3)  # post-forward groups of 3 over 3 nodes of 2
    before = held()
    handle = qsdp.quantize_comms(model, "qsdp")
    made = held() - before
    post = [ag.post_forward.topology for ag in handle.all_gathers if ag.post_forward is not None]
    losses = fm.train(model, 2, rank)
    handle.close()
    return (made, sorted({t.world_size for t in post}), [t.intra_group is None for t in post],
            [len(r) for r in post[0].intra_ranks], losses)


def test_post_forward_groups_get_no_subgroups_and_may_hold_uneven_ranks_per_node():
    """reshard_after_forward=3 on 3 nodes of 2: the post-forward group {0, 1, 2} holds 2 ranks
    of one node and 1 of another, which its single all-gather does not mind."""
    for rank, (made, sizes, bare, per_node, losses) in enumerate(run_pooled(_post_forward, 6, local_world_size=2)):
        assert made == 2  # the FSDP group's intra- and inter-node subgroups only
        assert sizes == [3] and all(bare)
        assert sorted(per_node) == ([1, 2] if rank in (0, 1, 2) else [1, 2])
        assert all(loss == loss for loss in losses)


def _post_forward_gather_on_another_group(rank, world_size):
    import torch
    import torch.distributed as dist
    from qsdp.comm.topology import Topology
    from qsdp.fsdp import _post_forward_gather

    comm = _post_forward_gather(qsdp.resolve_config("qsdp"), Topology.contiguous(1, 2), 0,
                                "group 1 (blocks.0) after forward")
    try:
        comm(torch.zeros(8), torch.zeros(8)[:4], dist.group.WORLD)
    except RuntimeError as e:
        return str(e)
    return None


def test_a_post_forward_gather_called_on_another_group_names_the_post_forward_group():
    # in a world of its own: a process group made in the test process would outlive it there
    (message,) = run_pooled(_post_forward_gather_on_another_group, 1)
    assert message is not None and message.startswith("group 1 (blocks.0) after forward: FSDP2's post-forward group")
    assert "has 1 ranks but qsdp was set up for 2" in message and "\n" not in message
