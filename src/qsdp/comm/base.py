"""What every qsdp collective shares: FSDP2's custom comm interface, the group check, the state
hooks a checkpoint calls, and the byte meter it records to.

FSDP2 (``fully_shard``'s ``set_custom_all_gather`` / ``set_custom_reduce_scatter``) takes an
object with ``allocate(size, *, dtype, device)`` and ``__call__``; its interface lives in a
private module, imported here and nowhere else. :class:`WeightAllGather` and
:class:`GradReduceScatter` subclass it, so every comm of ``comm/`` is, by type, what FSDP2 asks.
"""

from __future__ import annotations

import functools
import warnings
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.distributed as dist

from ..codecs.rng import CallSeeds, derive_seed, fold_seeds
from ..config import QuantConfig
from .collectives import all_gather_flat, reduce_scatter_flat
from .meter import METER, ByteMeter
from .row_layout import RowLayouts, Spans, SpansOf
from .topology import Topology
from .weight_codec import weight_codec
from .versions import ChangeTracker

# What a weight all-gather may quantize: anything else is bytes.
NUMBER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

try:  # private in torch; a torch that moves it still gets the same interface from below
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - depends on the torch version

    class AllGather(ABC):  # type: ignore[no-redef]
        @abstractmethod
        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

        @abstractmethod
        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False): ...

    class ReduceScatter(ABC):  # type: ignore[no-redef]
        @abstractmethod
        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

        @abstractmethod
        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False): ...


class CommBase:
    """The config, topology and id of one FSDP group's comm, and where its bytes are counted.

    ``comm_id`` picks the comm's random streams (with the seed), so it must be the same on
    every rank for the same group. ``byte_meter`` starts as the process-wide meter;
    :func:`qsdp.quantize_comms` binds its handle's own (:meth:`bind_meter`).
    """

    collective: ClassVar[str] = "collective"

    def __init__(self, config: QuantConfig, topology: Topology, comm_id: int) -> None:
        self.config = config
        self.topology = topology
        self.comm_id = comm_id
        self.byte_meter: ByteMeter = METER
        # Set by the handle's close(): the module may then take another quantize_comms.
        self.closed = False
        # The forward gather's name when this comm serves FSDP2's post-forward group.
        self.post_forward_of: str | None = None
        self.layouts = RowLayouts()
        # What a call of each shape does (its codecs, layout, buffer sizes, meter entries),
        # planned at its first call; forgotten when the rows are laid out anew.
        self._plans: dict[tuple, Any] = {}
        self._seed_prefix: int | None = None
        # The last group check_group accepted: a group's size does not change, so a call with
        # the same group object needs no new look (group.size() is a pybind call).
        self._group_ok: dist.ProcessGroup | None = None

    def seed(self, *parts: int) -> int:
        """``derive_seed(config.seed, comm_id, *parts)``, the comm's own part derived once (every
        call derives its rounding seeds)."""
        key = self._seed_prefix
        if key is None:
            key = self._seed_prefix = derive_seed(self.config.seed, self.comm_id)
        return fold_seeds(key, *parts)

    def call_seeds(self, *tails: tuple[int, ...]) -> CallSeeds:
        """``table(call)``: ``seed(call, *tail)`` for each of ``tails``, looked up in a table
        derived for many calls at once (:class:`~qsdp.codecs.rng.CallSeeds`; a plan keeps it)."""
        return CallSeeds(self.seed(), tails)

    def use_row_spans(self, spans: Spans | SpansOf, mixed: bool = False) -> None:
        """Lay out the group's shard rows by its parameters' ``(elements, TP-replicated)``
        (:mod:`qsdp.comm.row_layout`), or by what ``spans()`` gives at each call (the parameters
        requiring a gradient then); ``mixed``: the group's parameters, all of them, mix the kinds."""
        self.layouts.mixed = mixed
        self.layouts.use(spans)
        self._plans.clear()

    def bind_meter(self, byte_meter: ByteMeter) -> None:
        """Count this comm's bytes in ``byte_meter`` from now on."""
        self.byte_meter = byte_meter

    def reconfigure(self, config: QuantConfig) -> None:
        """Use ``config`` from the next call on (the accuracy guard moves a group up its ladder
        on every rank at the same step): what was planned for the old one is forgotten. The
        comm id, and so the rounding streams, stay."""
        self.config = config
        self._plans.clear()

    def meter(self, kind: str, nbytes: int, elements: int, peers: tuple[int, int] | None = None) -> None:
        """Record one buffer of ``nbytes`` carrying ``elements`` of ``kind`` (``weights``,
        ``grads``, ``control``) sent to ``peers`` (intra, inter; default: every other rank of
        the topology)."""
        intra, inter = peers if peers is not None else self.topology.peers()
        self.byte_meter.record_peers(kind, nbytes, elements, intra, inter)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2's buffer: ``torch.empty(size)`` (the default caching allocator)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def check_group(self, group: dist.ProcessGroup) -> None:
        """Raise naming the group and the fix when FSDP2 calls with a group other than the one
        set up."""
        if group is self._group_ok:
            return
        if group.size() == self.topology.world_size:
            self._group_ok = group
            return
        if self.post_forward_of is not None:
            raise RuntimeError(
                f"{self.post_forward_of}: FSDP2's post-forward group (reshard_after_forward=<int>) has "
                f"{group.size()} ranks but qsdp was set up for {self.topology.world_size}; call quantize_comms "
                "after every fully_shard call, with the reshard_after_forward the model keeps")
        raise RuntimeError(
            f"FSDP {self.collective} group has {group.size()} ranks but qsdp was set up for "
            f"{self.topology.world_size}; pass the FSDP mesh's group to quantize_comms(group=...)"
        )

    def state_dict(self) -> dict[str, Any]:
        """Small per-rank counters a checkpoint stores (tensors go through DCP elsewhere)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; called after the parameters were loaded."""

    def reset(self) -> None:
        """Forget any state built from past calls (the next call starts afresh)."""


