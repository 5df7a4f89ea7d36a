"""Hugging Face ``Trainer`` with FSDP2: qsdp from a ``TrainerCallback``.

``on_train_begin`` runs after the Trainer has prepared the model through Accelerate (FSDP2
sharding) and after ``resume_from_checkpoint`` was loaded, and before the first forward: the
weight-difference replicas are then built by the first all-gather, from the loaded weights.

    accelerate launch --num-processes 4 examples/recipes/hf_trainer.py --preset sdp4bit
    torchrun --standalone --nproc-per-node 4 examples/recipes/hf_trainer.py    # CPU-only machine

FSDP needs both ``fsdp=True`` and ``fsdp_config={"version": 2, ...}`` (:func:`fsdp2_arguments`).
Accelerate turns FSDP on only for accelerator backends: on a CPU-only machine it drops the plugin
the Trainer built and the model would be wrapped in DDP. :class:`Fsdp2Trainer` puts the plugin
back (it is the plain ``Trainer`` wherever FSDP is already on). Needs ``accelerate_fsdp2.py``
beside it.
"""

from __future__ import annotations

import argparse

import torch
from transformers import Trainer, TrainerCallback

import qsdp
from accelerate_fsdp2 import restore_fsdp_plugin, tiny_llama


class Fsdp2Trainer(Trainer):
    """``Trainer`` that keeps FSDP on where Accelerate drops it for want of an accelerator
    (CPU processes): the FSDP2 plugin built from ``args.fsdp_config`` goes back into
    Accelerate's state before ``prepare``. Elsewhere it is the plain ``Trainer``."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.args.fsdp_plugin_args is not None and not self.is_fsdp_enabled:
            from accelerate import FullyShardedDataParallelPlugin

            restore_fsdp_plugin(self.accelerator, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None


class QsdpCallback(TrainerCallback):
    """Attach qsdp to the Trainer's FSDP2 model when training begins (once per process).
    ``handle`` keeps the :class:`qsdp.QuantizedComms` (``None`` before training begins)."""

    def __init__(self, preset: str = "sdp4bit", overrides: dict | None = None) -> None:
        self.preset = preset
        self.overrides = overrides
        self.handle: qsdp.QuantizedComms | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            name = type(model).__name__
            if (args.fsdp_plugin_args or {}).get("fsdp_version") != 2:
                raise ValueError(
                    f"the Trainer did not shard {name} with FSDP2: pass TrainingArguments(fsdp=True, "
                    "fsdp_config={'version': 2, ...}) (see fsdp2_arguments)"
                )
            raise ValueError(
                f"the Trainer did not shard {name} with FSDP2: Accelerate did not enable FSDP: no accelerator? "
                "Use Fsdp2Trainer, which restores the FSDP2 plugin Accelerate drops on a machine without one"
            )
        if self.handle is None:
            self.handle = qsdp.quantize_comms(model, self.preset, overrides=self.overrides)
        return control


def fsdp2_arguments(output_dir: str, **kwargs):
    """``TrainingArguments`` for FSDP2 (``fsdp=True`` and ``fsdp_config={"version": 2}``, both
    needed), one FSDP group per block of the model's ``_no_split_modules`` (``GPT2Block``,
    ``LlamaDecoderLayer``, ...), CPU processes where there is no accelerator."""
    from transformers import TrainingArguments

    kwargs.setdefault("use_cpu", not torch.accelerator.is_available())
    return TrainingArguments(
        output_dir=output_dir,
        fsdp=True,
        fsdp_config={"version": 2, "reshard_after_forward": True},
        report_to=[],
        **kwargs,
    )


class TokenDataset(torch.utils.data.Dataset):
    """``repeat`` copies of ``n`` fixed random token sequences (a stand-in for a tokenized corpus
    small enough to memorise in a few steps)."""

    def __init__(self, n: int = 8, length: int = 16, vocab: int = 64, repeat: int = 64) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))
        self.repeat = repeat

    def __len__(self) -> int:
        return len(self.ids) * self.repeat

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.ids[i % len(self.ids)]
        return {"input_ids": row, "labels": row}


def main(argv: list[str] | None = None) -> list[float]:
    """The script: the tiny Llama trained ``--steps`` steps with qsdp; returns the logged losses."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="sdp4bit")
    parser.add_argument("--output-dir", default="trainer_out")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    training = fsdp2_arguments(args.output_dir, max_steps=args.steps, per_device_train_batch_size=4,
                               learning_rate=3e-3, logging_steps=1, save_steps=10)
    qsdp_callback = QsdpCallback(args.preset)  # qsdp_callback.handle: the QuantizedComms, once training began
    trainer = Fsdp2Trainer(model=tiny_llama(), args=training, train_dataset=TokenDataset(),
                           callbacks=[qsdp_callback])
    trainer.train(resume_from_checkpoint=None)
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


if __name__ == "__main__":
    main()
