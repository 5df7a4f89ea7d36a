"""The private FSDP2 state qsdp reads, in one place.

FSDP2's public API sets a custom comm or a divide factor per module but cannot say which
modules share one parameter group (``fully_shard([norm, output])`` makes two ``FSDPModule``
objects over one group), whether FSDP2 already ran a model (its lazy init), whether a divide
factor was set, or which process groups a group's all-gathers and reduce-scatter run over (the
mesh it shards over, and the smaller one of ``reshard_after_forward=<int>``), nor let the
all-reduce hook replace native HSDP's all-reduce across the replicas (one field is changed for
that), nor lay out a group's flat shard parameter by parameter. They are read and changed here
and nowhere else; ``tests/test_fsdp2_internals.py`` checks that these symbols still exist and
behave so in the installed torch. Every field is read with :func:`field`: a torch that renamed
one raises :class:`Fsdp2Changed` naming it, where a default would quietly change what qsdp does
(a divide factor read as unset, a mesh read as 1-D).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Fsdp2Changed(RuntimeError):
    """The installed torch's FSDP2 lacks private state qsdp reads or changes (renamed or removed)."""


def field(obj: Any, name: str) -> Any:
    """``obj.name``, or :class:`Fsdp2Changed` naming the field and the torch release."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise Fsdp2Changed(
            f"qsdp relies on FSDP2's private {type(obj).__name__}.{name}, which torch {torch.__version__} does not "
            "have: this qsdp does not support this torch release (see qsdp._fsdp2)") from None


def fsdp_state(module: nn.Module) -> Any:
    """The ``FSDPState`` shared by every module that one ``fully_shard`` call wrapped."""
    return module._get_fsdp_state()  # type: ignore[operator]


def has_run(module: nn.Module) -> bool:
    """Whether FSDP2 has run ``module``'s ``fully_shard`` call: its lazy init, at the first
    forward through the root (``FSDPState._lazy_init``), sets ``_is_root`` from ``None`` to
    ``True`` on the root's state and to ``False`` on every other state under it."""
    return field(fsdp_state(module), "_is_root") is not None


def param_groups(module: nn.Module) -> list[Any]:
    """The ``FSDPParamGroup`` objects of ``module``'s ``fully_shard`` call (none if it owns no
    parameter)."""
    state = fsdp_state(module)
    if not hasattr(state, "_fsdp_param_groups"):  # torch releases with one group per state
        group = field(state, "_fsdp_param_group")
        return [] if group is None else [group]
    return list(state._fsdp_param_groups)


def gradient_divide_factor(module: nn.Module) -> float | None:
    """The factor ``set_gradient_divide_factor`` set on ``module``'s groups (it sets every group
    of the call alike), or ``None`` where it was not called. Read at every reduce-scatter to
    refuse a factor set after ``quantize_comms``: one attribute read, no device work."""
    groups = param_groups(module)
    return field(groups[0], "gradient_divide_factor") if groups else None


def has_custom_divide_factor(module: nn.Module) -> bool:
    """Whether ``set_gradient_divide_factor`` was called on ``module``'s group: FSDP2 then passes
    ``ReduceOp.PREMUL_SUM(1/factor)``, an op whose factor a custom reduce-scatter cannot read."""
    return gradient_divide_factor(module) is not None


def shard_groups(module: nn.Module) -> tuple[Any, Any] | None:
    """``(shard group, post-forward group or None)`` of ``module``'s ``fully_shard`` call: the
    process group FSDP2 all-gathers and reduce-scatters over (the shard dimension of its mesh,
    whatever the mesh's other dimensions), and the smaller group it re-gathers over in backward
    after ``reshard_after_forward=<int>``. ``None`` for a module that owns no parameter."""
    groups = param_groups(module)
    if not groups:
        return None
    g = groups[0]
    post = field(g, "post_forward_mesh_info")
    main = field(field(g, "mesh_info"), "shard_process_group")
    if post is None or post == g.mesh_info:
        return main, None
    return main, field(post, "shard_process_group")


def all_gather_comms(module: nn.Module) -> list[Any]:
    """The all-gather comm objects ``module``'s parameter groups call now (FSDP2's default, or
    what ``set_custom_all_gather`` set): FSDP2 sets them but offers no getter."""
    return [field(g, "_all_gather_comm") for g in param_groups(module)]


