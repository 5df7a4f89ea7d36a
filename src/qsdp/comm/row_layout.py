"""Where the elements of an FSDP group's flat shard row sit in the row a codec quantizes.

Beside tensor (or expert) parallelism, one FSDP group's flat shard holds parameters the TP ranks
replicate (norms, a row-wise layer's bias, embeddings and head left whole) next to this rank's TP
shards of others. TP peers hold the same values of the first and different values of the second.
A quantization group or Hadamard block spanning both would give the peers different scales for
the replicated values, so they would round them differently, train apart, and a checkpoint (DCP
stores one copy of a replicated parameter) would resume one peer with the other's values.

So the row the codec sees puts the replicated parameters first and the TP-sharded ones after
them, each part padded to whole codec units by repeating its last element (which widens no
group's range): no group or block spans both, and the replicated values sit at the same places
on every TP rank. The rounding seeds, the exchanges and the codecs are those of an ordinary row
of that length, so TP peers whose shards have equal sizes (even TP splits) round their
replicated values identically. A row without such a mix (no TP, or only one kind in the group)
keeps FSDP2's order: its layout is the identity and costs nothing.

The all-gather's row holds every parameter of the group, the reduce-scatter's only those with a
gradient (frozen parameters are left out), so the two comms get their own spans. FSDP2 reads
``requires_grad`` again at every unshard (a part frozen at first and unfrozen later is a working
FSDP2 flow), so the reduce-scatter's spans are read again at each reduction, on the host, and a
layout is built once for each set of parameters requiring a gradient. A row the spans do not
describe is an error, never the identity: spans that hold fewer elements than the row, or, in a
group that mixes the kinds, any other number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

Spans = Sequence[tuple[int, bool]]
SpansOf = Callable[[], Spans]  # the spans as they are now (the parameters requiring a gradient)


class RowMismatch(RuntimeError):
    """A shard row that mixes TP-replicated and TP-sharded parameters, and that its group's
    parameters do not describe."""


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _unused_gradient_fix() -> str:
    """What a parameter that got no gradient in a step can do about it, in the installed torch
    (torch 2.11's ``FSDPModule`` has no ``set_reduce_scatter_unused_params``; 2.13's has)."""
    from torch.distributed.fsdp import FSDPModule

    frozen = "set requires_grad=False on it before quantize_comms"
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        return ("call set_reduce_scatter_unused_params(True) on the module (FSDP2 then reduces a zero gradient "
                f"for it), or {frozen}")
    return (f"give it a gradient in every step (torch {torch.__version__}'s FSDP2 has no "
            f"set_reduce_scatter_unused_params, torch 2.13's has), or {frozen}")


def _mismatch(length: int, total: int) -> str:
    what = (f"qsdp: FSDP2 passed a shard row of {length} elements, but the group's parameters that require a "
            f"gradient hold {total}; quantized without their layout, TP-replicated and TP-sharded values could share "
            "a quantization group, and the TP-replicated ones would be rounded differently on each TP rank and "
            "drift apart.")
    if total > length:
        return f"{what} A parameter that requires a gradient got none this backward: {_unused_gradient_fix()}"
    return f"{what} The row holds elements of parameters the group does not list: please report this as a bug"


@dataclass(frozen=True)
class RowLayout:
    """The map between a shard row of ``length`` elements (FSDP2's order) and the codec's row of
    ``wire_length``: ``parts`` are the ``(offset, real elements, padded elements)`` of the
    replicated and the TP-sharded part in the codec's row. The identity has one part and no
    index tensors."""

    length: int
    wire_length: int
    parts: tuple[tuple[int, int, int], ...]
    source: torch.Tensor | None = None  # int64 [wire_length]: the shard column of each codec column
    position: torch.Tensor | None = None  # int64 [length]: the codec column of each shard column

    @property
    def identity(self) -> bool:
        return self.source is None

    @classmethod
    def of(cls, spans: Spans | None, length: int, unit: int, device: torch.device | str = "cpu",
           mixed: bool = False) -> "RowLayout":
        """The layout of a row of ``length`` elements whose parameters are ``spans`` (``(elements,
        replicated)`` in row order, :func:`qsdp._fsdp2.shard_row_spans`), parts padded to
        multiples of ``unit``; the identity when the row does not mix the two kinds.
        ``mixed``: the group's parameters, those left out of ``spans`` included, mix the kinds.

        Spans that do not add up to ``length`` raise :class:`RowMismatch` where the identity
        could put replicated and TP-sharded values in one quantization group (so the TP ranks
        would round the replicated ones differently and train apart): spans that mix the kinds
        or come from a group that does, and spans holding fewer elements than the row (it holds
        values they do not describe)."""
        spans = list(spans or ())
        kinds = {rep for n, rep in spans if n}
        total = sum(n for n, _ in spans)
        if spans and total != length and (len(kinds) > 1 or mixed or total < length):
            raise RowMismatch(_mismatch(length, total))
        if len(kinds) < 2:
            return cls(length, length, ((0, length, length),))
        starts, at = [], 0
        for n, _ in spans:
            starts.append(at)
            at += n
        source, position = [], torch.empty(length, dtype=torch.int64)
        parts, offset = [], 0
        for kind in (True, False):
            cols = torch.cat([torch.arange(s, s + n) for s, (n, rep) in zip(starts, spans) if rep == kind and n])
            padded = _round_up(cols.numel(), unit)
            position[cols] = torch.arange(offset, offset + cols.numel())
            source += [cols, cols[-1:].expand(padded - cols.numel())]
            parts.append((offset, cols.numel(), padded))
            offset += padded
        return cls(length, offset, tuple(parts), torch.cat(source).to(device), position.to(device))

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[R, length]``) as the codec's rows ``[R, wire_length]`` (a new tensor; ``x``
        itself for the identity)."""
        return x if self.identity else x.index_select(1, self.source)

    def columns(self, x: torch.Tensor, rows: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Rows ``rows`` (int64) of ``x`` (``[R, length]``) at the codec's columns ``[a, b)``
        (clipped to ``length`` for the identity), one gather of that size."""
        if self.identity:
            return x[:, a:min(b, self.length)].index_select(0, rows)
        return x[rows.unsqueeze(1), self.source[a:b].unsqueeze(0)]

    def contract(self, y: torch.Tensor) -> torch.Tensor:
        """The codec's ``y`` (``[..., wire_length]`` or wider: padding past it is ignored) back in
        FSDP2's order, ``[..., length]``."""
        return y[..., : self.length] if self.identity else y.index_select(-1, self.position)

    def real_elements(self, a: int, b: int) -> int:
        """Columns of the codec's ``[a, b)`` that carry shard elements (not padding)."""
        return sum(max(0, min(b, off + real) - max(a, off)) for off, real, _ in self.parts)


@dataclass
class RowLayouts:
    """One comm's layouts: the spans of its FSDP group's row (all parameters for an all-gather,
    fixed when it is attached; for a reduce-scatter a function giving those that require a
    gradient now) and the layout of each (length, unit, device, spans) it has met, built once.
    ``mixed``: the group's parameters, frozen ones included, mix TP-replicated and TP-sharded."""

    spans: Spans | SpansOf | None = None
    mixed: bool = False
    _built: dict[tuple[int, int, str, tuple[tuple[int, bool], ...]], RowLayout] = field(default_factory=dict)

    def use(self, spans: Spans | SpansOf) -> None:
        """Lay rows out by ``spans`` (or by what ``spans()`` gives at each row)."""
        self.spans = spans if callable(spans) else list(spans)
        now = spans() if callable(spans) else spans
        self.mixed = self.mixed or len({rep for n, rep in now if n}) > 1

    def now(self) -> tuple[tuple[int, bool], ...]:
        """The spans as they are now (``spans()`` again where it is a function)."""
        return tuple(self.spans() if callable(self.spans) else self.spans or ())

    def plan_key(self) -> tuple:
        """What a plan built on these layouts must be keyed by beside its shapes: the spans now
        where the row mixes the kinds and they may change (a reduce-scatter's, read at each
        reduction: a part unfrozen later changes which parameters its row holds); else nothing,
        the layout being the identity whatever they are."""
        return self.now() if self.mixed and callable(self.spans) else ()

    def get(self, length: int, unit: int, device: torch.device) -> RowLayout:
        spans = self.now()
        key = (length, unit, str(device), spans)
        if key not in self._built:
            self._built[key] = RowLayout.of(spans, length, unit, device, mixed=self.mixed)
        return self._built[key]
