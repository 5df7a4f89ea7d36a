"""A training job as the performance model sees it: the GPT's shape, the parallelism, the tokens
per step, and the per-rank shards of its data-parallel groups."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from ..gpt_shape import GPT2_VOCAB, GPTConfig, n_params

SEQ_LEN = 2048
MICRO_BATCH = 1
MICRO_BATCHES = 1

# GPT-3 family shapes by name (those of the SDP4Bit authors' Megatron-LM speed scripts).
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "1.3B": dict(n_layer=24, n_embd=2048, n_head=16),
    "2.7B": dict(n_layer=32, n_embd=2560, n_head=32),
    "6.7B": dict(n_layer=32, n_embd=4096, n_head=32),
    "13B": dict(n_layer=40, n_embd=5120, n_head=40),
    "18B": dict(n_layer=40, n_embd=6144, n_head=48),
}
# (parameters, layers) of the GPT-3 family: a model of N parameters gets the depth of the
# nearest size and the width that gives N.
_DEPTHS = ((125e6, 12), (350e6, 24), (1.3e9, 24), (2.7e9, 32), (6.7e9, 32), (13e9, 40),
           (30e9, 48), (65e9, 80), (175e9, 96))


@dataclass(frozen=True)
class Setup:
    """A training job: model shape, parallelism, tokens per step, and how its data-parallel
    groups sit in the nodes. ``model`` names a shape of :data:`MODEL_SHAPES`, built as Megatron
    does (vocabulary padded to ``128 * tp``)."""

    model: str
    gpu: str
    gpus: int
    tp: int
    pp: int
    seq_len: int = SEQ_LEN
    micro_batch: int = MICRO_BATCH
    micro_batches: int = MICRO_BATCHES
    layout: str = "flat"
    zero3: bool = False

    def gpt(self) -> GPTConfig:
        unit = 128 * self.tp  # Megatron pads the vocabulary to a multiple of 128 * TP
        vocab = -(-GPT2_VOCAB // unit) * unit
        return GPTConfig(vocab_size=vocab, block_size=self.seq_len, **MODEL_SHAPES[self.model])

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def dp_topology(self, gpus_per_node: int) -> tuple[int, int]:
        """(nodes, ranks per node) of one data-parallel group: Megatron orders ranks TP first,
        then DP, then PP, so a node holds ``G / TP`` consecutive ranks of a DP group."""
        m = max(1, min(self.dp, gpus_per_node // self.tp))
        return self.dp // m, m


@dataclass(frozen=True)
class ShapeSetup(Setup):
    """A data-parallel FSDP2 job (no tensor or pipeline parallelism) of a given GPT shape."""

    n_layer: int = 24
    n_embd: int = 2048
    n_head: int = 16
    vocab_size: int = GPT2_VOCAB

    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.seq_len, n_layer=self.n_layer,
                         n_embd=self.n_embd, n_head=self.n_head)


def fsdp2_setup(gpu: str, nodes: int, ranks_per_node: int, shape: Mapping[str, int], *, seq_len: int = SEQ_LEN,
                micro_batch: int = MICRO_BATCH) -> ShapeSetup:
    """A data-parallel FSDP2 job as ``qsdp advise`` prices it: a GPT of ``shape`` (``n_layer``,
    ``n_embd``, ``n_head``, optional ``vocab_size``) in one group per block and one for the rest,
    its weights gathered before forward and again before backward, on ``nodes`` x
    ``ranks_per_node`` GPUs of type ``gpu``, ``micro_batch`` sequences of ``seq_len`` each."""
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"nodes={nodes} and ranks_per_node={ranks_per_node} must be positive")
    return ShapeSetup("custom", gpu, nodes * ranks_per_node, 1, 1, seq_len=seq_len, micro_batch=micro_batch,
                      layout="layer", zero3=True, **shape)


def gpt_shape(params: int) -> dict[str, int]:
    """A GPT shape of about ``params`` parameters (embeddings included): the depth of the
    nearest GPT-3 size, the width (a multiple of 128, 128 per head) whose count is closest."""
    n_layer = min(_DEPTHS, key=lambda d: abs(math.log(d[0] / params)))[1]
    guess = max(1, round(math.sqrt(params / (12 * n_layer)) / 128))

    def count(units: int) -> int:
        return n_params(GPTConfig(vocab_size=GPT2_VOCAB, block_size=SEQ_LEN, n_layer=n_layer,
                                  n_embd=128 * units, n_head=units))

    units = min(range(max(1, guess - 3), guess + 4), key=lambda u: abs(count(u) - params))
    return {"n_layer": n_layer, "n_embd": 128 * units, "n_head": units}


def model_params(cfg: GPTConfig) -> int:
    """Parameters of the Megatron GPT (token embedding tied with the output layer)."""
    return n_params(cfg) - cfg.vocab_size * cfg.n_embd


def shard_sizes(setup: Setup) -> list[int]:
    """Per-rank shard sizes of the data-parallel buffers of one model-parallel rank: ``flat`` is
    Megatron's distributed optimizer (one buffer padded to the DP size); ``layer`` is FSDP2 with
    one group per transformer block and one for the rest. Model-parallel ranks are taken to
    hold ``1 / (TP * PP)`` of the parameters each."""
    cfg = setup.gpt()
    mp, dp = setup.tp * setup.pp, setup.dp
    total = model_params(cfg)
    if setup.layout == "flat":
        return [-(-(-(-total // mp)) // dp)]
    if setup.layout != "layer":
        raise ValueError(f"layout={setup.layout!r}; allowed: flat, layer")
    C = cfg.n_embd
    block = 12 * C * C + 13 * C  # n_params' per-block count with biases
    rest = total - cfg.n_layer * block
    blocks = -(-cfg.n_layer // setup.pp)
    per_block = -(-(-(-block // setup.tp)) // dp)
    return [-(-(-(-rest // mp)) // dp)] + [per_block] * blocks
