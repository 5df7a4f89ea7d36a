"""What every benchmark does with its result: say what produced it, save it, print it."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable


def meta(name: str, argv: list[str] | None, device: str, **extra: Any) -> dict[str, Any]:
    """The ``meta`` block of a result file: the command, torch version, device and date."""
    import torch

    args = argv if argv is not None else sys.argv[1:]
    return {"command": f"qsdp bench {name} " + " ".join(args), "torch": torch.__version__,
            "device": device, "date": time.strftime("%Y-%m-%d"), **extra}


def emit(result: dict[str, Any], *, as_json: bool, save: str | None,
         format_text: Callable[[dict[str, Any]], str]) -> int:
    """Write ``result`` to ``save`` (JSON) if given, print it as one JSON object or as text."""
    if save:
        os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
        with open(save, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result) if as_json else format_text(result))
    return 0
