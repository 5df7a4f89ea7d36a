"""Hugging Face ``Trainer`` with FSDP2: qsdp from a ``TrainerCallback``.

``on_train_begin`` runs after the Trainer has prepared the model through Accelerate (FSDP2
sharding) and after ``resume_from_checkpoint`` was loaded, and before the first forward: the
weight-difference replicas are then built by the first all-gather, from the loaded weights.

    accelerate launch --num-processes 4 examples/recipes/hf_trainer.py --preset sdp4bit
"""

from __future__ import annotations

import argparse

import torch
from transformers import TrainerCallback

import qsdp


class QsdpCallback(TrainerCallback):
    """Attach qsdp to the Trainer's FSDP2 model when training begins (once per process)."""

    def __init__(self, preset: str = "sdp4bit", overrides: dict | None = None) -> None:
        self.preset = preset
        self.overrides = overrides
        self.handle: qsdp.QuantizedComms | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            raise ValueError(
                f"the Trainer did not shard {type(model).__name__} with FSDP2: pass "
                "TrainingArguments(fsdp=True, fsdp_config={'version': 2, ...}) (see fsdp2_arguments)"
            )
        if self.handle is None:
            self.handle = qsdp.quantize_comms(model, self.preset, overrides=self.overrides)
        return control


def fsdp2_arguments(output_dir: str, **kwargs):
    """``TrainingArguments`` for FSDP2 with one FSDP group per Llama decoder layer."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "reshard_after_forward": True},
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


def main() -> None:
    from transformers import Trainer

    from accelerate_fsdp2 import tiny_llama

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="sdp4bit")
    parser.add_argument("--output-dir", default="trainer_out")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    training = fsdp2_arguments(args.output_dir, max_steps=args.steps, per_device_train_batch_size=4,
                               learning_rate=3e-3, logging_steps=5, save_steps=10)
    trainer = Trainer(model=tiny_llama(), args=training, train_dataset=TokenDataset(),
                      callbacks=[QsdpCallback(args.preset)])
    trainer.train(resume_from_checkpoint=None)


if __name__ == "__main__":
    main()
