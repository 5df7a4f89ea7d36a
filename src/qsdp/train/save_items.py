"""What a save writes, a load reads: the non-tensor items of a checkpoint as plain data.

A load reads every non-tensor item with ``torch.load(weights_only=True)``
(:mod:`qsdp.train.plain_data`), which refuses anything but tensors, numbers, strings and
containers of them. A save that wrote such an item anyway would succeed, and every later load of
the run would fail. So before anything is written, each non-tensor item is either made plain
data or the save is refused naming it:

- a numpy scalar (``np.float64(5e-4)`` from a numpy learning-rate schedule) is stored as the
  Python number it equals (``float``, ``int``, ``bool``; a load gives that number back);
- anything else the restricted reader would refuse (an ``io.BytesIO`` a module keeps as extra
  state, an object of the user's class) makes the save fail in one line naming the item.

The test is the load's own: the item is pickled as DCP pickles it and read back with
``weights_only=True``. Only the few non-tensor items are pickled (param groups, counters).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from .plain_data import refusal_reason

__all__ = ["plain_items", "unsavable_item"]


def _numpy_scalar(value: Any) -> bool:
    # Without importing numpy (not a dependency): its scalars and 0-d arrays name their module.
    return type(value).__module__.split(".")[0] == "numpy" and getattr(value, "ndim", None) == 0 \
        and hasattr(value, "item")


def _plain(value: Any) -> Any:
    """``value`` with every numpy scalar inside it replaced by its Python number; the same
    object where there was none."""
    if _numpy_scalar(value):
        return value.item()
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [_plain(v) for v in value]
        if any(a is not b for a, b in zip(items, value)):
            return type(value)(items) if type(value) in (list, tuple) else items
        return value
    if isinstance(value, Mapping) and not isinstance(value, torch.Tensor):
        items = {k: _plain(v) for k, v in value.items()}
        if any(items[k] is not value[k] for k in value):
            return items
        return value
    return value


def plain_items(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with numpy scalars stored as Python numbers (new containers where one changed;
    the optimizer's and the model's own objects are never modified)."""
    return _plain(state)


def _leaves(tree: Any, path: str) -> Any:
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, list):  # pickled whole or item by item, each item is read back alike
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}.{i}")
    else:
        yield path, tree


def _refusal(value: Any) -> str | None:
    """Why ``torch.load(weights_only=True)`` would refuse ``value`` as DCP writes it, or ``None``."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:  # noqa: BLE001 - the value cannot be pickled at all: DCP would fail alike
        return f"it cannot be pickled: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except pickle.UnpicklingError as e:
        return refusal_reason(e)
    except Exception as e:  # noqa: BLE001 - whatever the restricted reader cannot read back
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def unsavable_item(state: dict[str, Any]) -> str | None:
    """The first non-tensor item of ``state`` (after :func:`plain_items`) that a load could not
    read back, as one line naming it and why; ``None`` when every item is plain data."""
    for path, value in _leaves(state, ""):
        if isinstance(value, torch.Tensor):
            continue
        why = _refusal(value)
        if why is not None:
            return (f"item {path} is a {type(value).__module__}.{type(value).__qualname__}, which a load reads only as "
                    f"plain data (torch.load(weights_only=True) refuses it: {why}); store it as a number, string, "
                    "tensor or container of them")
    return None