def shard_row_spans(module: nn.Module, with_gradients: bool = False) -> list[tuple[int, bool]]:
    """``(elements, replicated)`` of each parameter in the flat shard row FSDP2 all-gathers from
    for ``module``'s ``fully_shard`` call, in its order: the parameter's padded shard
    (``padded_sharded_param_size``) and whether the parameter's values are the same on every rank
    of the mesh's other dimensions (a plain tensor, or a DTensor whose own placements, those it
    had before ``fully_shard``, are all ``Replicate``: a norm beside tensor parallelism), as
    opposed to one rank's TP (or EP) shard. Empty for a module owning no parameter.

    ``with_gradients``: the row FSDP2 reduce-scatters into instead, which holds only the
    parameters that have a gradient (``FSDPParamGroup.post_backward``): those that require one
    (frozen parameters, e.g. a LoRA adapter's base weights, are left out), as long as each got
    one this step."""
    spans = []
    for group in param_groups(module):
        for fsdp_param in field(group, "fsdp_params"):
            if with_gradients and not field(fsdp_param, "sharded_param").requires_grad:
                continue
            spec = _dtensor_spec(fsdp_param)
            replicated = spec is None or all(p.is_replicate() for p in spec.placements)
            spans.append((field(fsdp_param, "padded_sharded_param_size").numel(), replicated))
    return spans


def reduce_scatter_padding(module: nn.Module) -> list[tuple[int, int]]:
    """``(elements, real)`` of each parameter in the flat shard row FSDP2 reduce-scatters into
    for ``module``'s ``fully_shard`` call (:func:`shard_row_spans` with ``with_gradients``): its
    padded shard and how many of those elements, the first ones, are this rank's part of the
    parameter (``sharded_size``); the rest is padding, which the optimizer never sees."""
    rows = []
    for group in param_groups(module):
        for fsdp_param in field(group, "fsdp_params"):
            if field(fsdp_param, "sharded_param").requires_grad:
                rows.append((field(fsdp_param, "padded_sharded_param_size").numel(),
                             field(fsdp_param, "sharded_size").numel()))
    return rows


def all_gather_row(module: nn.Module) -> tuple[int, torch.dtype | None]:
    """``(elements, dtype)`` of the flat row FSDP2 all-gathers from on each rank for ``module``'s
    ``fully_shard`` call, known before its first forward: the parameters' padded shards, in the
    dtype FSDP2 casts them to (the mixed-precision policy's ``param_dtype`` for a floating-point
    parameter of another dtype, as ``FSDPParam.init_dtype_attrs`` decides at the lazy init, else
    the parameter's own). ``dtype`` is ``None`` where the parameters' dtypes differ (FSDP2 then
    gathers bytes). ``(0, None)`` for a module owning no parameter."""
    numel, dtypes = 0, set()
    for group in param_groups(module):
        wanted = field(field(group, "mp_policy"), "param_dtype")
        for fsdp_param in field(group, "fsdp_params"):
            numel += field(fsdp_param, "padded_sharded_param_size").numel()
            own = field(fsdp_param, "sharded_param").dtype
            dtypes.add(wanted if wanted is not None and own.is_floating_point else own)
    return numel, (dtypes.pop() if len(dtypes) == 1 else None)


def _dtensor_spec(fsdp_param: Any) -> Any:
    """The ``DTensorSpec`` a TP/EP parameter had before ``fully_shard``, ``None`` for a plain one.
    torch 2.13 keeps it in ``_unsharded_dtensor_spec`` (``None`` for a plain parameter); older releases
    (torch 2.11) in ``_tp_spec``, set only where ``is_dtensor``."""
    if hasattr(fsdp_param, "_unsharded_dtensor_spec"):
        return fsdp_param._unsharded_dtensor_spec
    return field(fsdp_param, "_tp_spec") if field(fsdp_param, "is_dtensor") else None


def unevenly_split_params(module: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters of ``module``'s ``fully_shard`` call that tensor or expert
    parallelism splits unevenly: a ``Shard(d)`` placement over a mesh dimension that does not
    divide the parameter's size along ``d``, so the TP ranks' shards differ in size."""
    found = []
    for group in param_groups(module):
        for fsdp_param in field(group, "fsdp_params"):
            spec = _dtensor_spec(fsdp_param)
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
    info = field(groups[0], "mesh_info")
    dim = field(info, "replicate_mesh_dim")
    if dim is None or field(info, "shard_mesh_dim") is None:
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
    the replicate group's size count this rank alone: the hook divides by the replicas.

    A torch that renamed the field raises here (an assignment would only add an attribute FSDP2
    never reads); one that reads the group from elsewhere is caught at the first all-reduce:
    ``noop_group`` then sees no call before the hook runs (:mod:`qsdp.comm.hsdp`)."""
    for g in param_groups(module):
        info = field(g, "mesh_info")
        field(info, "replicate_process_group")
        info.replicate_process_group = noop_group


def at_end_of_backward(callback: Any) -> bool:
    """Run ``callback`` once the backward now running ends (an autograd final callback, as
    FSDP2's root post-backward is); ``False``, and nothing queued, outside a backward (a
    pipeline schedule that runs FSDP2's post-backward itself)."""
    engine = field(torch.autograd.Variable, "_execution_engine")
    try:
        field(engine, "queue_callback")(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True
