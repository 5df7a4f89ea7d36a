"""The Accelerate recipe (examples/recipes/accelerate_fsdp2.py): qsdp after
``accelerator.prepare(model, optimizer)`` with Accelerate's FSDP2 plugin, on a two-layer Llama.

Accelerate turns FSDP on only for accelerator backends (its state keeps ``MULTI_CPU`` on a CPU-only
machine and drops the plugin), so the recipe's ``restore_fsdp_plugin`` hands the FSDP2 plugin to the
accelerator state the way Accelerate does on GPUs; ``prepare`` then runs its real FSDP2 path
(auto-wrapped layers, embeddings, grouped tail, root, optimizer remapped by name). Checkpoints go through
Accelerate's FSDP checkpoint functions (``save_fsdp_model`` / ``load_fsdp_model``, what
``save_state`` / ``load_state`` call under FSDP), sharded with DCP.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from qsdp._fsdp2 import fsdp_state

from distributed import on_one_rank_nodes, run_world

pytest.importorskip("accelerate", reason="needs the optional 'accelerate' extra: pip install -e '.[accelerate]'")
pytest.importorskip("transformers", reason="needs the optional 'accelerate' extra: pip install -e '.[accelerate]'")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "recipes"))
import accelerate_fsdp2 as recipe  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _accelerator():
    from accelerate import Accelerator

    plugin = recipe.fsdp2_plugin("LlamaDecoderLayer")
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    recipe.restore_fsdp_plugin(accelerator, plugin)
    assert accelerator.is_fsdp2
    return accelerator, plugin


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))


def _step(accelerator, model, optimizer, ids) -> float:
    loss = model(ids[:, :-1], labels=ids[:, :-1]).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _prepared(rank, world):
    from torch.distributed.fsdp import FSDPModule

    accelerator, _ = _accelerator()
    torch.manual_seed(0)
    model = recipe.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with pytest.raises(ValueError, match="Accelerate enabled FSDP, but this model was not prepared"):
        recipe.qsdp.quantize_comms(model, "sdp4bit")
    model, optimizer = accelerator.prepare(model, optimizer)
    before = [id(p) for p in model.parameters()]
    handle = recipe.qsdp.quantize_comms(model, "sdp4bit")
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return dict(
        # one comm per fully_shard call: a grouped call's modules share the first one's state
        covered=len(fsdp) >= 4 and all(any(fsdp_state(m) is fsdp_state(h) for h in handle.modules) for m in fsdp),
        same_parameters=before == [id(p) for p in model.parameters()],
        optimizer_trains_them=in_optimizer == set(before),
    )


def test_every_fsdp_module_accelerate_made_is_covered_and_no_parameter_replaced():
    # (and quantize_comms called before prepare says so)
    for r in run_world(_prepared, 2):
        assert r == dict(covered=True, same_parameters=True, optimizer_trains_them=True)


def _train(rank, world):
    accelerator, _ = _accelerator()
    torch.manual_seed(0)
    model = recipe.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, handle = recipe.prepare_with_qsdp(accelerator, model, optimizer, "sdp4bit")
    ids = _tokens()
    return [_step(accelerator, model, optimizer, ids) for _ in range(12)]


def test_accelerate_fsdp2_trains_with_sdp4bit_on_2x2_ranks():
    for losses in run_world(_train, 4, local_world_size=2, timeout=110):
        assert losses[-1] < 0.7 * losses[0]


def _resume(rank, world, ckpt):
    from accelerate.utils import load_fsdp_model, save_fsdp_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    accelerator, plugin = _accelerator()
    torch.manual_seed(0)
    model = recipe.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, handle = recipe.prepare_with_qsdp(accelerator, model, optimizer, "sdp4bit")
    ids = _tokens()
    for _ in range(2):
        _step(accelerator, model, optimizer, ids)
    save_fsdp_model(plugin, accelerator, model, ckpt)
    saved = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for _ in range(2):
        _step(accelerator, model, optimizer, ids)  # the replicas move on past the checkpoint
    load_fsdp_model(plugin, accelerator, model, ckpt)
    with torch.no_grad():
        got = model(ids[:, :-1]).logits
    torch.manual_seed(0)
    reference = recipe.tiny_llama()
    reference.load_state_dict(saved)
    with torch.no_grad():
        expected = reference(ids[:, :-1]).logits
    resent = [ag.exact_resends for ag in handle.all_gathers if ag.gathers > 0]
    return (got - expected).abs().max().item(), resent


def test_after_load_fsdp_model_the_gathers_send_the_loaded_weights_exactly(tmp_path):
    for err, resent in run_world(on_one_rank_nodes(_resume), 2, str(tmp_path / "ckpt")):
        # a 4-bit difference against stale replicas would be off by ~1e-2
        assert err < 1e-5
        assert resent and all(r == 1 for r in resent)


def _without_fsdp(rank, world):
    from accelerate import Accelerator

    model = recipe.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="Accelerate is not set up for FSDP2") as err:
        recipe.prepare_with_qsdp(Accelerator(), model, optimizer)
    return str(err.value)


def test_an_accelerator_without_fsdp2_is_rejected_before_prepare():
    message = run_world(_without_fsdp, 1)[0]
    assert "fsdp_version=2" in message and "restore_fsdp_plugin" in message


def _ddp_wrapped(rank, world):
    from accelerate import Accelerator

    # the plugin given but not restored: on CPU, Accelerate drops it and prepare wraps in DDP
    accelerator = Accelerator(fsdp_plugin=recipe.fsdp2_plugin(), cpu=True)
    model = accelerator.prepare(recipe.tiny_llama())
    with pytest.raises(ValueError, match="Accelerate did not enable FSDP: no accelerator") as err:
        recipe.qsdp.quantize_comms(model, "sdp4bit")
    return type(model).__name__, str(err.value)


def test_quantize_comms_on_the_ddp_model_accelerate_made_on_cpu_says_why():
    for wrapper, message in run_world(_ddp_wrapped, 2):
        assert wrapper == "DistributedDataParallel"
        assert "replicates LlamaForCausalLM with DDP" in message and "docs/recipes.md" in message


def _script(rank, world):
    return recipe.main(["--steps", "8"])


def test_the_recipe_script_trains_on_cpu_as_written():
    # main() is the script: Accelerator(cpu=True), restore_fsdp_plugin, prepare_with_qsdp, the loop
    for losses in run_world(_script, 2):
        assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
        assert losses[-1] < 0.9 * losses[0]
