"""The private FSDP2 state that qsdp reads (``qsdp._fsdp2``) is still there in this torch."""

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from qsdp import _fsdp2

from distributed import run_pooled


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
    assert run_pooled(_grouped_tail, 2) == [(True, True, 1, True, False)] * 2


def _custom_comm_is_read_back(rank, world):
    from qsdp.comm.all_gather import PlainAllGather

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model)
    default = _fsdp2.all_gather_comms(model)
    model.set_custom_all_gather(PlainAllGather.__new__(PlainAllGather))
    return type(default[0]).__name__ != "PlainAllGather", [type(c).__name__ for c in _fsdp2.all_gather_comms(model)]


def test_the_all_gather_comm_a_module_calls_is_readable():
    assert run_pooled(_custom_comm_is_read_back, 2) == [(True, ["PlainAllGather"])] * 2


def _lazy_init_seen(rank, world):
    import torch

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model[0])
    fully_shard(model)
    before = [_fsdp2.has_run(model), _fsdp2.has_run(model[0])]
    model(torch.ones(2, 8))
    return before, [_fsdp2.has_run(model), _fsdp2.has_run(model[0])]


def test_whether_fsdp2_has_run_a_model_is_readable():
    # FSDP2's lazy init runs at the first forward through the root, for the root and its children.
    assert run_pooled(_lazy_init_seen, 2) == [([False, False], [True, True])] * 2


def _native_all_reduce_routed(rank, world):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from qsdp.comm.rank_alone import RANK_ALONE

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Linear(8, 8, bias=False)
    fully_shard(model, mesh=mesh)
    replicas = _fsdp2.native_replicate_group(model)
    _fsdp2.route_replicate_all_reduce_to_hook(model, RANK_ALONE)
    seen = []
    model.set_all_reduce_hook(lambda out: seen.append(out.clone()))
    model(torch.full((2, 8), float(rank))).sum().backward()
    grad = model.weight.grad.to_local().clone()
    others = [torch.empty_like(grad) for _ in range(2)]
    dist.all_gather(others, grad, group=mesh["replicate"].get_group())
    return (dist.get_process_group_ranks(replicas), _fsdp2.native_replicate_group(model) is replicas,
            len(seen), torch.equal(seen[0].view_as(grad), grad), torch.equal(others[0], others[1]))


def test_the_native_hsdp_all_reduce_can_be_left_to_the_all_reduce_hook():
    # The replicas' gradients stay apart: FSDP2 no longer sums them, its hook sees the shard.
    got = run_pooled(_native_all_reduce_routed, 4, local_world_size=2)
    assert [g[0] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(g[1:] == (True, 1, True, False) for g in got)


def _row_spans(rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), nn.Linear(8, 7))
    parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    uneven = [n for n, p in model.named_parameters() if any(p is q for q in _fsdp2.unevenly_split_params(model))]
    return _fsdp2.shard_row_spans(model), uneven


def test_the_flat_shard_row_is_read_parameter_by_parameter_with_its_tp_placement():
    # LayerNorm(6) weight and bias replicated (3 each a dp rank); Linear(6, 8) column-parallel:
    # a [4, 6] weight and [4] bias a TP rank, [2, 6] and [2] a dp rank; Linear(8, 7) row-parallel:
    # a [7, 4] weight a TP rank, padded to [4, 4] a dp rank, and its bias [7] replicated, padded to 4.
    spans = [(3, True), (3, True), (12, False), (2, False), (16, False), (4, True)]
    assert run_pooled(_row_spans, 4, local_world_size=2) == [(spans, [])] * 4


def _renamed(rank, world):
    import pytest
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from qsdp.comm.rank_alone import RankAloneGroup

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    fully_shard(model, mesh=mesh)
    (group,) = _fsdp2.param_groups(model)
    # A torch that renamed these fields: the objects are FSDP2's own, the fields gone.
    del group.gradient_divide_factor
    with pytest.raises(_fsdp2.Fsdp2Changed, match="FSDPParamGroup.gradient_divide_factor"):
        _fsdp2.has_custom_divide_factor(model)
    del group.mesh_info.replicate_process_group
    with pytest.raises(_fsdp2.Fsdp2Changed, match="HSDPMeshInfo.replicate_process_group"):
        _fsdp2.route_replicate_all_reduce_to_hook(model, RankAloneGroup())
    del _fsdp2.fsdp_state(model)._is_root
    with pytest.raises(_fsdp2.Fsdp2Changed, match="FSDPState._is_root"):
        _fsdp2.has_run(model)
    return not hasattr(group.mesh_info, "replicate_process_group")


def test_a_renamed_private_field_raises_naming_it_instead_of_reading_as_a_default():
    # Read with a default, a renamed divide factor would read as unset and a renamed replicate
    # group would be assigned as a new attribute FSDP2 never reads.
    assert run_pooled(_renamed, 4, local_world_size=2) == [True] * 4


class _RecordInput:
    """An all-gather comm recording the row FSDP2 hands it (elements, dtype), then gathering."""

    def __init__(self):
        from qsdp.comm.collectives import all_gather_flat

        self.gather, self.seen = all_gather_flat, []

    def allocate(self, size, *, dtype, device):
        import torch

        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.seen.append((input_tensor.numel(), input_tensor.dtype))
        self.gather(output_tensor, input_tensor, group)


def _row_before_the_first_forward(rank, world, param_dtype):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = nn.Sequential(nn.Linear(8, 5), nn.LayerNorm(5))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype)
    fully_shard(model, mp_policy=mp)
    before = _fsdp2.all_gather_row(model)
    comm = _RecordInput()
    model.set_custom_all_gather(comm)
    model(torch.randn(2, 8))
    return before, comm.seen[0]


def test_the_all_gather_row_is_known_before_the_first_forward():
    import torch

    for param_dtype in (None, torch.bfloat16):
        for before, seen in run_pooled(_row_before_the_first_forward, 2, param_dtype):
            assert before == seen, (param_dtype, before, seen)


def _padding(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Linear(7, 8))
    model[0].bias.requires_grad_(False)  # frozen: not in the reduce-scatter's row
    fully_shard(model)
    return _fsdp2.reduce_scatter_padding(model)


def test_the_reduce_scatter_rows_padding_is_read_parameter_by_parameter():
    # Over 4 ranks: Linear(6, 7)'s [7, 6] weight is 2 rows a rank (12 elements), of which the last
    # rank holds 1; Linear(7, 8)'s [8, 7] weight and [8] bias split evenly.
    last = [(12, 6), (14, 14), (2, 2)]
    assert run_pooled(_padding, 4, local_world_size=2) == [[(12, 12), (14, 14), (2, 2)]] * 3 + [last]
