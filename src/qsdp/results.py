"""A result file's provenance and writing, for every application that saves measurements
(``qsdp bench ...``, ``qsdp check``): what produced it (command, torch, device, host, date),
saved as JSON, printed as text or JSON. Below both, so neither imports the other for it."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any, Callable

import torch


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo`` where there is one)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return model


def host() -> str:
    """The machine a CPU timing depends on: its CPU, the cores this process may use and the
    vector instructions torch's CPU kernels use on it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_model()}, {cores} cores, {torch.backends.cpu.get_cpu_capability()}"


def meta(name: str, argv: list[str] | None, device: str, *, program: str | None = None,
         **extra: Any) -> dict[str, Any]:
    """The ``meta`` block of a result file: the command, torch version, device, host and date.
    The command is ``qsdp bench NAME ARGS`` unless ``program`` names what ran instead (e.g.
    ``python -m benchmarks.convergence``)."""
    args = argv if argv is not None else sys.argv[1:]
    return {"command": f"{program or 'qsdp bench ' + name} " + " ".join(args), "torch": torch.__version__,
            "device": device, "host": host(), "date": time.strftime("%Y-%m-%d"), **extra}


def emit(result: dict[str, Any], *, as_json: bool, save: str | None,
         format_text: Callable[[dict[str, Any]], str]) -> int:
    """Write ``result`` to ``save`` (JSON) if given, print it as one JSON object or as text."""
    if save:
        os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
        with open(save, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result) if as_json else format_text(result))
    return 0
