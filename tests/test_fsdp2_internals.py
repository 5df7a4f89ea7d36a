"""The private FSDP2 state that qsdp reads (``qsdp._fsdp2``) is still there in this torch."""

from torch import nn
from torch.distributed.fsdp import fully_shard

from qsdp import _fsdp2

from distributed import run_world


def _grouped_tail(rank, world):
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    fully_shard(model[0])
    fully_shard([model[1], model[2]])
    fully_shard(model)
    model[0].set_gradient_divide_factor(1.0)
    return (
        _fsdp2.fsdp_state(model[1]) is _fsdp2.fsdp_state(model[2]),
        _fsdp2.fsdp_state(model[0]) is not _fsdp2.fsdp_state(model[1]),
        len(_fsdp2.param_groups(model[1])),
        _fsdp2.has_custom_divide_factor(model[0]),
        _fsdp2.has_custom_divide_factor(model[1]),
    )


def test_one_fully_shard_call_over_two_modules_is_one_state_and_divide_factors_are_visible():
    assert run_world(_grouped_tail, 2) == [(True, True, 1, True, False)] * 2


def _custom_comm_is_read_back(rank, world):
    from qsdp.comm.all_gather import PlainAllGather

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model)
    default = _fsdp2.all_gather_comms(model)
    model.set_custom_all_gather(PlainAllGather.__new__(PlainAllGather))
    return type(default[0]).__name__ != "PlainAllGather", [type(c).__name__ for c in _fsdp2.all_gather_comms(model)]


def test_the_all_gather_comm_a_module_calls_is_readable():
    assert run_world(_custom_comm_is_read_back, 2) == [(True, ["PlainAllGather"])] * 2
