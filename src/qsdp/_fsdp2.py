"""The private FSDP2 state qsdp reads, in one place.

FSDP2's public API sets a custom comm or a divide factor per module but cannot say which
modules share one parameter group (``fully_shard([norm, output])`` makes two ``FSDPModule``
objects over one group), whether a divide factor was set, or which process groups a group's
all-gathers and reduce-scatter run over (the mesh it shards over, and the smaller one of
``reshard_after_forward=<int>``), nor let the all-reduce hook replace native HSDP's
all-reduce across the replicas (one field is changed for that), nor lay out a group's flat
shard parameter by parameter. They are read and changed here
and nowhere else; ``tests/test_fsdp2_internals.py`` checks that these symbols still exist and
behave so in the installed torch.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def fsdp_state(module: nn.Module) -> Any:
    """The ``FSDPState`` shared by every module that one ``fully_shard`` call wrapped."""
    return module._get_fsdp_state()  # type: ignore[operator]


def param_groups(module: nn.Module) -> list[Any]:
    """The ``FSDPParamGroup`` objects of ``module``'s ``fully_shard`` call (none if it owns no
    parameter)."""
    state = fsdp_state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per state
        group = state._fsdp_param_group
        groups = [] if group is None else [group]
    return list(groups)


def has_custom_divide_factor(module: nn.Module) -> bool:
    """Whether ``set_gradient_divide_factor`` was called on ``module``'s group: FSDP2 then passes
    ``ReduceOp.PREMUL_SUM(1/factor)``, an op whose factor a custom reduce-scatter cannot read."""
    return any(getattr(g, "gradient_divide_factor", None) is not None for g in param_groups(module))


def shard_groups(module: nn.Module) -> tuple[Any, Any] | None:
    """``(shard group, post-forward group or None)`` of ``module``'s ``fully_shard`` call: the
    process group FSDP2 all-gathers and reduce-scatters over (the shard dimension of its mesh,
    whatever the mesh's other dimensions), and the smaller group it re-gathers over in backward
    after ``reshard_after_forward=<int>``. ``None`` for a module that owns no parameter."""
    groups = param_groups(module)
    if not groups:
        return None
    g = groups[0]
    post = getattr(g, "post_forward_mesh_info", None)
    post_group = getattr(post, "shard_process_group", None)
    main = g.mesh_info.shard_process_group
    return main, (post_group if post is not None and post != g.mesh_info else None)


def all_gather_comms(module: nn.Module) -> list[Any]:
    """The all-gather comm objects ``module``'s parameter groups call now (FSDP2's default, or
    what ``set_custom_all_gather`` set): FSDP2 sets them but offers no getter."""
    return [g._all_gather_comm for g in param_groups(module)]


def shard_row_spans(module: nn.Module) -> list[tuple[int, bool]]:
    """``(elements, replicated)`` of each parameter in the flat shard row FSDP2 all-gathers from
    and reduce-scatters into for ``module``'s ``fully_shard`` call, in its order: the parameter's
    padded shard (``padded_sharded_param_size``) and whether the parameter's values are the same
    on every rank of the mesh's other dimensions (a plain tensor, or a DTensor whose own
    placements, those it had before ``fully_shard``, are all ``Replicate``: a norm beside tensor
    parallelism), as opposed to one rank's TP (or EP) shard. Empty for a module owning no
    parameter."""
    spans = []
    for group in param_groups(module):
        for fsdp_param in group.fsdp_params:
            spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None)
            replicated = spec is None or all(p.is_replicate() for p in spec.placements)
            spans.append((fsdp_param.padded_sharded_param_size.numel(), replicated))
    return spans


def unevenly_split_params(module: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters of ``module``'s ``fully_shard`` call that tensor or expert
    parallelism splits unevenly: a ``Shard(d)`` placement over a mesh dimension that does not
    divide the parameter's size along ``d``, so the TP ranks' shards differ in size."""
    found = []
    for group in param_groups(module):
        for fsdp_param in group.fsdp_params:
            spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None)
            if spec is None:
                continue
            shape = spec.tensor_meta.shape
            if any(p.is_shard() and shape[p.dim] % spec.mesh.size(i) for i, p in enumerate(spec.placements)):
                found.append(fsdp_param.sharded_param)
    return found


def native_replicate_group(module: nn.Module) -> Any:
    """The replicate process group of ``module``'s ``fully_shard`` call on FSDP2's native HSDP
    mesh (the ranks holding the same shard, the first of the 2-D data-parallel dimensions), or
    ``None`` for a module sharded on a 1-D mesh or owning no parameter. Read from the mesh, so it
    is the real group even after :func:`route_replicate_all_reduce_to_hook`."""
    groups = param_groups(module)
    if not groups:
        return None
    info = groups[0].mesh_info
    dim = getattr(info, "replicate_mesh_dim", None)
    if dim is None or getattr(info, "shard_mesh_dim", None) is None:
        return None
    return info.mesh.get_group(dim)


def route_replicate_all_reduce_to_hook(module: nn.Module, noop_group: Any) -> None:
    """Make FSDP2's native HSDP all-reduce of ``module``'s groups run over ``noop_group`` (a
    process group of this rank alone, where it leaves the gradient as it is) so that the sum
    across the replicas is the all-reduce hook's to do.

    FSDP2 all-reduces over ``mesh_info.replicate_process_group`` after the custom
    reduce-scatter, with no hook in between; every other use of the mesh (the DTensor
    placements, the state dict, the gradient accumulation of ``set_requires_all_reduce(False)``
    and the all-reduce hook that follows) stays FSDP2's. The divide factors FSDP2 derives from
    the replicate group's size count this rank alone: the hook divides by the replicas."""
    for g in param_groups(module):
        g.mesh_info.replicate_process_group = noop_group
