"""The private FSDP2 state qsdp reads, in one place.

FSDP2's public API sets a custom comm or a divide factor per module but cannot say which
modules share one parameter group (``fully_shard([norm, output])`` makes two ``FSDPModule``
objects over one group) or whether a divide factor was set. Both are read here and nowhere else;
``tests/test_fsdp2_internals.py`` checks that these symbols still exist in the installed torch.
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


def all_gather_comms(module: nn.Module) -> list[Any]:
    """The all-gather comm objects ``module``'s parameter groups call now (FSDP2's default, or
    what ``set_custom_all_gather`` set): FSDP2 sets them but offers no getter."""
    return [g._all_gather_comm for g in param_groups(module)]
