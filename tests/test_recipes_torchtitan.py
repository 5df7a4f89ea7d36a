"""The torchtitan recipe (examples/recipes/torchtitan_llama3.py) on torchtitan's own llama3 model
and FSDP2 wrapping, in the order torchtitan's trainer runs: shard on the meta device, attach qsdp,
``to_empty``, ``init_weights``, load the checkpoint.

torchtitan's ``Trainer`` itself cannot run on a CPU-only machine (it resolves its device to CUDA
and builds its meshes there), so these tests call the pieces the trainer calls: its llama3
``Transformer``, its ``apply_fsdp`` (what ``parallelize_llama`` runs for FSDP) and its checkpoint
``ModelWrapper`` (the Stateful its ``CheckpointManager`` hands to DCP).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from distributed import run_pooled

pytest.importorskip("torchtitan", reason="needs the optional 'torchtitan' extra: pip install -e '.[torchtitan]'")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "recipes"))
import torchtitan_llama3 as recipe  # noqa: E402

pytestmark = pytest.mark.timeout(120)

VOCAB = 64


def _sharded_llama(world: int, seed: int, preset: str | None, attach=recipe.attach_qsdp):
    """torchtitan's llama3 built on meta, sharded by torchtitan's apply_fsdp, qsdp attached (when
    ``preset``), then materialised and initialised as torchtitan's trainer does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp

    args = TransformerModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=VOCAB, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    handle = attach(model, mesh.get_group(), preset) if preset else None
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, handle


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))


def _resume_gathers_loaded_weights(rank, world, ckpt):
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import ModelWrapper

    ids = _tokens()[:, :-1]
    saved, _ = _sharded_llama(world, seed=1, preset=None)
    with torch.no_grad():
        expected = saved(ids)
    dcp.save({"model": ModelWrapper(saved)}, checkpoint_id=ckpt)

    model, handle = _sharded_llama(world, seed=0, preset="sdp4bit")
    with torch.no_grad():
        model(ids)  # the replicas are built here, from the seed-0 initial weights
        dcp.load({"model": ModelWrapper(model)}, checkpoint_id=ckpt)
        got = model(ids)
    return torch.equal(got, expected), [(ag.gathers, ag.exact_resends) for ag in handle.all_gathers]


def _parallel_dims(world: int, replicate: int = 1):
    from torchtitan.distributed import ParallelDims

    return ParallelDims(dp_replicate=replicate, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)


def _through_the_spec_parallelize_fn(rank, world):
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import JobConfig
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from torchtitan.protocols.train_spec import get_train_spec

    # torchtitan resolves its device type to CUDA on a CPU-only machine; its meshes live on CPU here
    parallel_dims_module.device_type = "cpu"
    dims = _parallel_dims(world)
    dims.build_mesh()
    job = JobConfig()
    job.training.seq_len = 16
    with torch.device("meta"):
        model = Transformer(TransformerModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=VOCAB, max_seq_len=16))
    model = get_train_spec(recipe.SPEC_NAME).parallelize_fn(model, dims, job)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        recipe.qsdp.comm_stats(reset=True)
        logits = model(_tokens()[:, :-1])
    carried = recipe.qsdp.comm_stats()["weights"]["total"]["elements"]
    # every parameter's shard went to the other rank through qsdp's all-gathers
    everything = sum(p.numel() for p in model.parameters()) * (world - 1) / world
    return carried >= everything, bool(torch.isfinite(logits).all())


def test_the_spec_parallelize_fn_attaches_qsdp_on_the_meta_device_and_the_model_runs():
    assert run_pooled(_through_the_spec_parallelize_fn, 2) == [(True, True)] * 2


def _force_sum(model) -> None:
    """What native torchtitan needs on gloo, which has no PREMUL_SUM (the op FSDP2 derives from
    torchtitan's divide factor 1): FSDP2 passes SUM and applies the factor itself."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def _job():
    """torchtitan's job config for these tests: sequences of 16 tokens, fp32 parameters."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.training.seq_len = 16
    job.training.mixed_precision_param = "float32"
    return job


