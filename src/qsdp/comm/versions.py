"""Which parameter shards changed, and how, known on the host without looking at the data.

Every in-place change of a tensor (an optimizer step, ``load_state_dict``'s ``copy_``, a user's
``weight.mul_(0)``) bumps its version counter (``Tensor._version``, torch's own bookkeeping for
autograd, only read here). A :class:`ChangeTracker` is shared by the weight all-gathers of one
model; the optimizer-step hooks registered by :func:`qsdp.quantize_comms` tell it when a step
starts and ends. From the counters it knows, per FSDP group and without a device sync:

* whether the group's shard changed since the ranks last agreed (an optimizer step updated it),
* whether it changed *outside* the optimizer's step (a hand-written or functional update, an EMA
  swap, a load, an edit), so that the weight-difference replicas must be re-established with
  exact values instead of a 4-bit difference of what may be a jump as large as the weights.

What the counters cannot see: a write through ``.data`` or ``set_``, through another view, from
outside Python, and torch's ``_foreach_*`` in-place ops on DTensors (which bump no counter of the
DTensor nor of its local tensor; an optimizer's own step is known from its hook instead). Those
are caught by a fingerprint of the shards (:mod:`qsdp.comm.fingerprint`), taken at the agreement
of every forward run without gradients (an evaluation: an EMA model, an EMA swapped in) and of
every forward that follows a gradient reduction no optimizer step followed (a hand-written or
functional update), where a shard whose fingerprint moved while no counter or optimizer step
explains it is re-gathered exactly. A training forward after an optimizer's step reads no
fingerprint; there such a change travels inside that step's difference (quantized with it, and
corrected by the differences that follow).

Ranks must take the same path in a weight-difference gather, and one rank may be edited alone, so
the flags of all groups are OR-ed across ranks in one all-reduce, lazily at the first gather of
a forward of the model (:meth:`ChangeTracker.at_forward`, which ``quantize_comms`` calls from a
forward pre-hook of the root: every rank runs the root's forward) that follows a gradient
reduction, an optimizer step, a load or an evaluation, or is one: one tiny collective and one
host read per step (per evaluation forward), whoever changed the weights in between (an
optimizer, a hand-written update, an EMA swap, a load, an edit). A change made between two
training forwards with none of these between (the micro-batches of one step) is seen at the next
forward that follows one. Its numbers go
through pinned memory on a side stream (:mod:`qsdp.comm.host_values`): the host waits for that
exchange alone, not for the optimizer step still running on the device.

Agreeing ahead (:meth:`ChangeTracker.ahead_flags`, :meth:`ChangeTracker.agreed_ahead`): a loop
that already runs one collective after backward (the gradient check of
:func:`qsdp.check_gradients`) can carry the flags in it. The next optimizer step then settles
the agreement on every rank without a collective: the groups it updates changed, as every rank
steps the same optimizer. The promise that makes this safe: until the next forward, the
parameters change only through that optimizer step, on every rank or on none. A change made
outside the optimizer after the check is still seen, at the next agreement (its group travels as
a difference until then, identically on every rank).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .fingerprint import fingerprints
from .host_values import all_reduce_values
from .meter import METER, ByteMeter, peer_entries


def versions(params: list[torch.Tensor]) -> tuple[int, ...]:
    """The version counters of ``params``. For FSDP2's DTensor parameters this is the DTensor's
    own counter: in-place ops on the DTensor bump it (its local tensor's counter does not move)."""
    return tuple(map(_VERSION, params))  # no generator frame: read four times a step per group


_VERSION = operator.attrgetter("_version")


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
        # The shards' fingerprint at the last check, and the counters then (None: no reference).
        self.fingerprint: tuple[int, ...] | None = None
        self.fingerprint_versions: tuple[int, ...] = ()
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
        if concerned:
            self.fingerprint = None  # the step explains any move of the fingerprint
        return concerned

    def check(self, fingerprint: tuple[int, ...], suspect: bool) -> None:
        """Take the shards' ``fingerprint`` (:mod:`qsdp.comm.fingerprint`), read now: one that
        moved since the last check while neither the counters nor an optimizer step changed
        was changed where the counters cannot see; it then counts as changed outside the
        optimizer (re-gathered exactly). Without an earlier fingerprint to compare with, a
        ``suspect`` group (gradients were reduced and no optimizer stepped since: something
        else may have updated it) is taken as changed."""
        now = versions(self.params)
        if self.fingerprint is None:
            moved = suspect
        else:
            moved = fingerprint != self.fingerprint and now == self.fingerprint_versions
        if moved:
            self.outside = self.forced = True
        self.fingerprint, self.fingerprint_versions = fingerprint, now

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
        self._ahead = False  # the next optimizer step was agreed on ahead of it
        self._settled = False  # that step was taken: the forward after it needs no agreement
        self._check = False  # the due agreement also takes the shards' fingerprints
        self._reduced = False  # gradients were reduced and no optimizer has stepped since
        self._forwards = 0  # forwards begun (at_forward)
        self._evaluated_before = False  # the last forward ran without gradients
        self._flags: list[tuple[bool, bool]] = []
        self._control_entries: dict[tuple, tuple] = {}  # the agreement's meter entries (ByteMeter.add)

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
            self._reduced = False
            if self._ahead:
                self._settle_ahead(concerned)
            else:
                self._due = self._stepped = True

    def request(self) -> None:
        """Agree again at the next gather (every rank calls it at the same point)."""
        self._due = True

    def at_forward(self) -> None:
        """A forward of the model begins (every rank runs it): agree at its first gather on what
        changed since the last agreement, whoever changed it, unless the optimizer step just
        taken was agreed on ahead of it (:meth:`agreed_ahead`). A forward without gradients (an
        evaluation) also checks the shards' fingerprints for changes the counters cannot see."""
        evaluating = not torch.is_grad_enabled()
        if self._settled:
            self._settled = False
            self._evaluated_before = evaluating
            return
        # What every rank knows alike says whether the weights may have changed since the last
        # agreement: a gradient reduction (an update may follow it), an evaluation (weights are
        # swapped in and out around one), or an optimizer step or a load (already due). The
        # micro-batches of one step, with no reduction between them, agree once. The first
        # forward's gathers send exact values anyway (no replica yet).
        may_have_changed = self._reduced or evaluating or self._evaluated_before
        self._evaluated_before = evaluating
        self._due = self._due or (self._forwards > 0 and may_have_changed)
        self._forwards += 1
        # Where the counters may miss a change: an evaluation (an EMA's foreach update), or a
        # training step whose update no optimizer hook saw (a hand-written or functional one,
        # whose foreach ops bump no DTensor counter).
        if (not torch.is_grad_enabled() or self._reduced) and any(w.params for w in self.watches):
            self._check = True

    def gradients_reduced(self) -> None:
        """A gradient reduction ran (every rank of the group runs it): an update may follow."""
        self._reduced = True

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
        if self._check:  # local: what it finds joins this rank's flags of the next agreement
            self._take_fingerprints()
        if self._due:
            self._agree(group, device, peers, byte_meter)
        flags, self._flags[index] = self._flags[index], (False, False)
        return flags

    def _take_fingerprints(self) -> None:
        # Local: what it finds joins this rank's flags, which the agreement ORs across ranks.
        for w, fp in zip(self.watches, fingerprints([w.params for w in self.watches])):
            if w.params:
                w.check(fp, self._reduced)
        self._check = self._reduced = False

    def _agree(self, group: dist.ProcessGroup, device: torch.device, peers: tuple[int, int],
               byte_meter: ByteMeter) -> None:
        local = self.ahead_flags()
        agreed = all_reduce_values(local, dist.ReduceOp.MAX, group, device)  # the one host read per forward
        entries = self._control_entries.get((len(local), peers))
        if entries is None:
            entries = self._control_entries[(len(local), peers)] = peer_entries("control", 4 * len(local), 0, *peers)
        byte_meter.add(entries)
        self._take_agreed(agreed)
        self._ahead = False  # agreed now: the next optimizer step is not settled ahead
        self._reduced = False

    def _take_agreed(self, agreed: Sequence[float]) -> None:
        for i, w in enumerate(self.watches):
            changed, stale = self._flags[i]
            self._flags[i] = (changed or agreed[2 * i] > 0, stale or agreed[2 * i + 1] > 0)
            w.agreed()
        self._due = self._stepped = False

    def ahead_flags(self) -> list[int]:
        """This rank's flags, two per group (changed, changed outside the optimizer), to be
        reduced across the ranks by a collective of the caller's (a sum or a maximum) and handed
        to :meth:`agreed_ahead` on every rank."""
        return [int(f) for w in self.watches for f in w.pending(self._stepped)]

    def agreed_ahead(self, agreed: Sequence[float]) -> None:
        """Take the ranks' reduced :meth:`ahead_flags` (every rank calls it with the same values,
        after backward): the next optimizer step needs no agreement of its own (see the module
        doc for the promise this rests on)."""
        self._take_agreed(agreed)
        for w in self.watches:
            w.stepped_at = w.at_agreement  # an edit made before now was agreed on just now
        self._ahead = True

    def _settle_ahead(self, concerned: list[bool]) -> None:
        # The groups the step updated changed, on every rank alike; an edit made between the
        # check and the step stays pending in its watch (``outside``) for the next agreement.
        for i, w in enumerate(self.watches):
            if concerned[i]:
                self._flags[i] = (True, self._flags[i][1])
                w.optimized = False
                w.at_agreement = w.stepped_at
        self._ahead = False
        self._settled = True

    def pending_change(self, index: int) -> bool:
        """Whether group ``index`` has a change its next gather has not sent yet (for a
        checkpoint taken between an optimizer step and the next gather)."""
        return self._flags[index][0] or self.watches[index].pending(self._stepped)[0]
