"""Uses of ``quantize_comms`` that would go wrong without a word are refused in one line, before
any collective: a second call on a model whose comms are already qsdp's, and a root that
``fully_shard`` left out while its blocks are sharded. What is fine stays accepted: a second call
after ``close()``, and a wrapper around a sharded root."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.fsdp import fully_shard

import qsdp
from distributed import run_pooled
import fsdp_models as fm

pytestmark = pytest.mark.timeout(120)


def _error(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


def _twice(rank, world):
    model = fm.build()
    qsdp.quantize_comms(model, "sdp4bit")
    return _error(lambda: qsdp.quantize_comms(model, "qsdp"))


def test_a_second_quantize_comms_on_the_same_model_names_close():
    assert run_pooled(_twice, 2, timeout=100) == [(
        "RuntimeError", "quantize_comms was already called on this model (its 'sdp4bit' comms are attached): "
                        "call close() on the handle it returned before quantizing again")] * 2


def _after_close(rank, world):
    replaced = fm.build()
    qsdp.quantize_comms(replaced, "sdp4bit").close()
    second = qsdp.quantize_comms(replaced, "qsdp")
    fm.train(replaced, 2, rank)
    fresh = fm.build()
    once = qsdp.quantize_comms(fresh, "qsdp")
    fm.train(fresh, 2, rank)
    return second.comm_stats(), once.comm_stats()


def test_after_close_the_model_takes_new_comms_and_they_carry_all_its_traffic():
    for second, once in run_pooled(_after_close, 2, timeout=100):
        assert second == once and second["weights"]["total"]["bytes"] > 0


def _blocks_only(rank, world):
    model = fm.TinyNet()
    for block in model.blocks:
        fully_shard(block)
    return _error(lambda: qsdp.quantize_comms(model, "sdp4bit"))


def test_a_root_left_out_of_fully_shard_while_its_blocks_are_sharded_is_refused():
    assert run_pooled(_blocks_only, 2, timeout=100) == [(
        "ValueError", "the root TinyNet was not passed to fully_shard while 2 of its submodules were "
                      "(blocks.0, blocks.1); its parameters outside them (inp.weight, ...) would be neither "
                      "sharded nor reduced: call fully_shard(model) after fully_shard on its blocks")] * 2


class _Wrapper(nn.Module):
    """A training harness's module around a model sharded as a whole (Lightning's, say)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


def _wrapped(rank, world):
    wrapper = _Wrapper(fm.build())
    handle = qsdp.quantize_comms(wrapper, "sdp4bit")
    fm.train(wrapper, 1, rank)
    return repr(handle)


def test_a_wrapper_around_a_sharded_root_is_accepted():
    assert run_pooled(_wrapped, 2, timeout=100) == ["QuantizedComms('sdp4bit', 3 FSDP groups, 2 ranks = 1 node x 2)"] * 2


def _group_on_one_rank(rank, world):
    """Rank 0 alone passes group= a group FSDP2 does not shard over (every rank created it)."""
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    model = fm.build()
    return _error(lambda: qsdp.quantize_comms(model, "sdp4bit", group=pair if rank == 0 else None))


def test_a_wrong_group_on_one_rank_alone_raises_the_same_line_on_every_rank():
    """Not that rank alone, with the others waiting in the config exchange until it exits."""
    assert run_pooled(_group_on_one_rank, 4, timeout=100) == [(
        "ConfigError", "rank 0: group= holds ranks [0, 1] but FSDP2 shards this rank's parameters over ranks "
                       "[0, 1, 2, 3]; leave group= out (qsdp reads the mesh FSDP2 shards over) or pass that group")] * 4


def _group_as_mesh(rank, world, shape):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[:len(shape)])
    model = fm.build()
    error = _error(lambda: qsdp.quantize_comms(model, "sdp4bit", group=mesh))
    if error is None:
        fm.train(model, 1, rank)
    return error


def test_a_one_dimensional_device_mesh_is_accepted_as_its_group():
    assert run_pooled(_group_as_mesh, 4, (4,), timeout=100) == [None] * 4


def test_a_device_mesh_of_two_dimensions_is_refused_by_name():
    assert run_pooled(_group_as_mesh, 4, (2, 2), timeout=100) == [(
        "ConfigError", "group= is a 2-D DeviceMesh (2, 2): pass the one dimension it means (group=mesh['tp'], or "
                       "mesh.get_group('tp')), or leave group= out and qsdp reads the mesh FSDP2 shards over")] * 4


def _requantized_trained_model(rank, world):
    """A model trained on qsdp's comms, closed, then given new ones: their first gathers start the
    replicas from the trained weights (exact), so the forward equals one on unquantized comms."""
    import torch

    model = fm.build()
    trained = qsdp.quantize_comms(model, "sdp4bit")
    fm.train(model, 2, rank)
    trained.close()
    x, _ = fm.batch(5, rank)
    exact = qsdp.quantize_comms(model, "fsdp")
    with torch.no_grad():
        want = model(x)
    exact.close()
    again = qsdp.quantize_comms(model, "sdp4bit")
    with torch.no_grad():
        got = model(x)
    again.close()
    return torch.equal(got, want)


def test_new_comms_on_a_trained_model_start_their_replicas_from_its_current_weights():
    assert run_pooled(_requantized_trained_model, 2, timeout=100) == [True, True]
