"""The shape of a GPT and what follows from the shape alone: its parameter count and its training
FLOPs per token.

Plain arithmetic, no torch: :mod:`qsdp.train.model` builds its GPT from a :class:`GPTConfig`,
and the performance model (:mod:`qsdp.perfmodel`) prices one without building it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPT2_VOCAB", "GPTConfig", "n_params", "flops_per_token"]

GPT2_VOCAB = 50257  # GPT-2's BPE vocabulary


@dataclass
class GPTConfig:
    """Shape of a GPT.

    ``block_size`` is the longest sequence the position embedding covers; ``n_embd`` must be a
    multiple of ``n_head``. ``bias`` adds biases to the linear layers and layer norms.
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


def n_params(config: GPTConfig) -> int:
    """Number of parameters of ``GPT(config)``, computed from the shape alone (no allocation)."""
    C, L, V, T = config.n_embd, config.n_layer, config.vocab_size, config.block_size
    b = 1 if config.bias else 0
    ln = C + b * C
    per_block = (
        2 * ln  # ln_1, ln_2
        + C * 3 * C + b * 3 * C  # c_attn
        + C * C + b * C  # attn.c_proj
        + C * 4 * C + b * 4 * C  # mlp.c_fc
        + 4 * C * C + b * C  # mlp.c_proj
    )
    return V * C + T * C + L * per_block + ln + C * V  # wte, wpe, blocks, ln_f, lm_head


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token (forward + backward), the PaLM / nanoGPT estimate.

    ``6 * N + 12 * n_layer * n_embd * seq_len``: N counts the parameters that take part in a
    matmul (all but the two embedding tables, whose forward is a lookup; the untied lm_head is a
    real matmul and is counted), the second term is attention's QK^T and AV. ``seq_len`` defaults
    to ``block_size``.
    """
    T = config.block_size if seq_len is None else seq_len
    n_embedding = (config.vocab_size + config.block_size) * config.n_embd
    n_matmul = n_params(config) - n_embedding
    return 6 * n_matmul + 12 * config.n_layer * config.n_embd * T
