"""torchtitan: quantized FSDP2 communication through a registered TrainSpec.

torchtitan's ``parallelize_fn`` shards the model while it is still on the meta device; the trainer
then calls ``to_empty``, ``init_weights`` and loads the checkpoint. ``quantize_comms`` is attached
right after sharding (the same place torchtitan loops over the ``FSDPModule``\\ s for its own
options): it touches no parameter data, and the weight-difference replicas are built by the first
all-gather, so they start from whatever weights were initialised or loaded in between.

Use it by importing this module from the job (``--experimental.custom_import``) and naming the
registered model::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --job.config_file llama3_8b.toml \\
        --experimental.custom_import examples.recipes.torchtitan_llama3 \\
        --model.name llama3_qsdp

``QSDP_PRESET`` (default ``sdp4bit``) picks the preset. HSDP
(``--parallelism.data_parallel_replicate_degree`` > 1, the replicas across nodes and
``data_parallel_shard_degree`` the ranks of a node) takes the same module: the all-reduce across
the replicas is quantized as the preset's ``hsdp`` says. So does pipeline parallelism
(``--parallelism.pipeline_parallel_degree`` > 1): torchtitan's ``pipeline_llm`` calls the
``parallelize_fn`` once per model part, and each stage gets its own ``quantize_comms``.
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist
from torch import nn

import qsdp

PRESET = os.environ.get("QSDP_PRESET", "sdp4bit")
SPEC_NAME = "llama3_qsdp"


def attach_qsdp(model: nn.Module, fsdp_group: dist.ProcessGroup, preset: str = PRESET) -> qsdp.QuantizedComms:
    """Quantize the comms of every FSDP2 module under ``model``, sharded over ``fsdp_group``.
    Safe on a meta-device model: no parameter is read or replaced."""
    # torchtitan sets FSDP2's gradient divide factor to 1 (it divides the loss by the global token
    # count); quantize_comms sees the factor and makes FSDP2 pass SUM to the quantized reduce-scatter.
    return qsdp.quantize_comms(model, preset, group=fsdp_group)


def parallelize_llama_qsdp(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """torchtitan's own ``parallelize_llama``, then qsdp on the FSDP mesh. With
    ``data_parallel_replicate_degree > 1`` torchtitan shards on FSDP2's native HSDP mesh
    ``("dp_replicate", "fsdp")``: qsdp reads the replicas from it and quantizes their all-reduce
    as the preset's ``hsdp`` says."""
    from torchtitan.models.llama3 import parallelize_llama

    model = parallelize_llama(model, parallel_dims, job_config)
    if parallel_dims.fsdp_enabled:
        attach_qsdp(model, parallel_dims.get_mesh("fsdp").get_group())
    return model


def register() -> None:
    """Register ``llama3_qsdp``: torchtitan's llama3 spec with the parallelize_fn above."""
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    spec = dataclasses.replace(get_train_spec("llama3"), parallelize_fn=parallelize_llama_qsdp)
    register_train_spec(SPEC_NAME, spec)


try:
    register()
except ValueError:  # already registered (the module was imported under another name)
    pass
