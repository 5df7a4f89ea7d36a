"""Which parameter shards changed, and how, known on the host without looking at the data.

Every in-place change of a tensor (an optimizer step, ``load_state_dict``'s ``copy_``, a user's
``weight.mul_(0)``) bumps its version counter (``Tensor._version``, torch's own bookkeeping for
autograd, only read here). A :class:`ChangeTracker` is shared by the weight all-gathers of one
model; the optimizer-step hooks registered by :func:`qsdp.quantize_comms` tell it when a step
starts and ends. From the counters it knows, per FSDP group and without a device sync:

* whether the group's shard changed since the ranks last agreed (an optimizer step updated it),
* whether it changed *outside* the optimizer (a load or an edit), so that the weight-difference
  replicas must be re-established with exact values instead of a 4-bit difference of a jump.

Ranks must take the same path in a weight-difference gather, and one rank may be edited alone, so
the flags of all groups are OR-ed across ranks in one all-reduce, lazily at the first gather after
an optimizer step (or a load): at most one tiny collective and one host sync per optimizer step.
A change made outside the optimizer with no step after it is picked up at the first gather after
the next step (until then every rank gathers the previous weights); ``load_state_dict`` (which
every rank calls) makes it immediate through :meth:`ChangeTracker.request`, and
``QuantizedComms.reset_replicas`` sends exact weights at the next gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .meter import METER, ByteMeter


def versions(params: list[torch.Tensor]) -> tuple[int, ...]:
    """The version counters of ``params``. For FSDP2's DTensor parameters this is the DTensor's
    own counter: in-place ops on the DTensor bump it (its local tensor's counter does not move)."""
    return tuple(p._version for p in params)


def managed_parameters(module: nn.Module, fsdp_modules: list[nn.Module]) -> list[nn.Parameter]:
    """Parameters of ``module``'s subtree that no nested FSDP module in ``fsdp_modules`` owns:
    the ones in ``module``'s own FSDP group."""
    nested = [m for m in fsdp_modules if m is not module and any(m is x for x in module.modules())]
    owned_elsewhere = {id(p) for m in nested for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in owned_elsewhere]


class GroupWatch:
    """One FSDP group's sharded parameters and what their counters said at the reference points.

    A watch without parameters (a comm used on its own, outside ``quantize_comms``) counts every
    optimizer step reported to its tracker as a change.
    """

    def __init__(self, params: list[torch.Tensor] | None = None) -> None:
        self.params: list[torch.Tensor] = list(params or [])
        self.rebase()

    def rebase(self, changed: bool = False) -> None:
        """The current parameters are the reference (after a load restored parameters and comm
        state together); ``changed``: a change is pending even so (saved before its gather)."""
        now = versions(self.params)
        self.at_agreement = now  # when the ranks last agreed
        self.stepped_at = now  # right after the last optimizer step
        self.outside = False  # changed outside the optimizer since the last agreement (sticky)
        self.forced = changed
        self.optimized = False  # an optimizer holding these parameters stepped since the agreement

    def before_step(self) -> None:
        # An edit made since the last step would otherwise be taken for the optimizer's.
        if versions(self.params) != self.stepped_at:
            self.outside = True

    def after_step(self, optimized: set[int] | None) -> bool:
        """``optimized``: ids of the parameters the optimizer that stepped holds (``None``:
        unknown, taken as all). Fused optimizers (``AdamW(fused=True)``, the Hugging Face
        Trainer's default) update parameters without bumping their version counters, so the
        step itself, not the counters, says that the shard changed. Returns whether the step
        concerned this group."""
        self.stepped_at = versions(self.params)
        concerned = optimized is None or not self.params or any(id(p) in optimized for p in self.params)
        self.optimized |= concerned
        return concerned

    def pending(self, stepped: bool) -> tuple[bool, bool]:
        """(changed, changed outside the optimizer) since the last agreement, this rank only."""
        now = versions(self.params)
        changed = self.forced or self.optimized or now != self.at_agreement or (stepped and not self.params)
        return changed, self.outside or now != self.stepped_at

    def agreed(self) -> None:
        self.at_agreement = versions(self.params)
        self.outside = self.forced = self.optimized = False


class ChangeTracker:
    """The change bookkeeping of every weight all-gather of one model (see the module doc).

    ``assume_changed``: no optimizer steps are reported (a comm used on its own): every gather
    is taken as a new version of every shard, with no agreement.
    """

    def __init__(self, assume_changed: bool = False) -> None:
        self.assume_changed = assume_changed
        self.watches: list[GroupWatch] = []
        self.steps = 0  # optimizer steps seen: equal on every rank
        self._due = False
        self._stepped = False
        self._flags: list[tuple[bool, bool]] = []

    def add(self, params: list[torch.Tensor] | None = None) -> int:
        """Watch one more group; returns its index."""
        self.watches.append(GroupWatch(params))
        self._flags.append((False, False))
        return len(self.watches) - 1

    def before_optimizer_step(self) -> None:
        for w in self.watches:
            w.before_step()

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """An optimizer stepped. The hooks see every optimizer of the process: one that holds
        none of the watched parameters (a rank-local probe, another model) must not start an
        agreement, which would be a collective on that rank alone."""
        optimized = None
        if optimizer is not None:
            optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        concerned = [w.after_step(optimized) for w in self.watches]
        if any(concerned) or not self.watches:
            self.steps += 1
            self._due = self._stepped = True

    def request(self) -> None:
        """Agree again at the next gather (every rank calls it at the same point)."""
        self._due = True

    def take(
        self, index: int, group: dist.ProcessGroup, device: torch.device, peers: tuple[int, int],
        byte_meter: ByteMeter = METER,
    ) -> tuple[bool, bool]:
        """Collective when an agreement is due (every rank reaches it at the same gather):
        (changed, changed outside the optimizer) of group ``index`` on any rank since its last
        take. The flags are then cleared for that group. ``peers``: (intra, inter) for
        ``byte_meter``."""
        if self.assume_changed:
            return True, False
        if self._due:
            self._agree(group, device, peers, byte_meter)
        flags, self._flags[index] = self._flags[index], (False, False)
        return flags

    def _agree(self, group: dist.ProcessGroup, device: torch.device, peers: tuple[int, int],
               byte_meter: ByteMeter) -> None:
        local = [w.pending(self._stepped) for w in self.watches]
        flat = torch.tensor([int(f) for pair in local for f in pair], dtype=torch.int32, device=device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        byte_meter.record_peers("control", flat.numel() * flat.element_size(), 0, *peers)
        agreed = flat.tolist()  # the one host sync per optimizer step
        for i, w in enumerate(self.watches):
            changed, stale = self._flags[i]
            self._flags[i] = (changed or bool(agreed[2 * i]), stale or bool(agreed[2 * i + 1]))
            w.agreed()
        self._due = self._stepped = False

    def pending_change(self, index: int) -> bool:
        """Whether group ``index`` has a change its next gather has not sent yet (for a
        checkpoint taken between an optimizer step and the next gather)."""
        return self._flags[index][0] or self.watches[index].pending(self._stepped)[0]
