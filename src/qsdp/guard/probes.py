"""What a guarded step measures, as comms that stand in for a group's own for one step.

A probe is handed to FSDP2 in place of the group's comm (``set_custom_reduce_scatter`` /
``set_custom_all_gather``) for the calls of a guarded step only, and calls that comm unchanged:
steps that are not guarded run exactly as without a guard. Every number stays on the device,
added into the group's row of the guard's statistics (float64 ``[groups, FIELDS]``): the guard
reads them once, after its all-reduce.

Per reduction (:class:`ReductionProbe`), before the group's own reduce-scatter runs (which may
work in its input's place), with ``R = a * sum_r x_r`` the reduction of the ranks' inputs
``x_r`` (``a`` = 1 for SUM, 1/W for AVG, W ranks):

* ``scaled_local``: ``a^2 W ||x_r||^2``, this rank's; summed over the ranks, with ``exact_sq``
  it gives the variance of ``R`` from the spread of the ranks' gradients:
  ``var(R) = (sum scaled_local - sum exact_sq) / (W - 1)`` (SGD's own noise, as ``qsdp check``'s
  ``sum_r ||g_r - g||^2 / (W (W - 1))``, in the units of ``R``);
* ``exact_sq``: ``||R_shard||^2`` of an exact fp32 reduce-scatter of the same input (metered
  as ``guard`` bytes; over two nodes or more, in two levels as the two-level gradients travel:
  inside the node, then across nodes the node's sums, ``1/M`` of what a flat one sends there);
* ``grad_err``: ``||Q(R)_shard - R_shard||^2``, the group's own result against it, over the
  shard's parameter elements (FSDP2's padding, which the optimizer never sees, left out).

Under HSDP (:class:`ReplicasProbe`) the reduction ends in FSDP2's all-reduce hook, across the
``D`` replicas: the exact shard-group sums of the step's reduce-scatters are summed across the
replicas there (one exact fp32 all-reduce, also ``guard`` bytes), beside the group's own hook.
``W`` is then every rank of the model (``M D``); each replica holds the same shard, so its
``exact_sq`` and ``grad_err`` count ``1/D``.

Around the guarded step's optimizer step (the guard's hooks), ``update_sq``:
``||w_new - w_old||^2`` of this rank's shard. Per weight gather (:class:`GatherProbe`), the
first of the group after that step adds ``weight_err``: ``||W_seen - w_new||^2``, ``W_seen``
this rank's row of the gathered output: what every rank's forward sees of this rank's shard
(the dequantized row for direct quantization, the replica's row for weight differences).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..comm.base import AllGather, GradReduceScatter, ReduceScatter, WeightAllGather
from ..comm.collectives import all_reduce, reduce_scatter_flat
from ..comm.hsdp import AcrossReplicas
from ..comm.reduce_scatter import _divisor

FIELDS = ("scaled_local", "exact_sq", "grad_err", "update_sq", "weight_err")
SCALED_LOCAL, EXACT_SQ, GRAD_ERR, UPDATE_SQ, WEIGHT_ERR = range(len(FIELDS))


def _sq(x: torch.Tensor) -> torch.Tensor:
    return x.double().square().sum()


def sum_sq_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``||a - b||^2`` in float64, a 0-d tensor on their device (no host read)."""
    return _sq(a.detach().float() - b.float())


Mask = Callable[[torch.device], "torch.Tensor | None"]


