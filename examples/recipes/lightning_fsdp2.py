"""PyTorch Lightning ``ModelParallelStrategy`` (and Fabric) with FSDP2 on a Hugging Face causal LM:
qsdp at the end of ``configure_model`` / inside ``parallelize_fn``.

Lightning calls ``configure_model`` on a meta-device model, shards it there, then materialises it
(``to_empty`` + ``reset_parameters`` of every module that has one), builds the optimizers and
loads ``ckpt_path``. qsdp reads no parameter data when it is attached and builds its
weight-difference replicas at the first all-gather, so they start from the weights that training
really starts from.

``reset_parameters`` is not a Hugging Face model's initialisation, and some of its modules have
none (GPT-2's ``Conv1D``): their memory stays as ``to_empty`` left it and every loss is NaN. So
the weights are initialised again, with the model's own scheme, after materialisation and before
any checkpoint is loaded: in ``on_fit_start`` (Trainer), right after ``fabric.setup`` (Fabric).

    torchrun --standalone --nproc-per-node 4 examples/recipes/lightning_fsdp2.py --preset sdp4bit           # Trainer
    torchrun --standalone --nproc-per-node 4 examples/recipes/lightning_fsdp2.py --preset sdp4bit --fabric  # Fabric
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

import lightning as L
import qsdp

VOCAB = 64


def tiny_gpt2() -> GPT2LMHeadModel:
    """A two-layer GPT-2 built from a config (no download); ``lm_head`` tied to ``wte``."""
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return GPT2LMHeadModel(config)


def blocks(model: PreTrainedModel) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the model's ``_no_split_modules`` classes
    (``GPT2Block``, ``LlamaDecoderLayer``, ...), what Accelerate's auto-wrap picks too."""
    names = set(model._no_split_modules or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_with_qsdp(model: PreTrainedModel, mesh: DeviceMesh, preset: str) -> qsdp.QuantizedComms:
    """FSDP2 on the blocks and the root over ``mesh``'s data-parallel dimension, then qsdp."""
    dp = mesh["data_parallel"]
    for block in blocks(model):
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return qsdp.quantize_comms(model, preset, group=dp.get_group())


@torch.no_grad()
def init_weights(model: PreTrainedModel) -> None:
    """The model's own initialisation (``_init_weights``: normal(0, initializer_range) linear and
    ``Conv1D`` weights, unit norms, rotary buffers, ...) applied to the sharded parameters of a model
    materialised from the meta device. Call it after materialisation, before loading a checkpoint."""
    for module in model.modules():  # flags an earlier (meta-device) initialisation may have left
        module.__dict__.pop("_is_hf_initialized", None)
    model.init_weights()


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM under ``ModelParallelStrategy``: built on the meta device and
    sharded in ``configure_model``, initialised in ``on_fit_start``. ``self.qsdp`` keeps the
    :class:`qsdp.QuantizedComms` handle."""

    def __init__(self, build: Callable[[], PreTrainedModel] = tiny_gpt2, preset: str = "sdp4bit",
                 lr: float = 3e-3) -> None:
        super().__init__()
        self.build, self.preset, self.lr = build, preset, lr
        self.net: PreTrainedModel | None = None
        self.qsdp: qsdp.QuantizedComms | None = None

    def configure_model(self) -> None:
        if self.net is not None:  # Lightning may call this hook more than once
            return
        with torch.device("meta"):  # the strategy materialises it after sharding
            self.net = self.build()
        self.qsdp = shard_with_qsdp(self.net, self.device_mesh, self.preset)  # last line of the hook

    def on_fit_start(self) -> None:
        # After the strategy's to_empty + reset_parameters, before ckpt_path is loaded.
        init_weights(self.net)

    def training_step(self, ids: torch.Tensor, _) -> torch.Tensor:
        loss = self.net(input_ids=ids, labels=ids).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def tokens(rank: int, n: int = 4, length: int = 16) -> torch.Tensor:
    """``[n, length]`` int64 token ids, fixed per rank: a corpus small enough to memorise."""
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(rank))


class TokenData(torch.utils.data.IterableDataset):
    """``steps`` batches, each this rank's :func:`tokens`."""

    def __init__(self, steps: int, rank: int) -> None:
        self.steps, self.rank = steps, rank

    def __iter__(self):
        return (tokens(self.rank) for _ in range(self.steps))


class Parallelize:
    """Fabric's ``parallelize_fn``: shards and attaches qsdp, returns the module, and keeps the
    :class:`qsdp.QuantizedComms` in ``handle`` (``None`` until ``fabric.setup`` called it)."""

    def __init__(self, preset: str = "sdp4bit") -> None:
        self.preset = preset
        self.handle: qsdp.QuantizedComms | None = None

    def __call__(self, model: PreTrainedModel, device_mesh: DeviceMesh) -> PreTrainedModel:
        self.handle = shard_with_qsdp(model, device_mesh, self.preset)
        return model


def main(argv: list[str] | None = None) -> None:
    """The script: the tiny GPT-2 trained ``--steps`` steps with qsdp; rank 0 prints the final loss."""
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
    from lightning.pytorch.strategies import ModelParallelStrategy

    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--preset", default="sdp4bit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fabric", action="store_true")
    args = parser.parse_args(argv)
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.fabric:
        trainer = L.Trainer(accelerator=accelerator, devices=args.devices, max_steps=args.steps,
                            strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1))
        trainer.fit(CausalLM(preset=args.preset), TokenData(args.steps, trainer.global_rank))
        trainer.print(f"final loss {trainer.callback_metrics['loss'].item():.4f}")
        return

    parallelize = Parallelize(args.preset)  # parallelize.handle: the QuantizedComms, after fabric.setup
    strategy = FabricModelParallel(parallelize_fn=parallelize, data_parallel_size=args.devices, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator=accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):  # the meta device
        model = tiny_gpt2()
    model = fabric.setup(model)  # parallelize(model), then to_empty + reset_parameters
    init_weights(model.module)  # before fabric.load, if the run resumes
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    ids = tokens(fabric.global_rank)
    for step in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0:
            fabric.print(f"step {step:3d}  loss {loss.item():.4f}")
    fabric.print(f"final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