def _hsdp_llama(rank, world, preset):
    """torchtitan's llama3 on HSDP (data_parallel_replicate_degree 2 x shard 2) as its trainer
    builds it: ``preset == "spec"`` through the registered parallelize_fn (its default preset),
    ``None`` native torchtitan, else torchtitan's parallelize_llama and the recipe's attach_qsdp."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama
    from torchtitan.protocols.train_spec import get_train_spec

    parallel_dims_module.device_type = "cpu"
    dims = _parallel_dims(world, replicate=2)
    dims.build_mesh()
    job = _job()
    with torch.device("meta"):
        model = Transformer(TransformerModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=VOCAB, max_seq_len=16))
    if preset == "spec":
        model = get_train_spec(recipe.SPEC_NAME).parallelize_fn(model, dims, job)
    else:
        model = parallelize_llama(model, dims, job)
        if preset is not None:
            recipe.attach_qsdp(model, dims.get_mesh("fsdp").get_group(), preset)
        else:
            _force_sum(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(rank))
    losses = []
    for step in range(6):
        recipe.qsdp.comm_stats(reset=True)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    return losses, params, recipe.qsdp.comm_stats()["grads"]["inter"]


def test_hsdp_through_the_spec_quantizes_the_all_reduce_across_the_replicas():
    for losses, _, inter in run_pooled(_hsdp_llama, 4, "spec", local_world_size=2):
        assert losses[-1] < 0.95 * losses[0]  # native: -9.4% in these 6 steps
        assert 4.0 < inter["bits_per_element"] < 5.0  # sdp4bit's 4-bit all-reduce between the nodes


def _assert_fsdp_preset_is_native_bit_for_bit(worker, local_world_size: int) -> None:
    """``worker(rank, world, preset)`` -> (losses, full parameters, ...): the ``fsdp`` preset's
    losses and weights equal native torchtitan's (``preset=None``) bit for bit."""
    native = run_pooled(worker, 4, None, local_world_size=local_world_size)
    for (l0, p0, _), (l1, p1, _) in zip(native, run_pooled(worker, 4, "fsdp", local_world_size=local_world_size)):
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))


@pytest.mark.slow
def test_hsdp_with_the_fsdp_preset_is_torchtitans_native_hsdp_bit_for_bit():
    _assert_fsdp_preset_is_native_bit_for_bit(_hsdp_llama, 2)


def test_the_registered_spec_is_llama3_with_the_qsdp_parallelize_fn():
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(recipe.SPEC_NAME)
    assert spec.parallelize_fn is recipe.parallelize_llama_qsdp
    assert spec.model_cls is get_train_spec("llama3").model_cls


def test_a_checkpoint_loaded_after_the_first_gather_is_resent_exactly(tmp_path):
    for same, comms in run_pooled(_resume_gathers_loaded_weights, 2, str(tmp_path / "ckpt"), local_world_size=1):
        assert same, "the first forward after the load must see the loaded weights bit for bit"
        # embeddings, two blocks, the grouped [norm, output] tail (the root holds no parameter)
        resends = [resent for gathers, resent in comms if gathers > 0]
        assert resends == [1, 1, 1, 1]


def _edit_first_module_of_the_grouped_tail(rank, world):
    model, handle = _sharded_llama(world, seed=0, preset="sdp4bit")
    ids = _tokens()[:, :-1]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.no_grad():
        model(ids)
        model.output.reshard()  # the tail keeps its unsharded weights after forward: shard them
        model.norm.weight.mul_(2.0)  # an edit outside the optimizer, in the tail's first module
    opt.step()  # changes are agreed on once per optimizer step (no gradients: nothing moves)
    with torch.no_grad():
        model(ids)
    return sum(ag.exact_resends for ag in handle.all_gathers)


def test_an_edit_of_any_module_in_a_grouped_fully_shard_is_resent_exactly():
    assert run_pooled(_edit_first_module_of_the_grouped_tail, 2, local_world_size=1) == [1, 1]


