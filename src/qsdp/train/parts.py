"""A rank's model parts for a checkpoint: one model, or the pipeline stages a rank holds (one
or two with interleaved schedules), each with its optimizer and its
:class:`qsdp.QuantizedComms`, as torchtitan keeps them.

The parts' state dicts are ``torch.distributed.checkpoint.state_dict``'s, per part, with the
optimizer state flattened: keyed by parameter, ``param_groups`` included, so that the stages of
a job (each on its own ranks) write theirs side by side in one checkpoint, and a stage loads
its own. The parts' parameter names must be unique across the whole model, as torchtitan's
stages keep the whole model's names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = ["ModelParts", "merged"]

# Unflattened, the optimizer's param_groups are one list under one key: every pipeline stage
# would write its own there, and DCP would keep one stage's.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _listed(x: Any) -> list[Any]:
    """A list or tuple as it is, anything else (a module: an ``nn.ModuleList`` too) as one part."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


@dataclass
class ModelParts:
    """``parts[k]`` trained by ``optimizers[k]``, its comms attached as ``handles[k]``."""

    parts: list[torch.nn.Module]
    optimizers: list[Any]
    handles: list[Any]

    @classmethod
    def of(cls, model: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any, handle: Any) -> ModelParts:
        """One model, optimizer and handle, or lists of them of one length; a ValueError naming
        the mismatch otherwise (local: before any collective)."""
        parts, optimizers, handles = _listed(model), _listed(optimizer), _listed(handle)
        if not parts or len(handles) != len(parts) or len(optimizers) != len(parts):
            raise ValueError(f"checkpoint: {len(parts)} model part(s), {len(optimizers)} optimizer(s) and "
                             f"{len(handles)} handle(s): pass one optimizer and one QuantizedComms a model part, "
                             "in the same order")
        names = [n for p in parts for n, _ in p.named_parameters()] if len(parts) > 1 else []
        if len(set(names)) != len(names):
            twice = sorted(n for n, count in Counter(names).items() if count > 1)
            raise ValueError(f"checkpoint: model parts share parameter names ({', '.join(twice[:3])}): keep the "
                             "whole model's names in each stage, as torchtitan does")
        return cls(parts, optimizers, handles)

    def state_dicts(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Per part, its model and its (flattened) optimizer state dicts."""
        got = [get_state_dict(p, o, options=_OPTIONS) for p, o in zip(self.parts, self.optimizers)]
        return [m for m, _ in got], [o for _, o in got]

    def load_state_dicts(self, model: dict[str, Any], optim: dict[str, Any],
                         keys: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> None:
        """Load every part from the merged ``model`` and ``optim`` dicts DCP filled, each part the
        keys of its own (``keys``: :meth:`state_dicts`' return)."""
        for part, opt, mine, mine_optim in zip(self.parts, self.optimizers, *keys):
            set_state_dict(part, opt, model_state_dict={k: model[k] for k in mine},
                           optim_state_dict={k: optim[k] for k in mine_optim}, options=_OPTIONS)


def merged(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """The parts' state dicts as one (their keys are distinct: :meth:`ModelParts.of`)."""
    return {k: v for d in dicts for k, v in d.items()}