class SideStreamWork(dist.Work):
    """What an ``async_op=True`` gather on CUDA returns: the gather was enqueued on a side
    stream, and ``wait()`` (FSDP2 calls it before copying the parameters out) makes the
    caller's current stream wait for it, without blocking the host."""

    def __init__(self, done: "torch.cuda.Event") -> None:
        super().__init__()
        self.done = done

    def wait(self, timeout: Any = None) -> bool:
        torch.cuda.current_stream().wait_event(self.done)
        return True


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream qsdp's asynchronous gathers run on, one per CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _asynchronous(call: Callable[..., None]) -> Callable[..., Any]:
    """``call`` (a gather's ``__call__``) that honours ``async_op=True`` on CUDA.

    FSDP2 runs an explicit ``unshard(async_op=True)`` on the compute stream and overlaps it only
    through the work handle the comm returns. So the gather's kernels and collectives go on a
    side stream that first waits for the compute stream (the shard was copied in there), and the
    returned :class:`SideStreamWork` orders the copy-out after them. FSDP2 allocated the
    buffers on the compute stream and frees them there only after that wait, so the caching
    allocator cannot hand them out while the side stream still uses them. On CPU, or without
    ``async_op``, the call runs as it is."""
    @functools.wraps(call)
    def run(self, output_tensor, input_tensor, group, async_op: bool = False):
        if not async_op or output_tensor.device.type != "cuda":
            return call(self, output_tensor, input_tensor, group, False)
        side = side_stream(output_tensor.device)
        side.wait_stream(torch.cuda.current_stream(output_tensor.device))
        with torch.cuda.stream(side):
            call(self, output_tensor, input_tensor, group, False)
            done = torch.cuda.Event()
            done.record(side)
        return SideStreamWork(done)

    run.asynchronous = True  # type: ignore[attr-defined]
    return run


