"""Optional packages: which extra installs each, and the one-line error when one is missing.

The library (codecs, collectives, :func:`qsdp.quantize_comms`, the presets) needs torch and numpy
alone (and xxhash for fast checkpoint digests: :mod:`qsdp.train.block_digest`, SHA-256 without
it). The applications' packages come with extras:

* ``qsdp[train]``: ``chitchat-dataset`` (the embedded default corpus), ``tokenizers`` (the BPE
  tokenizer), ``matplotlib`` (loss plots, benchmark charts), ``tqdm`` (the progress bar);
* ``qsdp[bench]``: ``train`` plus ``pyroute2`` (the cluster benchmark's network namespaces).
* ``qsdp[hf]``: ``transformers`` (Hugging Face models, e.g. ``qsdp check`` on a config JSON).

Each optional package is imported only where it is used; a command that needs a missing one
stops before any work with :class:`MissingExtraError`, whose message is one line naming what
needs it and the extra to install.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRA_OF", "MissingExtraError", "missing", "require"]

# Import name -> (distribution name, extra that installs it).
EXTRA_OF: dict[str, tuple[str, str]] = {
    "chitchat_dataset": ("chitchat-dataset", "train"),
    "tokenizers": ("tokenizers", "train"),
    "matplotlib": ("matplotlib", "train"),
    "tqdm": ("tqdm", "train"),
    "pyroute2": ("pyroute2", "bench"),
    "transformers": ("transformers", "hf"),
}


class MissingExtraError(ImportError):
    """An optional package a command needs is not installed (the message names the extra)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, a broken entry
        return False


def missing(module: str, needed_for: str, alternative: str = "") -> str | None:
    """``None`` when ``module`` can be imported, else the one-line message: ``needed_for`` needs
    the package, the ``pip install 'qsdp[EXTRA]'`` that brings it, and ``alternative`` (e.g.
    ``"or pass --data FILE.txt"``) when given. ``module`` must be a key of :data:`EXTRA_OF`."""
    if _installed(module):
        return None
    package, extra = EXTRA_OF[module]
    tail = f" ({alternative})" if alternative else ""
    return f"{needed_for} needs the Python package {package}: pip install 'qsdp[{extra}]'{tail}"


def require(module: str, needed_for: str, alternative: str = "") -> None:
    """Raise :class:`MissingExtraError` with :func:`missing`'s message if ``module`` is missing."""
    message = missing(module, needed_for, alternative)
    if message is not None:
        raise MissingExtraError(message)
