"""The model a check measures, its FSDP groups, and its language-model loss.

A model is named in one of three ways:

* a built-in GPT size (a key of :data:`qsdp.train.model.MODEL_SIZES`), with the vocabulary of
  :func:`qsdp.train.model.default_vocab` (GPT-2's for the ``gpt2-*`` sizes, an untied head: ``gpt2-125m``
  has 162M parameters; the byte tokens use its first 256 ids), else the byte vocabulary;
* a Hugging Face config JSON (a local file with a ``model_type``), built randomly initialised
  with ``AutoModelForCausalLM.from_config`` (nothing is downloaded);
* ``module:function`` (``package.module:function``, imported from the current directory as
  ``python -m`` would, or ``path/to/file.py:function``): a function called without arguments that returns an ``nn.Module`` mapping token ids ``[B, T]``
  (int64) to logits ``[B, T, V]`` (or a tuple, or an output with ``.logits``, holding them).

The FSDP groups are those of the usual ``fully_shard`` recipe: one per transformer block (the
elements of the model's largest ``nn.ModuleList``), then the root holding everything else. The
root comes first, as in :func:`qsdp.quantize_comms`' numbering of the groups.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..extras import missing
from ..train.model import GPT, MODEL_SIZES, default_vocab, make_gpt


class ModelError(ValueError):
    """A model that cannot be built or checked; the message names it and the problem."""


@dataclass
class Group:
    """One FSDP parameter group: its name and its trainable parameters, in module order."""

    name: str
    params: list[nn.Parameter]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def build_model(spec: str, *, vocab_size: int, seq_len: int, seed: int) -> nn.Module:
    """The model ``spec`` names (see the module doc), initialised from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    if spec in MODEL_SIZES:
        return make_gpt(spec, max(vocab_size, default_vocab(spec)), seq_len)
    if spec.endswith(".json"):
        return _hf_model(spec, vocab_size, seq_len)
    if ":" in spec:
        return _factory_model(spec)
    raise ModelError(f"unknown model {spec!r}; expected a GPT size ({', '.join(MODEL_SIZES)}), "
                     "a Hugging Face config .json or module:function")


def _hf_model(path: str, vocab_size: int, seq_len: int) -> nn.Module:
    if not os.path.isfile(path):
        raise ModelError(f"model config {path!r} does not exist")
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"model config {path!r} is not readable JSON: {e}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ModelError(f"model config {path!r} has no model_type: not a Hugging Face config")
    problem = missing("transformers", "a Hugging Face config")
    if problem:
        raise ModelError(problem)
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = dict(fields)
    try:
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    except ValueError as e:
        raise ModelError(f"model config {path!r}: {e}") from None
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab < vocab_size:
        raise ModelError(f"model config {path!r} has vocab_size={vocab}; the byte tokenizer needs at least {vocab_size}")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and positions < seq_len:
        raise ModelError(f"model config {path!r} covers {positions} positions, fewer than --seq-len {seq_len}")
    return AutoModelForCausalLM.from_config(config)


def _factory_model(spec: str) -> nn.Module:
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise ModelError(f"model factory file {where!r} does not exist")
            module_spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = _import_from_here(where)
    except ImportError as e:
        raise ModelError(f"cannot import {where!r} for model {spec!r} (from the current directory or "
                         f"sys.path): {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ModelError(f"{where!r} has no function {name!r} (model {spec!r})")
    model = factory()
    if not isinstance(model, nn.Module):
        raise ModelError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _import_from_here(name: str):
    """Import ``name`` as ``python -m`` would: the current directory first on the import path
    (a console script's path starts at its own directory instead)."""
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(here)


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The transformer blocks: ``GPT.blocks``, else the ``nn.ModuleList`` holding the most
    parameters (a Hugging Face model's ``layers`` or ``h``); ``None`` without one."""
    if isinstance(model, GPT):
        return "blocks", model.blocks
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return None
    return max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))


def fsdp_groups(model: nn.Module) -> list[Group]:
    """The root group (everything outside the blocks), then one group per block."""
    found = block_list(model)
    blocks = [] if found is None else [(f"{found[0]}.{i}", b) for i, b in enumerate(found[1])]
    in_blocks = {id(p) for _, b in blocks for p in b.parameters()}
    trainable = lambda ps: [p for p in ps if p.requires_grad]  # noqa: E731
    root = Group("root", trainable(p for p in model.parameters() if id(p) not in in_blocks))
    groups = [root] + [Group(name, trainable(b.parameters())) for name, b in blocks]
    return [g for g in groups if g.params]


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of ``model`` on ids ``x`` with targets ``y`` (``[B, T]``)."""
    if isinstance(model, GPT):
        return model(x, y)[1]
    out = model(x)
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(logits, torch.Tensor) or logits.shape[:2] != x.shape:
        raise ModelError(f"the model's output is not logits of shape [B, T, V] for ids {tuple(x.shape)}")
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
