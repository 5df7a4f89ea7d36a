"""Hugging Face Accelerate with FSDP2: qsdp after ``accelerator.prepare``.

``prepare`` shards the auto-wrapped decoder layers, the embeddings, a grouped tail (final norm and
head, ``reshard_after_forward=False``) and the root, and remaps the optimizer's parameters by name.
``quantize_comms`` then covers every ``FSDPModule`` and replaces no ``Parameter``, so the
optimizer Accelerate built keeps training the same tensors.

    accelerate launch --num-processes 4 examples/recipes/accelerate_fsdp2.py --preset sdp4bit

Checkpoints: ``accelerator.save_state`` / ``load_state`` as usual. qsdp's comm state is per rank,
so it is not registered with ``register_for_checkpointing`` (Accelerate saves custom objects from
the main process only); after ``load_state`` the parameters' version counters show the load, and
the next all-gather re-sends exact values, so the replicas start from the loaded weights.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import qsdp


def fsdp2_plugin(layer_cls: str):
    """Accelerate's FSDP2 plugin: one FSDP group per ``layer_cls`` block, sharded checkpoints."""
    from accelerate import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[layer_cls],
        state_dict_type="SHARDED_STATE_DICT",
        reshard_after_forward=True,
    )


def prepare_with_qsdp(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, preset: str = "sdp4bit"):
    """``accelerator.prepare(model, optimizer)``, then qsdp on the prepared model.

    Returns ``(model, optimizer, handle)``; ``handle`` is the :class:`qsdp.QuantizedComms`.
    Raises ``ValueError`` before anything is prepared if Accelerate will not shard with FSDP2."""
    if not accelerator.is_fsdp2:
        raise ValueError(
            f"Accelerate is not set up for FSDP2 (distributed_type={accelerator.distributed_type}): pass "
            "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...)) and launch on "
            "an accelerator backend (Accelerate does not enable FSDP on CPU)"
        )
    model, optimizer = accelerator.prepare(model, optimizer)
    handle = qsdp.quantize_comms(model, preset)
    return model, optimizer, handle


def tiny_llama() -> nn.Module:
    """A two-layer Llama built from a config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def main() -> None:
    from accelerate import Accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="sdp4bit")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    accelerator = Accelerator(fsdp_plugin=fsdp2_plugin("LlamaDecoderLayer"))
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, _ = prepare_with_qsdp(accelerator, model, optimizer, args.preset)
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(accelerator.process_index))
    for step in range(args.steps):
        loss = model(ids[:, :-1], labels=ids[:, :-1]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if accelerator.is_main_process and step % 5 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