def real_mask(rows: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor | None:
    """float64 ``[sum of elements]``: 1 where a reduce-scatter's shard row holds a parameter's
    element, 0 on FSDP2's padding (``rows``: :func:`qsdp._fsdp2.reduce_scatter_padding`);
    ``None`` where nothing is padding."""
    if all(n == real for n, real in rows):
        return None
    mask = torch.zeros(sum(n for n, _ in rows), dtype=torch.float64)
    offset = 0
    for n, real in rows:
        mask[offset:offset + real] = 1
        offset += n
    return mask.to(device)


def _error(output: torch.Tensor, exact: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``||output - exact||^2`` over the elements ``mask`` keeps (all where it does not fit)."""
    sq = (output.detach().float() - exact).double().square().view(-1)
    if mask is not None and mask.numel() == sq.numel():
        sq = sq * mask
    return sq.sum()


class ReductionProbe(ReduceScatter):
    """Stands in for ``comm`` during a guarded step: every reduction adds its statistics to
    ``row`` (float64 ``[FIELDS]`` on the gradients' device), then ``comm`` reduces as always."""

    def __init__(self, comm: GradReduceScatter, row: Callable[[torch.device], torch.Tensor], mask: Mask) -> None:
        self.comm = comm
        self.row = row
        self.mask = mask  # the shard row's parameter elements (real_mask), on a device

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        world = group.size()
        scale = 1.0 if op == dist.ReduceOp.SUM else 1.0 / world
        exact = self._exact_sum(output_tensor, input_tensor, group)
        if scale != 1.0:
            exact.mul_(scale)
        row = self.row(output_tensor.device)
        row[SCALED_LOCAL] += _sq(input_tensor.detach()) * (scale * scale * world)
        row[EXACT_SQ] += _sq(exact)
        work = self.comm(output_tensor, input_tensor, group, op, async_op)
        if work is not None:
            work.wait()
        row[GRAD_ERR] += _error(output_tensor, exact, self.mask(exact.device))
        return work

    def _exact_sum(self, output: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """float32 like ``output``: this rank's shard of the exact sum of every rank's ``x``."""
        exact = torch.empty(output.shape, dtype=torch.float32, device=output.device)
        x, topo, meter = x.detach().float(), self.comm.topology, self.comm.byte_meter
        s = exact.numel()
        if topo.intra_group is None or topo.inter_group is None or group.size() != topo.world_size:
            reduce_scatter_flat(exact, x, dist.ReduceOp.SUM, group)
            meter.record_peers("guard", 4 * s, s, *topo.peers())
            return exact
        m, d = topo.ranks_per_node, topo.nodes
        # Rows by local index, then by node (the two-level exchanges' order): the node sums the
        # rows of each local index, then each local index's ranks sum across the nodes.
        rows = x.view(topo.world_size, s).index_select(0, topo.exchange_index(x.device))
        node_sums = torch.empty(d * s, dtype=torch.float32, device=x.device)
        reduce_scatter_flat(node_sums, rows.view(-1), dist.ReduceOp.SUM, topo.intra_group)
        reduce_scatter_flat(exact, node_sums, dist.ReduceOp.SUM, topo.inter_group)
        meter.record_peers("guard", 4 * d * s, d * s, m - 1, 0)
        meter.record_peers("guard", 4 * s, s, 0, d - 1)
        return exact


class ReplicasProbe(ReductionProbe):
    """:class:`ReductionProbe` of an HSDP group (``comm`` sums inside the shard group when FSDP2
    reduce-scatters and across the replicas in FSDP2's all-reduce hook): stands in for both,
    :meth:`hook` as the module's all-reduce hook. The reduce-scatters before a hook (one, or
    one per micro-batch where FSDP2 all-reduces only the last) are summed exactly until it."""

    comm: AcrossReplicas

    def __init__(self, comm: AcrossReplicas, row: Callable[[torch.device], torch.Tensor], mask: Mask) -> None:
        super().__init__(comm, row, mask)
        self._exact: torch.Tensor | None = None  # the exact shard-group sum so far
        self._local: torch.Tensor | None = None  # sum of ||x||^2 of this rank's inputs
        self._inputs = 0
        self._shard_divisor = 1

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        self._add(self._exact_sum(output_tensor, input_tensor, group), _sq(input_tensor.detach()))
        self._shard_divisor = _divisor(op, group.size())
        return self.comm(output_tensor, input_tensor, group, op, async_op)

    def _add(self, exact: torch.Tensor, local: torch.Tensor) -> None:
        self._exact = exact if self._exact is None else self._exact.add_(exact)
        self._local = local if self._local is None else self._local + local
        self._inputs += 1

    def hook(self, output: torch.Tensor) -> None:
        if self._exact is None:  # a shard group of one rank: FSDP2 hands over the local shard
            self._add(output.detach().float().clone(), _sq(output.detach()))
            self._shard_divisor = 1
        exact, local, inputs = self._exact, self._local, self._inputs
        self._exact, self._local, self._inputs = None, None, 0
        replicas = self.comm.all_reduce
        d, world = replicas.replicas, self.comm.topology.world_size * replicas.replicas
        all_reduce(exact, replicas.group)
        replicas.meter_exact(exact, "guard")
        divisor = self._shard_divisor * self.comm.replica_divisor
        exact.div_(divisor)
        scale = 1.0 / divisor
        # ``inputs`` micro-batches a rank: ``n = W inputs`` samples of the gradient, written in
        # the units of the guard's variance over ``W`` samples (a factor (W - 1) / (n - 1)).
        n = world * inputs
        units = (world - 1) / (n - 1) if n > 1 else 1.0
        row = self.row(output.device)
        row[SCALED_LOCAL] += local * (scale * scale * n * units)
        row[EXACT_SQ] += _sq(exact) * (units / d)
        self.comm.hook(output)
        row[GRAD_ERR] += _error(output, exact, self.mask(exact.device)) / d


class GatherProbe(AllGather):
    """Stands in for ``comm`` for one gather after a guarded optimizer step, then hands the
    group back to ``comm`` (``restore()``): adds the error of what the gather delivered of this
    rank's shard to ``row``."""

    def __init__(self, comm: WeightAllGather, restore: Callable[[], None],
                 row: Callable[[torch.device], torch.Tensor]) -> None:
        self.comm, self.restore, self.row = comm, restore, row

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Any:
        if group is not self.comm.topology.group:  # a post-forward group's gather: not the forward's
            return self.comm(output_tensor, input_tensor, group, async_op)
        self.restore()
        # FSDP2's input is this rank's slot of the output, which the gather overwrites.
        shard = input_tensor.detach().clone()
        work = self.comm(output_tensor, input_tensor, group, async_op)
        if work is not None:
            work.wait()
        seen = output_tensor.detach().view(-1, shard.numel())[group.rank()]
        self.row(shard.device)[WEIGHT_ERR] += sum_sq_diff(seen, shard)
        return work
