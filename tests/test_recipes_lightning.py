"""The Lightning recipe (examples/recipes/lightning_fsdp2.py): qsdp at the end of ``configure_model``
under ``ModelParallelStrategy``, and in Fabric's ``parallelize_fn``. Lightning runs on CPU/gloo
as it is: the forked ranks look like a torchelastic launch, so Lightning uses them instead of
spawning its own processes.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from distributed import run_world

pytest.importorskip("lightning", reason="needs the optional 'lightning' extra: pip install -e '.[lightning]'")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "recipes"))
import lightning_fsdp2 as recipe  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _as_torchelastic() -> None:
    os.environ.update(GROUP_RANK="0", TORCHELASTIC_RUN_ID="qsdp-test")


class _Probe(recipe.Regression):
    """The recipe's module, recording what the tests check: whether ``configure_model`` ran on the
    meta device, the losses, and the unsharded ``net[1].fc1.weight`` the first forward sees."""

    def __init__(self) -> None:
        super().__init__("sdp4bit")
        self.built_on_meta: bool | None = None
        self.losses: list[float] = []
        self.first: torch.Tensor | None = None

    def configure_model(self) -> None:
        super().configure_model()
        if self.built_on_meta is None:
            self.built_on_meta = next(self.net.parameters()).is_meta

    def on_train_start(self) -> None:
        def record(module, inputs):
            if self.first is None:
                self.first = module.weight.detach().clone()

        self.net[1].fc1.register_forward_pre_hook(record)

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


def _fit(rank, world, root):
    _as_torchelastic()
    torch.manual_seed(0)
    module = _Probe()
    _trainer(world, 8, root).fit(module, recipe.RegressionData(8, rank))
    return module.built_on_meta, module.losses, [ag.gathers for ag in module.qsdp.all_gathers]


def test_model_parallel_strategy_trains_a_meta_built_model_with_sdp4bit(tmp_path):
    for on_meta, losses, gathers in run_world(_fit, 2, str(tmp_path)):
        assert on_meta, "ModelParallelStrategy builds the model on the meta device"
        assert all(g > 0 for g in gathers)
        assert losses[-1] < 0.7 * losses[0]


def _resume(rank, world, root):
    _as_torchelastic()
    ckpt = os.path.join(root, "step3.ckpt")
    torch.manual_seed(0)
    first = _Probe()
    trainer = _trainer(world, 3, root)
    trainer.fit(first, recipe.RegressionData(3, rank))
    trainer.save_checkpoint(ckpt)
    saved = first.net[1].fc1.weight.full_tensor()

    torch.manual_seed(1)  # other initial weights: only the checkpoint can make them equal
    resumed = _Probe()
    _trainer(world, 6, root).fit(resumed, recipe.RegressionData(6, rank), ckpt_path=ckpt)
    return torch.equal(resumed.first, saved), len(resumed.losses)


def test_after_fit_from_ckpt_path_the_first_gather_sends_the_loaded_weights(tmp_path):
    for exact, steps in run_world(_resume, 2, str(tmp_path)):
        assert exact, "the first forward after the resume must see the checkpoint's weights bit for bit"
        assert steps == 3


def _fabric(rank, world, root):
    _as_torchelastic()
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    handles: list = []
    strategy = ModelParallelStrategy(parallelize_fn=recipe.fabric_parallelize("sdp4bit", handles),
                                     data_parallel_size=world, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = recipe.mlp()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))

    def step(s: int) -> float:
        x, y = recipe.batch(s, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    losses = [step(s) for s in range(8)]
    path = os.path.join(root, "fabric.ckpt")
    state = {"model": model, "optimizer": optimizer}
    fabric.save(path, state)
    saved = get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True))
    losses += [step(s) for s in range(8, 10)]  # the replicas move on past the checkpoint
    fabric.load(path, state)
    x = recipe.batch(99, rank)[0]
    with torch.no_grad():
        got = model(x)
        reference = recipe.mlp()
        reference.load_state_dict(saved)
        expected = reference(x)
    resent = [ag.exact_resends for ag in handles[0].all_gathers if ag.gathers > 0]
    return losses, (got - expected).abs().max().item(), resent


def test_fabric_parallelize_fn_trains_and_resumes_from_its_checkpoint(tmp_path):
    for losses, err, resent in run_world(_fabric, 2, str(tmp_path)):
        assert losses[7] < 0.7 * losses[0]
        # after fabric.load the next gather re-sends the loaded weights exactly (a 4-bit
        # difference against the stale replicas would be off by ~1e-2)
        assert err < 1e-5
        assert resent and all(r == 1 for r in resent)


@pytest.mark.parametrize("mode, done", [([], "max_steps=4` reached"), (["--fabric"], "step   3")])
def test_the_recipe_script_runs_under_torchrun(mode, done, tmp_path):
    import subprocess

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "recipes", "lightning_fsdp2.py")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script, "--devices", "2", "--steps", "4", *mode],
        capture_output=True, text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert done in out.stdout + out.stderr