def _train_meta_built(rank, world, attach):
    model, handle = _sharded_llama(world, seed=0, preset="sdp4bit", attach=attach)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = _tokens()
    losses = []
    for _ in range(8):
        logits = model(ids[:, :-1])
        # torchtitan's loss is divided by the global token count; gradients are summed
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_meta_built_torchtitan_llama_trains_with_sdp4bit_through_the_recipe():
    for losses in run_pooled(_train_meta_built, 2, recipe.attach_qsdp):
        assert losses[-1] < 0.8 * losses[0]


def test_quantize_comms_alone_trains_with_torchtitans_gradient_divide_factor():
    plain = lambda model, group, preset: recipe.qsdp.quantize_comms(model, preset, group=group)  # noqa: E731
    for losses in run_pooled(_train_meta_built, 2, plain):
        assert losses[-1] < 0.8 * losses[0]


# --------------------------------------------------------------------------- pipeline parallelism


def _pp_llama(rank, world, preset, steps=4):
    """torchtitan's llama3 cut into 2 pipeline stages by its own ``pipeline_llm`` (1F1B), each
    stage FSDP2-sharded over its 2 dp ranks by the ``parallelize_fn`` torchtitan calls once per
    model part: ``preset == "spec"`` the registered one (its default preset), ``None`` native
    torchtitan, else ``parallelize_llama`` and the recipe's ``attach_qsdp``. Trained as its
    trainer does: ``to_empty`` and ``init_weights`` per part, ``schedule.step`` a batch."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama
    from torchtitan.protocols.train_spec import get_train_spec

    parallel_dims_module.device_type = "cpu"
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=2, ep=1, etp=1, world_size=world)
    dims.build_mesh()
    job = _job()
    job.training.local_batch_size = 4
    job.parallelism.pipeline_parallel_degree = 2
    job.parallelism.pipeline_parallel_schedule = "1F1B"
    job.parallelism.pipeline_parallel_microbatch_size = 1

    def native(part, dims, job):
        part = parallelize_llama(part, dims, job)
        _force_sum(part)
        return part

    def attached(part, dims, job):
        part = parallelize_llama(part, dims, job)
        recipe.attach_qsdp(part, dims.get_mesh("fsdp").get_group(), preset)
        return part

    parallelize = {None: native, "spec": get_train_spec(recipe.SPEC_NAME).parallelize_fn}.get(preset, attached)
    args = TransformerModelArgs(dim=32, n_layers=4, n_heads=2, vocab_size=VOCAB, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)

    def loss_fn(pred, labels):
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    schedule, parts, first, last = pipeline_llm(model, dims, job, torch.device("cpu"), args, parallelize, loss_fn)
    for part in parts:
        part.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            part.init_weights(buffer_device=None)
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    # one batch a dp rank, every step: a loss that falls within a few steps
    ids = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(dims.get_mesh("fsdp").get_local_rank()))
    losses = []
    for _ in range(steps):
        recipe.qsdp.comm_stats(reset=True)
        micro_losses: list[torch.Tensor] = []
        schedule.step(*([ids[:, :-1]] if first else []), target=ids[:, 1:] if last else None,
                      losses=micro_losses if last else None)
        opt.step()
        opt.zero_grad()
        losses.append(float(torch.stack(micro_losses).mean()) if last else None)
    full = [p.full_tensor().detach().clone() for p in params]
    return losses, full, recipe.qsdp.comm_stats()


def test_pipeline_stages_through_the_spec_train_with_quantized_comms():
    for losses, _, stats in run_pooled(_pp_llama, 4, "spec", 6, local_world_size=1):
        if losses[0] is not None:  # the last stage
            assert losses[-1] < 0.95 * losses[0]  # native: -10.7% and -11.5% in these 6 steps; sdp4bit -10.3%, -11.2%
        # each stage's reduce-scatters in 4 bits between its dp ranks' nodes (one rank a node)
        assert 4.0 < stats["grads"]["inter"]["bits_per_element"] < 5.0


@pytest.mark.slow
def test_pipeline_stages_with_the_fsdp_preset_are_torchtitans_own_bit_for_bit():
    _assert_fsdp_preset_is_native_bit_for_bit(_pp_llama, 1)
