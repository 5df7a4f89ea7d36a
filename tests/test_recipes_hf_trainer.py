"""The Hugging Face Trainer recipe (examples/recipes/hf_trainer.py): ``QsdpCallback`` attaches qsdp
in ``on_train_begin`` to the Trainer's FSDP2 model, after ``resume_from_checkpoint`` was loaded.

The Trainer enables FSDP through Accelerate, which does so only on accelerator backends: on a
CPU-only machine the recipe's ``Fsdp2Trainer`` hands Accelerate's state the FSDP2 plugin the Trainer
built from its own ``fsdp_config`` (what Accelerate does on GPUs). Everything else is the Trainer's:
``accelerator.prepare``, the training loop, FSDP checkpoints and resume.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from distributed import on_one_rank_nodes, run_world

pytest.importorskip("transformers", reason="needs the optional 'accelerate' extra: pip install -e '.[accelerate]'")
pytest.importorskip("accelerate", reason="needs the optional 'accelerate' extra: pip install -e '.[accelerate]'")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "recipes"))
import hf_trainer as recipe  # noqa: E402
from accelerate_fsdp2 import tiny_llama  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _trainer(out: str, init_seed: int, callbacks: list, steps: int = 6, trainer_cls=recipe.Fsdp2Trainer):
    args = recipe.fsdp2_arguments(out, max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2,
                                  logging_steps=1, save_steps=3, disable_tqdm=True, seed=0)
    torch.manual_seed(init_seed)
    return trainer_cls(model=tiny_llama(), args=args, train_dataset=recipe.TokenDataset(), callbacks=callbacks)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _train(rank, world, out):
    qsdp_cb = recipe.QsdpCallback("sdp4bit")
    trainer = _trainer(out, init_seed=0, callbacks=[qsdp_cb])
    trainer.train()
    return _losses(trainer), [ag.gathers for ag in qsdp_cb.handle.all_gathers]


def test_the_trainer_trains_with_sdp4bit_attached_at_train_begin(tmp_path):
    for losses, gathers in run_world(on_one_rank_nodes(_train), 2, str(tmp_path / "out")):
        # one FSDP group per decoder layer (auto-wrapped) and the root, all through qsdp
        assert len([g for g in gathers if g > 0]) >= 3
        assert losses[-1] < 0.9 * losses[0]


class _FirstGatheredWeight:
    """Records the unsharded ``layers[0].mlp.gate_proj.weight`` the first forward sees."""

    def __init__(self):
        from transformers import TrainerCallback

        probe = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                linear = model.model.layers[0].mlp.gate_proj
                probe.handle = linear.register_forward_pre_hook(probe.record)

            def on_save(self, args, state, control, model=None, **kwargs):
                probe.saved[state.global_step] = model.model.layers[0].mlp.gate_proj.weight.full_tensor()

        self.callback = Callback()
        self.first: torch.Tensor | None = None
        self.saved: dict[int, torch.Tensor] = {}

    def record(self, module, inputs):
        if self.first is None:
            self.first = module.weight.detach().clone()


def _resume(rank, world, out):
    probe = _FirstGatheredWeight()
    trainer = _trainer(out, init_seed=0, callbacks=[recipe.QsdpCallback("sdp4bit"), probe.callback])
    trainer.train()
    saved_at_3, uninterrupted = probe.saved[3], _losses(trainer)

    resumed_probe = _FirstGatheredWeight()
    qsdp_cb = recipe.QsdpCallback("sdp4bit")
    # another seed: the initial weights differ, only the checkpoint can make them equal
    resumed = _trainer(out, init_seed=1, callbacks=[qsdp_cb, resumed_probe.callback])
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    # the resumed history starts with the checkpoint's three logged steps
    return torch.equal(resumed_probe.first, saved_at_3), uninterrupted[3:], _losses(resumed)[3:]


def test_after_resume_from_checkpoint_the_first_gather_sends_the_loaded_weights(tmp_path):
    for exact, uninterrupted, resumed in run_world(_resume, 2, str(tmp_path / "out")):
        assert exact, "the first forward after the resume must see the checkpoint's weights bit for bit"
        # the resumed run starts from exact replicas, the uninterrupted one from 4-bit ones
        assert resumed == pytest.approx(uninterrupted, rel=2e-2)


def _without_fsdp(rank, world, out):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(out, max_steps=1, use_cpu=True, report_to=[], disable_tqdm=True)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=recipe.TokenDataset(),
                      callbacks=[recipe.QsdpCallback("sdp4bit")])
    with pytest.raises(ValueError, match="did not shard LlamaForCausalLM with FSDP2") as err:
        trainer.train()
    return str(err.value)


def test_a_trainer_without_fsdp2_is_rejected_at_train_begin(tmp_path):
    assert "fsdp=True" in run_world(_without_fsdp, 1, str(tmp_path))[0]


def _plain_trainer_on_cpu(rank, world, out):
    from transformers import Trainer

    trainer = _trainer(out, init_seed=0, callbacks=[recipe.QsdpCallback("sdp4bit")], trainer_cls=Trainer)
    with pytest.raises(ValueError, match="Accelerate did not enable FSDP: no accelerator") as from_callback:
        trainer.train()
    # what a callback of one's own that calls quantize_comms directly meets
    with pytest.raises(ValueError, match="Accelerate did not enable FSDP: no accelerator") as from_qsdp:
        recipe.qsdp.quantize_comms(trainer.model, "sdp4bit")
    return str(from_callback.value), str(from_qsdp.value)


def test_the_plain_trainer_on_cpu_is_told_that_accelerate_dropped_fsdp(tmp_path):
    for from_callback, from_qsdp in run_world(_plain_trainer_on_cpu, 2, str(tmp_path)):
        assert "Fsdp2Trainer" in from_callback
        assert "no FSDP2 module under LlamaForCausalLM" in from_qsdp and "docs/recipes.md" in from_qsdp


def _script(rank, world, out):
    return recipe.main(["--steps", "6", "--output-dir", out])


def test_the_recipe_script_trains_on_cpu_as_written(tmp_path):
    # main() is the script: fsdp2_arguments, Fsdp2Trainer, QsdpCallback, trainer.train()
    for losses in run_world(_script, 2, str(tmp_path / "out")):
        assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
        assert max(losses[-3:]) < losses[0]  # learning, at the script's lr decaying to 0 over 6 steps
