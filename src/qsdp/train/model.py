"""A GPT language model (decoder-only transformer) in one readable file.

Follows nanoGPT's ``model.py`` with two deliberate differences:

- The token embedding and the output head are separate parameters (no weight tying). FSDP2 shards
  each transformer block and then the root; a parameter shared by the root's embedding and head
  is a known source of sharding and checkpointing pitfalls, and costs nothing here but memory.
- The blocks live in ``GPT.blocks`` (an ``nn.ModuleList``) so a caller can
  ``fully_shard(block)`` for each of them and then ``fully_shard(model)``.

Sizes are named in ``MODEL_SIZES`` and built with ``make_gpt``. The shape (``GPTConfig``) and what
follows from it alone (``n_params``, ``flops_per_token``: the PaLM/nanoGPT estimate of training
FLOPs that the throughput numbers and the performance model use) live in :mod:`qsdp.gpt_shape`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gpt_shape import GPT2_VOCAB, GPTConfig, flops_per_token, n_params

__all__ = [
    "GPTConfig",
    "GPT",
    "MODEL_SIZES",
    "make_gpt",
    "count_params",
    "n_params",
    "flops_per_token",
    "make_hf_gpt2",
    "transformer_blocks",
]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (fused SDPA kernel)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # One projection for q, k and v: one matmul instead of three.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, C] float -> [B, T, C]."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # [B, T, C] -> [B, n_head, T, head_dim]
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide, GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, C] float -> [B, T, C]."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, C] float -> [B, T, C]."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Parameters are drawn from the global torch generator, so ``torch.manual_seed(s)`` followed by
    ``GPT(config)`` gives the same weights every time (on every rank).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth (two residual additions per block).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits and, given targets, the mean cross-entropy loss.

        idx: [B, T] int64 token ids, T <= block_size. targets: [B, T] int64 or None; a target of -1
        is ignored. Returns (logits [B, T, vocab_size] float, loss: 0-dim float tensor or None).
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds the model's block_size {self.config.block_size}"
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        # Loss in fp32 even when the model computes in bf16: the softmax over a large vocabulary
        # is where low precision hurts.
        loss = F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
        )
        return logits, loss


# Named sizes: the GPT-2 family plus a tiny model for CPU tests and demos and a small one
# (several million parameters) for convergence runs long enough to flatten on a CPU.
MODEL_SIZES: dict[str, dict] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128),
    "small": dict(n_layer=6, n_head=4, n_embd=256),
    "gpt2-125m": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-1.3b": dict(n_layer=24, n_head=32, n_embd=2048),
}


def default_vocab(model_name: str) -> int:
    """The vocabulary a named size is built with where no tokenizer fixes it (benchmarks on random
    tokens, ``qsdp check``): GPT-2's 50257 for the ``gpt2-*`` sizes (their published parameter
    counts include it), else 256 (bytes)."""
    return GPT2_VOCAB if model_name.startswith("gpt2") else 256


def make_gpt(name: str, vocab_size: int, block_size: int) -> GPT:
    """Build the GPT of the named size (a key of ``MODEL_SIZES``) on the current device.

    Raises ValueError for an unknown name, listing the allowed ones.
    """
    if name not in MODEL_SIZES:
        raise ValueError(
            f"unknown model size {name!r}; allowed: {', '.join(sorted(MODEL_SIZES))}"
        )
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, **MODEL_SIZES[name]))


def count_params(model: nn.Module) -> int:
    """Number of parameter elements of ``model`` (global sizes, also when sharded by FSDP2)."""
    # A DTensor's numel() is the global one, so this is the same before and after fully_shard.
    return sum(p.numel() for p in model.parameters())


def make_hf_gpt2(
    vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int
) -> nn.Module:
    """A Hugging Face ``GPT2LMHeadModel`` of the given shape, randomly initialised (no download).

    Embedding and head are untied, as in ``GPT``. Needs ``transformers`` (``pip install
    qsdp[hf]``); its forward is HF's (``model(input_ids, labels=...)``), not ``GPT.forward``.
    """
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise ImportError(
            "make_hf_gpt2 needs the Hugging Face transformers package: pip install 'qsdp[hf]'"
        ) from e
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
    )
    return GPT2LMHeadModel(config)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The per-block modules to ``fully_shard`` one by one before the root.

    Works for ``GPT`` (``model.blocks``) and Hugging Face GPT-2 (``model.transformer.h``);
    raises TypeError for any other model.
    """
    if isinstance(model, GPT):
        return list(model.blocks)
    h = getattr(getattr(model, "transformer", None), "h", None)
    if isinstance(h, nn.ModuleList):
        return list(h)
    raise TypeError(
        f"don't know the transformer blocks of {type(model).__name__}: expected a qsdp GPT "
        "(model.blocks) or a Hugging Face GPT-2 (model.transformer.h)"
    )
