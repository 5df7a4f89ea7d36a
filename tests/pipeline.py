"""Pipeline parallelism as torchtitan runs it, on ``fsdp_models.TinyNet``: the model cut into
stages of different depths (``torch.distributed.pipelining``), each stage FSDP2-sharded over its
dp group, one ``quantize_comms`` call per model part.

Schedules (``SCHEDULES``): ``1f1b`` and ``gpipe``, one stage per rank (``Schedule1F1B``,
``ScheduleGPipe``); ``interleaved`` and ``interleaved-zb``, two stages per rank
(``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``: pipeline rank ``r`` holds stages
``r`` and ``r + pp``); ``zbv`` and ``dualpipev``, two stages per rank in a V
(``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: rank ``r`` holds ``r`` and ``2 pp - 1 - r``).
The mesh is ``(pp, dp)`` (optionally ``tp`` innermost, tensor parallelism on each block's MLP),
ranks numbered as ``init_device_mesh`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import fsdp_models as fm

MICROBATCHES = 4
BATCH = 16
WIDTH = 32

# a model's depth and each stage's (holds the input layer, blocks, holds the head)
_TWO_STAGES = (3, [(True, [0], False), (False, [1, 2], True)])
_FOUR_STAGES = (5, [(True, [0], False), (False, [1], False), (False, [2, 3], False), (False, [4], True)])
# per schedule: its torch.distributed.pipelining class and the stages it runs
SCHEDULES = {"1f1b": ("Schedule1F1B", _TWO_STAGES), "gpipe": ("ScheduleGPipe", _TWO_STAGES),
             "interleaved": ("ScheduleInterleaved1F1B", _FOUR_STAGES),
             "interleaved-zb": ("ScheduleInterleavedZeroBubble", _FOUR_STAGES),
             "zbv": ("ScheduleZBVZeroBubble", _FOUR_STAGES), "dualpipev": ("ScheduleDualPipeV", _FOUR_STAGES),
             # the interleaved schedule's model in two stages: another pipeline layout of it
             "1f1b-deep": ("Schedule1F1B", (5, [(True, [0, 1], False), (False, [2, 3, 4], True)]))}
# the schedules that place a rank's two stages in a V: pipeline rank r holds r and 2 pp - 1 - r
V_SHAPED = ("zbv", "dualpipev")


def depth(schedule: str) -> int:
    """How many blocks the model ``schedule`` runs has."""
    return SCHEDULES[schedule][1][0]


class Part(nn.Module):
    """One stage of a ``TinyNet``: its input layer (first stage), some blocks, its head (last).
    The blocks keep their names in the whole model (``blocks.3``), as torchtitan's stages do, so
    that the stages' state dicts do not collide in one checkpoint."""

    def __init__(self, net: fm.TinyNet, first: bool, blocks: list[int], last: bool) -> None:
        super().__init__()
        self.inp = net.inp if first else None
        self.blocks = nn.ModuleDict({str(i): net.blocks[i] for i in blocks})
        self.head = net.head if last else None

    def forward(self, x):
        if self.inp is not None:
            x = self.inp(x)
        for b in self.blocks.values():
            x = b(x)
        # The loss is taken in fp32 whatever the parameters' dtype (a no-op in fp32).
        return self.head(x).float() if self.head is not None else x


@dataclass
class Pipeline:
    mesh: Any
    stages: list[int]  # this rank's stage indices
    parts: list[Part]
    schedule: Any
    handles: list[Any] = field(default_factory=list)
    num_stages: int = 0

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    @property
    def first(self) -> bool:
        return 0 in self.stages

    @property
    def last(self) -> bool:
        return self.num_stages - 1 in self.stages

    @property
    def dp_rank(self) -> int:
        if "dp" in self.mesh.mesh_dim_names:
            return self.mesh["dp"].get_local_rank()
        return self.mesh["dp_replicate"].get_local_rank() * self.mesh["dp_shard"].size() \
            + self.mesh["dp_shard"].get_local_rank()

    def step(self, step: int, poison: bool = False) -> list[torch.Tensor]:
        """Forward and backward of one batch (``MICROBATCHES`` micro-batches) of dp rank's data;
        returns the last stage's micro-batch losses (none elsewhere). ``poison``: the first
        stage's input layer back-propagates NaN, so that only that stage's gradients are NaN."""
        x, y = fm.batch(step, self.dp_rank, n=BATCH)
        hook = None
        if poison:
            hook = self.parts[0].inp.register_forward_hook(
                lambda m, a, out: out.register_hook(lambda g: torch.full_like(g, float("nan"))) and None)
        losses: list[torch.Tensor] = []
        self.schedule.step(*([x] if self.first else []), target=y if self.last else None,
                           losses=losses if self.last else None)
        if hook is not None:
            hook.remove()
        return losses


