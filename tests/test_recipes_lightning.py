"""The Lightning recipe (examples/recipes/lightning_fsdp2.py) on a Hugging Face GPT-2: qsdp at the end
of ``configure_model`` under ``ModelParallelStrategy``, and in Fabric's ``parallelize_fn``; the
weights initialised after Lightning materialised the meta-device model. Lightning runs on CPU/gloo
as it is: the forked ranks look like a torchelastic launch, so Lightning uses them instead of
spawning its own processes.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys

import pytest
import torch

from distributed import on_one_rank_nodes, run_world
from scripts import run_script

pytest.importorskip("lightning", reason="needs the optional 'lightning' extra: pip install -e '.[lightning]'")
pytest.importorskip("transformers", reason="needs the optional 'lightning' extra: pip install -e '.[lightning]'")
RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "recipes")
sys.path.insert(0, RECIPES)
import lightning_fsdp2 as recipe  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _as_torchelastic() -> None:
    os.environ.update(GROUP_RANK="0", TORCHELASTIC_RUN_ID="qsdp-test")


def _initialised(model) -> dict[str, bool]:
    """Whether ``model``'s weights are GPT-2's initialisation: unit layer norms, and the
    ``Conv1D`` weights (which have no ``reset_parameters``) drawn with std 0.02 or less."""
    norms = [m.weight.full_tensor() for m in model.modules() if type(m).__name__ == "LayerNorm"]
    conv = [m.weight.full_tensor() for m in model.modules() if type(m).__name__ == "Conv1D"]
    return dict(
        finite=all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters()),
        unit_norms=all(bool((w == 1).all()) for w in norms),
        conv_std=all(0.005 < float(w.std()) < 0.025 for w in conv),
        tied=model.lm_head.weight is model.transformer.wte.weight,
    )


class _Probe(recipe.CausalLM):
    """The recipe's module, recording what the tests check: whether ``configure_model`` ran on the
    meta device, the weights when training starts, the losses, and the unsharded
    ``transformer.h[0].mlp.c_fc.weight`` the first forward sees."""

    def __init__(self, preset: str = "sdp4bit") -> None:
        super().__init__(preset=preset, lr=1e-2)
        self.built_on_meta: bool | None = None
        self.at_start: dict[str, bool] = {}
        self.losses: list[float] = []
        self.first: torch.Tensor | None = None

    def configure_model(self) -> None:
        super().configure_model()
        if self.built_on_meta is None:
            self.built_on_meta = next(self.net.parameters()).is_meta

    def on_train_start(self) -> None:
        self.at_start = _initialised(self.net)

        def record(module, inputs):
            if self.first is None:
                self.first = module.weight.detach().clone()

        self.net.transformer.h[0].mlp.c_fc.register_forward_pre_hook(record)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def _trainer(world: int, steps: int, root: str):
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    return L.Trainer(
        accelerator="cpu", devices=world, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=root,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
    )


def _fit(rank, world, root, preset):
    _as_torchelastic()
    torch.manual_seed(0)
    module = _Probe(preset)
    _trainer(world, 8, root).fit(module, recipe.TokenData(8, rank))
    carried = module.qsdp.comm_stats()["weights"]["total"]["elements"]
    return module.built_on_meta, module.at_start, module.losses, carried


@pytest.mark.parametrize("preset", ["sdp4bit", "fsdp"])
def test_model_parallel_strategy_trains_a_meta_built_hf_model_initialised_after_materialisation(preset, tmp_path):
    for on_meta, at_start, losses, carried in run_world(_fit, 2, str(tmp_path), preset):
        assert on_meta, "ModelParallelStrategy builds the model on the meta device"
        assert at_start == dict(finite=True, unit_norms=True, conv_std=True, tied=True)
        assert carried > 0, "the weights travelled through qsdp's all-gathers"
        assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
        assert losses[-1] < 0.8 * losses[0]


def _resume(rank, world, root):
    _as_torchelastic()
    ckpt = os.path.join(root, "step3.ckpt")
    torch.manual_seed(0)
    first = _Probe()
    trainer = _trainer(world, 3, root)
    trainer.fit(first, recipe.TokenData(3, rank))
    trainer.save_checkpoint(ckpt)
    saved = first.net.transformer.h[0].mlp.c_fc.weight.full_tensor()

    torch.manual_seed(1)  # other initial weights: only the checkpoint can make them equal
    resumed = _Probe()
    _trainer(world, 6, root).fit(resumed, recipe.TokenData(6, rank), ckpt_path=ckpt)
    return torch.equal(resumed.first, saved), len(resumed.losses)


def test_after_fit_from_ckpt_path_the_first_gather_sends_the_loaded_weights(tmp_path):
    # on_fit_start initialises the weights; the checkpoint loaded after it must win
    for exact, steps in run_world(_resume, 2, str(tmp_path)):
        assert exact, "the first forward after the resume must see the checkpoint's weights bit for bit"
        assert steps == 3


def _fabric(rank, world, root):
    _as_torchelastic()
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    parallelize = recipe.Parallelize("sdp4bit")
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=world, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = recipe.tiny_gpt2()
    model = fabric.setup(model)
    recipe.init_weights(model.module)
    at_start = _initialised(model.module)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = recipe.tokens(rank)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    losses = [step() for _ in range(8)]
    path = os.path.join(root, "fabric.ckpt")
    state = {"model": model, "optimizer": optimizer}
    fabric.save(path, state)
    saved = get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True))
    losses += [step() for _ in range(2)]  # the replicas move on past the checkpoint
    fabric.load(path, state)
    reference = recipe.tiny_gpt2()
    reference.load_state_dict(saved)
    model.eval()  # no dropout
    reference.eval()
    with torch.no_grad():
        got = model(input_ids=ids).logits
        expected = reference(input_ids=ids).logits
    resent = [ag.exact_resends for ag in parallelize.handle.all_gathers if ag.gathers > 0]
    return at_start, losses, (got - expected).abs().max().item(), resent


def test_fabric_parallelize_fn_trains_an_hf_model_and_resumes_from_its_checkpoint(tmp_path):
    for at_start, losses, err, resent in run_world(on_one_rank_nodes(_fabric), 2, str(tmp_path)):
        assert at_start == dict(finite=True, unit_norms=True, conv_std=True, tied=True)
        assert all(math.isfinite(x) for x in losses)
        assert losses[7] < 0.8 * losses[0]
        # after fabric.load the next gather re-sends the loaded weights exactly (a 4-bit
        # difference against the stale replicas would be off by ~1e-2)
        assert err < 1e-5
        assert resent and all(r == 1 for r in resent)


def test_the_recipe_script_trains_in_trainer_mode_and_prints_its_final_loss(tmp_path, capfd):
    # The script as torchrun runs it, on workers of torch's elastic agent forked rather than
    # started afresh (tests/scripts.py; torchrun's own command line is tests/test_examples.py's):
    # Lightning finds the elastic environment and uses those ranks. Its "max_steps reached" goes
    # to the workers' stderr, which is this process's.
    printed = run_script(2, os.path.join(RECIPES, "lightning_fsdp2.py"), "--devices", "2", "--steps", "4",
                         cwd=str(tmp_path))
    assert "max_steps=4` reached" in printed + capfd.readouterr().err
    final = [line for line in printed.splitlines() if line.startswith("final loss ")]
    assert len(final) == 1 and math.isfinite(float(final[0].split()[-1]))


def _script_main(rank, world, root, argv):
    _as_torchelastic()
    os.chdir(root)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        recipe.main(argv)
    return printed.getvalue()


def test_the_recipe_scripts_fabric_mode_trains_and_prints_its_final_loss(tmp_path):
    # The script's own main with --fabric on ranks that look like a torchrun launch, each rank's
    # output apart (tests/scripts.py joins them): rank 0 prints, the others stay quiet.
    printed = run_world(_script_main, 2, str(tmp_path), ["--devices", "2", "--steps", "4", "--fabric"])
    assert "step   0" in printed[0] and not printed[1]
    final = [line for line in printed[0].splitlines() if line.startswith("final loss ")]
    assert len(final) == 1 and math.isfinite(float(final[0].split()[-1]))
