"""HSDP: FSDP2 shards inside the node, the nodes hold replicas, and the gradient all-reduce
across the replicas is quantized.

FSDP2's native HSDP (``fully_shard(mesh=2-D mesh)``) runs its all-reduce after the custom
reduce-scatter, where no public hook can replace it. With 1-D FSDP2 on the node's ranks (the
shard group), :class:`HsdpReduceScatter` is two FSDP2 hooks of one module: the custom
reduce-scatter runs the intra-node reduce-scatter (the config's ``grads``, usually exact) and
FSDP2's all-reduce hook (:meth:`HsdpReduceScatter.hook`) then runs :class:`ReplicaAllReduce`
across the ``D`` replicas (the config's ``hsdp``). FSDP2 calls that hook right after the
reduce-scatter, on its all-reduce stream, as it runs its native HSDP all-reduce: the slow
inter-node exchange of one layer overlaps the next layer's reduce-scatter instead of delaying it.

1. the shard's fp32 sum is cut into ``D`` chunks; each is (optionally) Hadamard-smoothed and
   quantized; one all-to-all delivers chunk ``k`` of every replica to replica ``k``;
2. replica ``k`` dequantizes and sums its ``D`` chunks in fp32 and requantizes the sum (still in
   the Hadamard domain); one all-gather delivers every requantized sum to every replica;
3. every replica, the owner included, decodes the same bytes: the replicas apply bit-identical
   gradients and stay bit-identical.

Both phases round stochastically, so the result is an unbiased estimate of the exact sum. The
averaging over all ``M * D`` ranks happens once, on the fp32 sum, at the end.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._fsdp2 import at_end_of_backward
from ..codecs.dispatch import disabled
from ..codecs.rng import CallSeeds, derive_seed
from ..config import HsdpComm, QuantConfig
from .collectives import all_gather, all_reduce, all_to_all
from .base import GradReduceScatter
from .meter import METER, ByteMeter
from .reduce_scatter import _divisor
from .rank_alone import RankAloneGroup
from .row_layout import RowLayout, RowLayouts, Spans, SpansOf
from .wire import RowCodec, _padding_from, _tk, launch_keys, one_launch, recording, takes_keys


def hsdp_codec(h: HsdpComm) -> RowCodec:
    """The codec of both phases of the quantized all-reduce (``mode == "quantized"``)."""
    return RowCodec(bits=h.bits, group_size=h.group_size, symmetric=h.symmetric,
                    rounding=h.rounding, hadamard_block=h.hadamard_block)


def chunk_len(numel: int, replicas: int, codec: RowCodec) -> int:
    """Elements of one replica's chunk: ``numel / replicas`` rounded up to whole codec units, so
    that every chunk's groups and Hadamard blocks stay inside it."""
    return codec.padded_len(-(-numel // replicas)) if numel else 0


class ReplicaAllReduce:
    """The sum of an fp32 vector over the replicate group, quantized as ``config.hsdp`` says.

    ``replicate_group``: the ``D`` ranks (one per node) that hold the same shard. Every call
    advances a counter that, with the seed, the comm id and the replica's rank, picks the
    stochastic rounding, so calls and replicas round independently and reproducibly.
    """

    def __init__(self, config: QuantConfig, replicate_group: dist.ProcessGroup, comm_id: int) -> None:
        self.config = config
        self.group = replicate_group
        self.replicas = replicate_group.size()
        self.rank = replicate_group.rank()
        self.comm_id = comm_id
        self.calls = 0
        self.byte_meter: ByteMeter = METER
        self.layouts = RowLayouts()
        self._plans: dict[tuple, AllReducePlan] = {}

    def __call__(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """``x``: float32 ``[n]``, this replica's value. Returns float32 ``[n]``: the sum over the
        replicas, the same bits on every replica (``inplace``: the exact route may sum into
        ``x`` and return it, sparing a copy of the shard)."""
        if self.replicas == 1:
            return x
        self.calls += 1
        n = x.numel()
        if self.config.hsdp.mode == "plain" or not self.config.quantizes_shard(n):
            return self._plain(x, inplace)
        return self._quantized(x)

    def _plain(self, x: torch.Tensor, inplace: bool) -> torch.Tensor:
        total = x if inplace else x.clone()
        all_reduce(total, self.group)
        self.meter_exact(x)
        return total

    def meter_exact(self, x: torch.Tensor, kind: str = "grads") -> None:
        """Record an exact all-reduce of ``x`` across the replicas as ``kind`` bytes between the
        nodes, metered as the direct algorithm the quantized path runs: a chunk to every peer,
        twice."""
        d = self.replicas
        chunk = -(-x.numel() // d)
        self.byte_meter.record(kind, "inter", 2 * (d - 1) * chunk * x.element_size(), 2 * (d - 1) * chunk)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        # Everything fixed by the size, the device and the config is planned at the first call.
        key = (x.numel(), x.device, self.layouts.plan_key() if self.layouts.mixed else ())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = AllReducePlan.build(self, x)
        if plan.launches and x.is_contiguous() and not disabled():
            return self._quantized_again(x, plan, *plan.keys(self.calls))
        seed1, seed2 = plan.seeds(self.calls)
        d, codec, length = self.replicas, plan.codec, plan.length
        if not plan.layout.identity:
            x = plan.layout.expand(x.view(1, -1)).view(-1)
        learn = plan.fused and not plan.launches
        # Cut into the D chunks, the last padded by repeating the last element (which widens no
        # quantization group's range): on the fused path by the kernel, from x itself.
        with recording(learn) as encoded:
            send = codec.encode_cut(x, d, length, seed=seed1)
        recv = torch.empty_like(send)
        all_to_all(recv, send, self.group)
        self.byte_meter.add(plan.meter1)
        with recording(learn) as summed:
            mine = codec.decode_sum_encode(recv, length, sources=d, codec=codec, seed=seed2)
        gathered = torch.empty(d, mine.shape[1], dtype=torch.uint8, device=x.device)
        all_gather(gathered, mine, self.group)
        self.byte_meter.add(plan.meter2)
        with recording(learn) as decoded:
            total = codec.decode_finished(gathered, length).reshape(-1)
        if learn:
            launches = [one_launch(encoded), one_launch(summed), one_launch(decoded)]
            if None not in launches and takes_keys(plan.keys, launches[0], launches[1]):
                # A later call requantizes into its own row of the gathered buffer and gathers in
                # place: the requantized row moved to row ``rank`` of a buffer of such rows.
                launches[1] = _tk().requantized_further(launches[1], self.rank * plan.width)
                plan.launches[:] = launches
        return total[:plan.n] if plan.layout.identity else plan.layout.contract(total[:plan.n])

    def _quantized_again(self, x: torch.Tensor, plan: "AllReducePlan", key1: int, key2: int) -> torch.Tensor:
        """:meth:`_quantized` of a steady call: the first call's three launches with this call's
        tensors and keys (:attr:`AllReducePlan.keys`), and both exchanges."""
        tk = _tk()
        d, width, device = self.replicas, plan.width, x.device
        send = torch.empty(d, width, dtype=torch.uint8, device=device)
        if plan.used is not None:
            send[:, plan.used:].zero_()  # each row's 4-byte padding, as the encoding zeroes it
        tk.quantize_again(plan.launches[0], x, send, key1)
        recv = torch.empty_like(send)
        all_to_all(recv, send, self.group)
        gathered = torch.empty_like(send)  # [d, width], as send
        mine = gathered[self.rank:self.rank + 1]  # requantized and gathered in place, as FSDP2 gathers
        if plan.used is not None:
            mine[:, plan.used:].zero_()
        tk.dequantize_again(plan.launches[1], recv, None, gathered, key2)
        all_gather(gathered, mine, self.group)
        self.byte_meter.add(plan.meters)  # both exchanges', once
        total = torch.empty(d * plan.length, dtype=torch.float32, device=device)
        tk.dequantize_again(plan.launches[2], gathered, total)
        return total[:plan.n] if plan.n < total.numel() else total

    def call_seeds(self) -> CallSeeds:
        """Both phases' seeds of each call: ``derive_seed(seed, comm_id, calls, rank, 7, phase)``
        for the phases 1 and 2 (:class:`~qsdp.codecs.rng.CallSeeds`)."""
        return CallSeeds(derive_seed(self.config.seed, self.comm_id), ((self.rank, 7, 1), (self.rank, 7, 2)))

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state.get("calls", 0))

    def reconfigure(self, config: QuantConfig) -> None:
        """Use ``config.hsdp`` from the next call on (the accuracy guard's move, on every replica
        at the same step); the calls, and so the rounding streams, go on."""
        self.config = config
        self._plans.clear()


@dataclass(frozen=True)
class AllReducePlan:
    """What a quantized all-reduce of one size does, fixed by its config, size and group: the
    codec, the row layout, the elements ``n`` of the (laid out) vector, its chunk ``length`` and
    the meter's entries of both exchanges (bytes, elements), ``meters`` both together, and
    ``seeds`` both phases' seeds of each call (:meth:`ReplicaAllReduce.call_seeds`)."""

    codec: RowCodec
    layout: RowLayout
    n: int
    length: int
    meter1: tuple  # ByteMeter.add's entries
    meter2: tuple
    meters: tuple
    seeds: CallSeeds
    # An encoded chunk's bytes, where its 4-byte padding starts (None: it has none), whether
    # the codec takes the fused path with the Hadamard transform inside, and the first call's
    # three launches (encoding, requantization, decoding) where each was one (kernels.Launch).
    width: int = 0
    used: int | None = None
    fused: bool = False
    launches: list = field(default_factory=list)
    keys: CallSeeds | None = None  # both phases' keys as the launches take them (wire.launch_keys; where fused)

    @classmethod
    def build(cls, reduce: ReplicaAllReduce, x: torch.Tensor) -> "AllReducePlan":
        d, real = reduce.replicas, x.numel()
        codec = hsdp_codec(reduce.config.hsdp)
        layout = reduce.layouts.get(real, codec.unit, x.device)
        n = layout.wire_length
        length = chunk_len(n, d, codec)
        own = layout.real_elements(reduce.rank * length, (reduce.rank + 1) * length)
        nbytes = codec.row_nbytes(length)
        fused = layout.identity and codec.fuses_rows(torch.empty(0, dtype=torch.uint8, device=x.device))
        meter1 = ((("grads", "inter"), (d - 1) * nbytes, real - own),)
        meter2 = ((("grads", "inter"), (d - 1) * nbytes, (d - 1) * own),)
        seeds = reduce.call_seeds()
        return cls(codec, layout, n, length, meter1, meter2, meter1 + meter2, seeds, nbytes,
                   _padding_from(codec, length), fused,
                   keys=launch_keys(seeds, codec.rounding, codec.rounding) if fused else None)


class AcrossReplicas(GradReduceScatter):
    """What both HSDP reduce-scatters share: ``inner``, the reduce-scatter over the shard group,
    and ``all_reduce`` across the replicas (in FSDP2's all-reduce hook); one meter, one flag
    (the replicated result's), one state."""

    def __init__(self, inner: GradReduceScatter, all_reduce: ReplicaAllReduce, divide_replicas: bool) -> None:
        super().__init__(inner.config, inner.topology, inner.comm_id)
        self.inner = inner
        self.all_reduce = all_reduce
        # What the all-reduce hook divides the sum across the replicas by (1: FSDP2 divides by a
        # custom factor itself).
        self.divide_replicas = divide_replicas
        self.replica_divisor = all_reduce.replicas if divide_replicas else 1

    def bind_meter(self, byte_meter: ByteMeter) -> None:
        super().bind_meter(byte_meter)
        self.inner.bind_meter(byte_meter)
        self.all_reduce.byte_meter = byte_meter

    def reconfigure(self, config: QuantConfig) -> None:
        super().reconfigure(config)
        # The shard group's reduction keeps its own rounding seed (see hsdp_reduce_scatter).
        self.inner.reconfigure(dataclasses.replace(config, seed=self.inner.config.seed))
        self.all_reduce.reconfigure(config)

    def use_row_spans(self, spans: Spans | SpansOf, mixed: bool = False) -> None:
        super().use_row_spans(spans, mixed)
        self.inner.use_row_spans(spans, mixed)
        self.all_reduce.layouts.mixed = mixed
        self.all_reduce.layouts.use(spans)
        self.all_reduce._plans.clear()

    def take_nonfinite_flag(self) -> torch.Tensor | None:
        """The all-reduce carries a non-finite value of any replica into every replica's
        result, so the replicated result's flag is the one that counts (the inner one is reset)."""
        self.inner.take_nonfinite_flag()
        return super().take_nonfinite_flag()

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "all_reduce": self.all_reduce.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self.all_reduce.load_state_dict(state.get("all_reduce", {}))

    def reset(self) -> None:
        self.inner.reset()


class HsdpReduceScatter(AcrossReplicas):
    """FSDP2's custom reduce-scatter and all-reduce hook for HSDP: ``inner`` (a reduce-scatter
    over the shard group) sums inside the node when FSDP2 calls the reduce-scatter;
    :class:`ReplicaAllReduce` sums across the replicas when FSDP2 calls :meth:`hook` with that
    output, and the result is divided once by every rank that contributed when FSDP2 asks for
    an average.

    FSDP2 sees only the ``M``-rank shard group: it passes ``ReduceOp.AVG`` (fp32/bf16 reduce
    dtypes) meaning "divide by ``M``", or ``SUM`` when it divides by ``M`` itself after the
    hook (fp16). The division waits for the hook, where the fp32 sum across replicas is known;
    the division by the ``D`` replicas is done there too, unless ``divide_replicas`` is
    ``False``: a module with a custom gradient divide factor (``set_gradient_divide_factor``,
    e.g. torchtitan's) has FSDP2 apply that whole factor.
    """

    def __init__(self, inner: GradReduceScatter, all_reduce: ReplicaAllReduce,
                 divide_replicas: bool = True) -> None:
        super().__init__(inner, all_reduce, divide_replicas)
        # The reduce-scatter's output and the divisor its op asked for, until the hook takes them.
        self._pending: tuple[torch.Tensor, int] | None = None

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        if self._pending is not None:
            raise RuntimeError(
                "qsdp HSDP: the previous reduce-scatter's output never reached the all-reduce hook, "
                "so it was not summed across the replicas; do not replace the hook quantize_comms set "
                "(FSDPModule.set_all_reduce_hook)"
            )
        self.check_settings()
        shard_divisor = _divisor(op, group.size())
        self.inner(output_tensor, input_tensor, group, dist.ReduceOp.SUM)
        self._pending = (output_tensor, shard_divisor)
        return None

    def hook(self, output: torch.Tensor) -> None:
        """FSDP2's all-reduce hook, on FSDP2's all-reduce stream: the sum across the replicas of
        the reduce-scatter's ``output``. For a shard group of one rank FSDP2 skips the
        reduce-scatter and hands over the local gradient shard (divided only by a custom divide
        factor)."""
        self.check_settings()
        pending, self._pending = self._pending, None
        if self.topology.world_size == 1:
            shard_divisor = 1
        elif pending is None or pending[0] is not output:
            raise RuntimeError(
                "qsdp HSDP: the all-reduce hook was called with a tensor the reduce-scatter did not "
                "just write; it runs only as FSDP2's all-reduce hook of the module quantize_comms set it on"
            )
        else:
            shard_divisor = pending[1]
        if output.is_cuda:
            # Allocated on the reduce-scatter stream, used here on the all-reduce stream: without
            # this the allocator could hand the block to the next layer's reduce-scatter as soon as
            # FSDP2 drops it (a cast to the parameter dtype), while this stream still reads it.
            output.record_stream(torch.cuda.current_stream(output.device))
        self._across_replicas(output, shard_divisor)

    def _across_replicas(self, output: torch.Tensor, shard_divisor: int) -> None:
        # The sum runs in fp32: into the shard itself when it is fp32, else into its fp32 copy.
        total = self.all_reduce(output.float(), inplace=True)
        divisor = shard_divisor * self.replica_divisor
        if divisor != 1:
            total.div_(divisor)  # in fp32, before any cast to the reduce dtype
        if total is not output:
            output.copy_(total)
        self.watch(output)

    def reset(self) -> None:
        super().reset()
        self._pending = None


class NativeHsdpReduceScatter(AcrossReplicas):
    """FSDP2's custom reduce-scatter and all-reduce hook on FSDP2's native HSDP mesh.

    ``inner`` (a reduce-scatter over the mesh's shard dimension) is called by FSDP2 with the op
    it chose (``AVG``: divide by the shard group; ``SUM`` with a custom divide factor or fp16,
    where FSDP2 divides itself). FSDP2's own all-reduce runs over a group of this rank alone that launches
    nothing (:attr:`rank_alone`, a :class:`qsdp.comm.rank_alone.RankAloneGroup`,
    :func:`qsdp._fsdp2.route_replicate_all_reduce_to_hook`), so it keeps accumulating the
    reduce-scatters of ``set_requires_all_reduce(False)`` micro-batches itself and calls
    :meth:`hook` once with their sum; the hook sums across the replicas as ``config.hsdp``
    says and divides by them unless ``divide_replicas`` is ``False`` (a custom divide factor is
    FSDP2's whole division).

    Exact (``hsdp.mode == "plain"``, or a shard too small to quantize): one all-reduce of the
    reduce dtype in place, ``AVG`` or ``SUM`` as FSDP2's native HSDP runs it, so the ``fsdp``
    preset equals native HSDP bit for bit. Quantized: :class:`ReplicaAllReduce` on the fp32
    value, divided in fp32 before the cast back.

    The hook is then the only sum across the replicas, so its absence would go unnoticed: the
    replicas would train apart. :attr:`rank_alone`, the group FSDP2's all-reduce is routed to,
    tells this comm on the host when FSDP2 all-reduces; FSDP2 calls the hook right after, in
    the same call. An all-reduce not followed by the hook before the next one or the end of
    the backward (the hook was replaced: ``set_all_reduce_hook`` after ``quantize_comms``), or
    a hook that no all-reduce of that group preceded (FSDP2 all-reduced over the real replicate
    group itself: a torch that reads the group from another field), raises naming the cause.
    Host-side flags only: nothing is read from the device.
    """

    def __init__(self, inner: GradReduceScatter, all_reduce: ReplicaAllReduce,
                 divide_replicas: bool = True) -> None:
        super().__init__(inner, all_reduce, divide_replicas)
        self.rank_alone = RankAloneGroup(on_all_reduce=self._all_reduce_routed)
        self.name = f"group {inner.comm_id}"
        self._awaiting_hook = False  # FSDP2 all-reduced over rank_alone; its hook is next

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        self.check_settings()
        self.inner(output_tensor, input_tensor, group, op)
        return None

    def _all_reduce_routed(self) -> None:
        """FSDP2's all-reduce across the replicas reached :attr:`rank_alone`: the hook is next."""
        self._check_hook_ran()
        self._awaiting_hook = True
        # The backward's last group has no later all-reduce to find a missing hook: check once
        # the backward ends, before the optimizer can step on gradients not summed (outside a
        # backward, the next all-reduce checks).
        at_end_of_backward(self._check_hook_ran)

    def _check_hook_ran(self) -> None:
        if self._awaiting_hook:
            self._awaiting_hook = False
            raise RuntimeError(
                f"qsdp native HSDP: {self.name}: FSDP2 all-reduced across the replicas but qsdp's all-reduce hook "
                "did not run, so the gradients were not summed across the replicas, which would train apart: the "
                "hook quantize_comms set was replaced (FSDPModule.set_all_reduce_hook after quantize_comms); qsdp's "
                "hook is the only sum across the replicas: set no other all-reduce hook on this model")

    def hook(self, output: torch.Tensor) -> None:
        """FSDP2's all-reduce hook, on its all-reduce stream: ``output`` (the shard of the
        reduce dtype, ``[n]``) becomes its average (or sum) across the replicas, in place."""
        if not self._awaiting_hook:
            raise RuntimeError(
                f"qsdp native HSDP: {self.name}: the all-reduce hook ran, but FSDP2's own all-reduce across the "
                "replicas did not go to the one-rank group qsdp routed it to: FSDP2 summed the replicas itself "
                "and qsdp would sum them again; this torch release reads the replicate group from elsewhere than "
                "qsdp._fsdp2.route_replicate_all_reduce_to_hook changes, and this qsdp does not support it")
        self._awaiting_hook = False
        self.check_settings()
        if output.is_cuda:
            # Allocated on the reduce-scatter stream; FSDP2 keeps it alive only until the event it
            # recorded before this hook, so tell the allocator this stream still uses it.
            output.record_stream(torch.cuda.current_stream(output.device))
        if self._exact(output):
            self._exact_all_reduce(output)
        else:
            total = self.all_reduce(output.float(), inplace=True)
            if self.divide_replicas:
                total.div_(self.all_reduce.replicas)  # in fp32, before any cast to the reduce dtype
            if total is not output:
                output.copy_(total)
        self.watch(output)

    def _exact(self, output: torch.Tensor) -> bool:
        return (self.config.hsdp.mode == "plain" or not self.config.quantizes_shard(output.numel())) \
            and output.dtype in (torch.float32, torch.bfloat16)

    def _exact_all_reduce(self, output: torch.Tensor) -> None:
        reduce = self.all_reduce
        if reduce.replicas == 1:
            return
        reduce.calls += 1
        op = dist.ReduceOp.AVG if self.divide_replicas else dist.ReduceOp.SUM
        dist.all_reduce(output, op=op, group=reduce.group)
        reduce.meter_exact(output)

    def reset(self) -> None:
        super().reset()
        self._awaiting_hook = False