def mesh(pp: int, dp: int, tp: int = 1, replicate: int = 1):
    """``(pp, dp[, tp])``; with ``replicate`` > 1, ``(pp, dp_replicate, dp_shard)`` = ``(pp,
    replicate, dp)``: each stage FSDP2-sharded on its native HSDP mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicate > 1:
        assert tp == 1
        return init_device_mesh("cpu", (pp, replicate, dp), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    if tp == 1:
        return init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    return init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def build(device_mesh, schedule: str, preset: str | None = None, seed: int = 0, per_block: bool = True, *,
          reshard: bool | int = True, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
          checkpoint: bool = False, compile_blocks: bool = False) -> Pipeline:
    """This rank's stages of ``schedule``, FSDP2 over ``mesh["dp"]`` (native HSDP over
    ``mesh["dp_replicate", "dp_shard"]`` when the mesh has those; tensor parallelism over
    ``mesh["tp"]`` when the mesh has it), quantized with ``preset`` (``None``: native FSDP2).
    ``per_block``: each block an FSDP group of its own, as torchtitan shards; otherwise each
    stage is one group, at its root. ``reshard`` (FSDP2's ``reshard_after_forward``),
    ``param_dtype``/``reduce_dtype`` (its ``MixedPrecisionPolicy``), ``checkpoint`` (activation
    checkpointing of each block's first layer) and ``compile_blocks`` as in ``layouts.build``."""
    import qsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from layouts import Checkpointed
    from torch.distributed import pipelining

    class_name, (blocks, splits) = SCHEDULES[schedule]
    pp, pp_rank = device_mesh["pp"].size(), device_mesh["pp"].get_local_rank()
    per_rank = len(splits) // pp
    stage_ids = ([pp_rank, 2 * pp - 1 - pp_rank] if schedule in V_SHAPED
                 else [pp_rank + k * pp for k in range(per_rank)])
    torch.manual_seed(seed)
    net = fm.TinyNet(WIDTH, blocks)
    names = device_mesh.mesh_dim_names or ()
    dp_mesh = device_mesh["dp"] if "dp" in names else device_mesh["dp_replicate", "dp_shard"]
    parts, stages, handles = [], [], []
    micro = BATCH // MICROBATCHES
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for s in stage_ids:
        first, blocks, last = splits[s]
        part = Part(net, first, blocks, last)
        if "tp" in (device_mesh.mesh_dim_names or ()):
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            for b in part.blocks.values():
                parallelize_module(b, device_mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        for b in part.blocks.values():
            if checkpoint:
                b.fc1 = Checkpointed(b.fc1)
            if compile_blocks:
                b.compile()
            if per_block:
                fully_shard(b, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
        if preset is not None:
            handles.append(qsdp.quantize_comms(part, preset))
        parts.append(part)
        # Static shapes: no metadata inference, which would run a forward and backward of its own.
        # Activations between stages travel in the parameters' dtype; the last stage's output is fp32.
        act = param_dtype or torch.float32
        example_in = torch.randn(micro, 8) if first else torch.randn(micro, WIDTH, dtype=act, requires_grad=True)
        example_out = torch.randn(micro, 3 if last else WIDTH, dtype=torch.float32 if last else act,
                                  requires_grad=True)
        stages.append(pipelining.PipelineStage(part, s, len(splits), torch.device("cpu"), input_args=example_in,
                                    output_args=example_out, group=device_mesh["pp"].get_group()))
    loss_fn = nn.functional.mse_loss
    sched = getattr(pipelining, class_name)(stages[0] if per_rank == 1 else stages, n_microbatches=MICROBATCHES,
                                            loss_fn=loss_fn)
    return Pipeline(device_mesh, stage_ids, parts, sched, handles, len(splits))


def reference_norm(schedule: str, step: int, dp: int, seed: int = 0) -> tuple[float, float]:
    """The unsharded model on one process: the gradient norm and the mean loss of step ``step``
    over the ``dp`` ranks' batches (what FSDP2's average over dp and the schedule's average over
    micro-batches give), before any optimizer step."""
    torch.manual_seed(seed)
    net = fm.TinyNet(WIDTH, depth(schedule))
    losses = []
    for d in range(dp):
        x, y = fm.batch(step, d, n=BATCH)
        for mx, my in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            losses.append(nn.functional.mse_loss(net(mx), my))
    loss = torch.stack(losses).mean()
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad.double() for p in net.parameters()], norm_type=2.0)
    return float(norm), float(loss)