class WeightAllGather(CommBase, AllGather):
    """FSDP2's weight all-gather: ``comm(output [world * n], input [n] (a view of output),
    group, async_op)`` fills ``output`` on every rank and returns ``None``.

    ``tracker``: the change bookkeeping shared by the gathers of one model (``quantize_comms``
    passes one). A comm built without one takes every gather for a new version of the shard.
    """

    collective = "all-gather"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every gather honours async_op the same way, whichever class implements it.
        super().__init_subclass__(**kwargs)
        call = cls.__dict__.get("__call__")
        if call is not None and not getattr(call, "__isabstractmethod__", False) \
                and not getattr(call, "asynchronous", False):
            cls.__call__ = _asynchronous(call)

    def __init__(
        self, config: QuantConfig, topology: Topology, comm_id: int, tracker: ChangeTracker | None = None
    ) -> None:
        super().__init__(config, topology, comm_id)
        self.tracker = tracker if tracker is not None else ChangeTracker(assume_changed=True)
        self.index = self.tracker.add()
        self.name = f"group {comm_id}"
        # The comm of FSDP2's post-forward group, when reshard_after_forward=<int> makes one.
        self.post_forward: WeightAllGather | None = None
        self._warned_bytes = False
        # Set by the accuracy guard's top rung: the shard travels exactly from then on.
        self.exact = False

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> SideStreamWork | None:
        """Fill ``output_tensor`` on every rank. ``async_op=True`` on CUDA: enqueued on a side
        stream, returning the :class:`SideStreamWork` to wait on; otherwise done when it
        returns (``None``)."""

    def bind_meter(self, byte_meter: ByteMeter) -> None:
        super().bind_meter(byte_meter)
        if self.post_forward is not None:
            self.post_forward.bind_meter(byte_meter)

    def use_row_spans(self, spans: Spans | SpansOf, mixed: bool = False) -> None:
        super().use_row_spans(spans, mixed)
        # The post-forward group's row holds each parameter over fewer ranks: longer than these
        # spans. Of one kind it needs no layout (the identity); mixed, these spans do not describe
        # it, and the mismatch is refused at its first gather, as before.
        if self.post_forward is not None and self.layouts.mixed:
            self.post_forward.use_row_spans(spans, mixed)

    def reconfigure(self, config: QuantConfig) -> None:
        super().reconfigure(config)
        if hasattr(self, "codec"):  # the quantizing gathers' codec follows the weights' config
            self.codec = weight_codec(config.weights)

    def go_exact(self, exact: bool = True) -> None:
        """Send the shard exactly from the next gather on (``exact``), as FSDP2's own all-gather
        does: the guard's top rung. A replica held until then is forgotten."""
        if exact and not self.exact:
            self.reset()
        self.exact = exact

    def handled_elsewhere(self, output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
                          async_op: bool = False) -> bool:
        """Serve the calls this comm does not quantize itself, and say whether it did:

        * the backward gather over FSDP2's post-forward group (``reshard_after_forward=<int>``)
          goes to :attr:`post_forward`, the comm of the link that group crosses;
        * after the handle's ``close()``, every shard travels exactly (FSDP2's all-gather);
        * a shard that is not fp32/bf16/fp16 (FSDP2 gathers raw bytes, e.g. a tensor subclass's
          float8 ``fsdp_pre_all_gather``) travels as FSDP2 sends it: quantizing bytes as numbers
          would corrupt the weights. One warning per comm names the group.

        Otherwise the group must be the one set up (:meth:`check_group`)."""
        post = self.post_forward
        if post is not None and group is post.topology.group:
            post(output, shard, group, async_op)
            return True
        self.check_group(group)
        if self.closed or self.exact:
            # The handle was closed, or the guard made the group exact: the shard travels exactly,
            # as FSDP2's own all-gather sends it (never from a replica nothing updates any more).
            self.plain(output, shard, group)
            return True
        if shard.dtype in NUMBER_DTYPES:
            return False
        if not self._warned_bytes and self.config.weights.mode != "plain":
            self._warned_bytes = True
            warnings.warn(f"qsdp: {self.name}: FSDP2 all-gathers this group as {shard.dtype} (a tensor subclass's "
                          "fsdp_pre_all_gather, e.g. float8): it travels unquantized, byte for byte", stacklevel=2)
        self.plain(output, shard, group)
        return True

    def track(self, params: list[torch.Tensor], name: str) -> None:
        """Watch ``params`` (the group's sharded parameters) for changes."""
        self.tracker.watches[self.index].params = list(params)
        self.tracker.watches[self.index].rebase()
        self.name = name

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.watches[self.index].rebase()

    def holds_replicas(self) -> bool:
        """Whether this gather keeps replica rows a checkpoint must save
        (:meth:`replica_rows`)."""
        return False

    def plain(self, output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
        """FSDP2's own all-gather of ``shard`` into ``output``, metered."""
        all_gather_flat(output, shard, group)
        self.meter("weights", shard.numel() * shard.element_size(), shard.numel())

    def gather_bytes(
        self, send: torch.Tensor, elements: int, group: dist.ProcessGroup, peers: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """All-gather this rank's encoded row ``uint8 [1, B]`` into ``[group size, B]``, metered
        as ``elements`` weights sent to ``peers`` (intra, inter; default: the whole topology)."""
        size = dist.get_world_size(group)
        gathered = torch.empty(size, send.shape[1], dtype=torch.uint8, device=send.device)
        all_gather_flat(gathered, send, group)
        self.meter("weights", send.numel(), elements, peers)
        return gathered


class GradReduceScatter(CommBase, ReduceScatter):
    """FSDP2's gradient reduce-scatter: ``comm(output [n], input [world * n], group, op,
    async_op)`` writes this rank's reduced chunk into ``output`` and returns ``None``; it also
    watches the result for NaN/Inf without a host sync (:meth:`take_nonfinite_flag`)."""

    collective = "reduce-scatter"

    def __init__(self, config: QuantConfig, topology: Topology, comm_id: int) -> None:
        super().__init__(config, topology, comm_id)
        self.calls = 0
        self._nonfinite: torch.Tensor | None = None
        # The int32 flag a fused kernel sets on a non-finite result (kernel_flag), and whether a
        # kernel was given it since the last take_nonfinite_flag.
        self._flag: torch.Tensor | None = None
        self._flag_given = False
        # How to read the group's gradient divide factor, the value read at attach time, and
        # the group's name (expect_divide_factor).
        self._divide_factor: tuple[Callable[[], float | None], float | None, str] | None = None
        # The weight all-gathers' change tracker, told of every reduction (quantize_comms sets it).
        self.tracker: ChangeTracker | None = None

    def expect_divide_factor(self, read: Callable[[], float | None], what: str) -> None:
        """Refuse, at every later reduction, a gradient divide factor other than the one
        ``read()`` returns now (FSDP2's ``set_gradient_divide_factor`` on the group ``what``):
        qsdp set FSDP2's reduction up for that one (force-sum reduction, whether the division
        across HSDP replicas is its own), so a factor set later would be applied on top of
        qsdp's division or passed as an op no custom comm can read. One attribute read a call."""
        self._divide_factor = (read, read(), what)

    def check_settings(self) -> None:
        """Raise naming the fix if a setting read at attach time has changed since."""
        if self._divide_factor is None:
            return
        read, attached, what = self._divide_factor
        now = read()
        if now != attached:
            raise RuntimeError(
                f"qsdp: set_gradient_divide_factor({now}) was called on {what} after quantize_comms, which set "
                f"FSDP2's reduction up for {'no factor' if attached is None else f'factor {attached}'}: call "
                "set_gradient_divide_factor before quantize_comms (or close() the handle and quantize again)")

    def check_group(self, group: dist.ProcessGroup) -> None:
        if self._divide_factor is not None:
            self.check_settings()
        if group is not self._group_ok:
            super().check_group(group)
        if self.tracker is not None:
            self.tracker.gradients_reduced()

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None: ...

    def watch(self, output: torch.Tensor) -> None:
        """Remember (without a device sync) whether this rank's reduced shard holds NaN/Inf: a
        non-finite gradient anywhere reaches some owner's shard through a non-finite group
        scale or value, so the owners together see every one."""
        # A NaN or Inf anywhere makes the sum non-finite: one read of the shard, no shard-size
        # temporary (a finite shard whose fp32 sum overflows is broken all the same).
        bad = ~torch.isfinite(output.sum(dtype=torch.float32))
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad

    def plain(self, output: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any) -> None:
        """FSDP2's own reduce-scatter of ``input_tensor`` into ``output``, watched and metered."""
        reduce_scatter_flat(output, input_tensor, op, group)
        self.watch(output)
        self.meter("grads", output.numel() * input_tensor.element_size(), output.numel())

    def kernel_flag(self, device: torch.device) -> torch.Tensor:
        """The int32 ``[1]`` a fused kernel sets to 1 when it stores a non-finite value into this
        rank's reduced shard (:meth:`watch`'s check inside the kernel): made once, cleared by
        :meth:`take_nonfinite_flag`, so a steady call launches nothing for it."""
        if self._flag is None or self._flag.device != device:
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._flag_given = True
        return self._flag

    def take_nonfinite_flag(self) -> torch.Tensor | None:
        """Whether a non-finite value was reduced since the last call (local to this rank),
        without a host sync: a bool tensor on the device, or ``None`` when nothing was reduced
        since the last call."""
        flag, self._nonfinite = self._nonfinite, None
        if self._flag_given:
            self._flag_given = False
            seen = self._flag != 0
            self._flag.zero_()  # after the read above, in stream order
            flag = seen if flag is None else flag | seen
        return flag

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state.get("calls", 0))


__all__ = ["AllGather", "ReduceScatter", "CommBase", "WeightAllGather", "GradReduceScatter"]
