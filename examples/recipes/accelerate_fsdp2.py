"""Hugging Face Accelerate with FSDP2: qsdp after ``accelerator.prepare``.

``prepare`` shards the auto-wrapped decoder layers, the embeddings, a grouped tail (final norm and
head, ``reshard_after_forward=False``) and the root, and remaps the optimizer's parameters by name.
``quantize_comms`` then covers every ``FSDPModule`` and replaces no ``Parameter``, so the
optimizer Accelerate built keeps training the same tensors.

    accelerate launch --num-processes 4 examples/recipes/accelerate_fsdp2.py --preset sdp4bit
    torchrun --standalone --nproc-per-node 4 examples/recipes/accelerate_fsdp2.py    # CPU-only machine

Accelerate turns FSDP on only for accelerator backends: on a CPU-only machine its state stays
``MULTI_CPU``, the plugin is dropped and ``prepare`` wraps the model in DDP.
:func:`restore_fsdp_plugin` hands the state the plugin the way Accelerate does on GPUs (a no-op
where FSDP is already on), so the same script runs on CPU/gloo.

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


def fsdp2_plugin(layer_cls: str | None = None):
    """Accelerate's FSDP2 plugin: one FSDP group per ``layer_cls`` block (default: the model's
    ``_no_split_modules``, e.g. ``GPT2Block``, ``LlamaDecoderLayer``), sharded checkpoints."""
    from accelerate import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[layer_cls] if layer_cls else None,
        state_dict_type="SHARDED_STATE_DICT",
        reshard_after_forward=True,
    )


def restore_fsdp_plugin(accelerator, plugin) -> None:
    """Turn FSDP on where Accelerate left it off for want of an accelerator (CPU processes,
    ``distributed_type == MULTI_CPU``): set the state's plugin and distributed type as Accelerate
    does on GPUs, so ``prepare`` shards with FSDP2 instead of wrapping the model in DDP.
    Call it right after ``Accelerator(...)``; anywhere else (FSDP already on, one process) it does
    nothing."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    # Both shared states: Accelerator reads AcceleratorState, prepare's helpers PartialState.
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP


def prepare_with_qsdp(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, preset: str = "sdp4bit"):
    """``accelerator.prepare(model, optimizer)``, then qsdp on the prepared model.

    Returns ``(model, optimizer, handle)``; ``handle`` is the :class:`qsdp.QuantizedComms`.
    Raises ``ValueError`` before anything is prepared if Accelerate will not shard with FSDP2."""
    if not accelerator.is_fsdp2:
        raise ValueError(
            f"Accelerate is not set up for FSDP2 (distributed_type={accelerator.distributed_type}): pass "
            "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...)); on a machine without an "
            "accelerator, Accelerator(cpu=True, ...) and then restore_fsdp_plugin(accelerator, plugin), as Accelerate "
            "drops the plugin there"
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


def main(argv: list[str] | None = None) -> list[float]:
    """The script: the tiny Llama trained ``--steps`` steps with qsdp; returns this rank's losses."""
    from accelerate import Accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="sdp4bit")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)

    plugin = fsdp2_plugin()
    # cpu=True: a group of CPU processes (MULTI_CPU, gloo) where there is no accelerator
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=not torch.accelerator.is_available())
    restore_fsdp_plugin(accelerator, plugin)  # a CPU-only machine: Accelerate dropped the plugin
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # handle: the QuantizedComms (handle.comm_stats() for the bytes on the wire)
    model, optimizer, handle = prepare_with_qsdp(accelerator, model, optimizer, args.preset)
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(accelerator.process_index))
    losses = []
    for step in range(args.steps):
        loss = model(ids[:, :-1], labels=ids[:, :-1]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % 5 == 0 or step == args.steps - 1:
            accelerator.print(f"step {step:3d}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
