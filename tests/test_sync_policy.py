"""Host syncs made by qsdp during a training step: at most one per step, in the library and in
``qsdp train``.

Every way of reading a tensor's value on the host or waiting for the device is wrapped, and a
call made from qsdp's own modules is logged: on CPU tensors some of these are no device sync,
but each would be one on a GPU, so each counts, whatever the device. A planted read of each kind
shows that the count sees it. On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` around
steady-state steps catches any sync, qsdp's or torch's.
"""

from __future__ import annotations

import sys

import pytest
import torch

import qsdp
from distributed import run_pooled
import fsdp_models as fm

pytestmark = pytest.mark.timeout(240)

# Each reads a value on the host (or waits for the device): float(t), int(t), bool(t) and
# range(t) go through the dunders, print(t) and f"{t}" through __repr__ and __format__.
_READS = [
    (torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.Tensor, "__bool__"), (torch.Tensor, "__float__"),
    (torch.Tensor, "__int__"), (torch.Tensor, "__index__"), (torch.Tensor, "cpu"), (torch.Tensor, "numpy"),
    (torch.Tensor, "__array__"), (torch.Tensor, "__repr__"), (torch.Tensor, "__format__"), (torch, "equal"),
    (torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"),
]


def _count_qsdp_reads(log: list[str]) -> None:
    """Wrap every read so that calls made from qsdp's own modules are logged (in a child
    process: the patches die with it)."""
    for owner, name in _READS:
        original = getattr(owner, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller == "qsdp" or caller.startswith("qsdp."):
                log.append(f"{_name} from {caller}")
            return _original(*args, **kwargs)

        setattr(owner, name, wrapped)


def _step(model, opt, step, rank, check=None):
    x, y = fm.batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if check is None or not check(loss):
        opt.step()
    opt.zero_grad()


def _reads_per_step(rank, world, preset, checked, steps=3, plant=None):
    """The reads logged in each of ``steps`` steady-state steps; ``checked``: after backward,
    ``None`` (a plain loop), ``"nonfinite"`` (``handle.nonfinite_gradients()``) or ``"norm"``
    (``qsdp.check_gradients`` with the gradient norm, clipping and the loss)."""
    model = fm.build(depth=3)  # 4 FSDP groups
    handle = qsdp.quantize_comms(model, preset)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def check(loss):
        if checked == "nonfinite":
            return handle.nonfinite_gradients()
        params = list(model.parameters())
        result = qsdp.check_gradients(handle, params, sums=[loss.detach()], agree_ahead=True)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, result.norm)
        return result.nonfinite

    for step in range(2):  # warm-up: replicas established, one ordinary step done
        _step(model, opt, step, rank, check if checked else None)
    if plant is not None:
        plant()
    log: list[str] = []
    _count_qsdp_reads(log)
    per_step = []
    for step in range(steps):
        _step(model, opt, 10 + step, rank, check if checked else None)
        per_step.append(list(log))
        log.clear()
    return per_step


@pytest.mark.parametrize("preset,expected", [
    ("fsdp", []), ("qsdp", []), ("zeropp", []),
    # the weight-difference gathers' agreement, for all groups at once, at the first gather
    ("sdp4bit", ["tolist from qsdp.comm.host_values"]),
])
def test_a_plain_training_step_reads_at_most_once_inside_qsdp(preset, expected):
    for per_step in run_pooled(_reads_per_step, 4, preset, None, local_world_size=2):
        assert per_step == [expected] * 3


@pytest.mark.parametrize("checked", ["nonfinite", "norm"])
@pytest.mark.parametrize("preset", ["fsdp", "sdp4bit"])
def test_a_checked_step_reads_once_the_agreement_riding_in_the_check(preset, checked):
    # The check's one read carries the non-finite flags, the norm, the loss and, for sdp4bit,
    # the agreement of the coming optimizer step: the next forward reads nothing.
    for per_step in run_pooled(_reads_per_step, 4, preset, checked, local_world_size=2):
        assert per_step == [["tolist from qsdp.gradient_check"]] * 3


_PLANTED = {
    "item": "t.item()", "tolist": "t.tolist()", "float": "float(t)", "int": "int(t)", "bool": "bool(t)",
    "cpu": "t.cpu()", "numpy": "t.numpy()", "print": "print(t)", "format": "f'{t}'",
    "synchronize": "torch.cuda.synchronize()",
}


def _plant_in_the_reduce_scatter(kind: str):
    """A read of kind ``kind`` in qsdp.comm.base's code, run by every reduce-scatter."""
    from qsdp.comm.base import GradReduceScatter

    def plant():
        scope = {"__name__": "qsdp.comm.base", "torch": torch}
        # torch.cuda.synchronize fails without CUDA: the call is what counts.
        exec(f"def read(t):\n    try:\n        {_PLANTED[kind]}\n    except Exception:\n        pass\n", scope)
        watch = GradReduceScatter.watch

        def watch_and_read(self, output):
            scope["read"](output.detach().sum())
            return watch(self, output)

        GradReduceScatter.watch = watch_and_read

    return plant


@pytest.mark.parametrize("kind", sorted(_PLANTED))
def test_the_count_fails_a_step_with_a_planted_host_read(kind):
    per_step = run_pooled(_reads_per_step, 2, "fsdp", "nonfinite", 1, _plant_in_the_reduce_scatter(kind))[0]
    (reads,) = per_step
    assert len(reads) > 1  # the policy's "at most one" fails
    assert any(r.endswith("from qsdp.comm.base") for r in reads)


def _trainer_reads(rank, world, args, steps):
    from qsdp.train.loop import _worker_plan, validate_args
    from qsdp.train.trainer import Trainer

    config = validate_args(args)
    dataset, plan = _worker_plan(args, None, config, rank, world)
    trainer = Trainer(args, plan, dataset, torch.device("cpu"))
    for step in (1, 2):  # warm-up
        trainer.log(step, trainer.train_step(step))
    log: list[str] = []
    _count_qsdp_reads(log)
    per_step = []
    for step in range(3, 3 + steps):
        trainer.log(step, trainer.train_step(step))
        per_step.append(list(log))
        log.clear()
    return per_step


@pytest.mark.parametrize("preset,world,hsdp", [("sdp4bit", 2, False), ("fsdp", 2, False), ("hsdp4", 4, True)])
def test_qsdp_train_reads_once_per_step_logging_included(preset, world, hsdp, corpus, tmp_path, monkeypatch):
    from qsdp.train.loop import TrainArgs

    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path / "cache"))
    args = TrainArgs(preset=preset, out=str(tmp_path / "run"), data=corpus, model="tiny", steps=6, batch_size=2,
                     seq_len=32, eval_every=0, ckpt_every=0, log_every=1, progress=False, hsdp=hsdp,
                     local_world_size=2 if hsdp else None)
    for per_step in run_pooled(_trainer_reads, world, args, 3, local_world_size=2, timeout=200):
        assert per_step == [["tolist from qsdp.gradient_check"]] * 3


def _rank_local_optimizer(rank, world):
    model = fm.build(depth=3)
    qsdp.quantize_comms(model, "sdp4bit")
    probe = torch.nn.Linear(4, 1)  # rank 0's own model: its optimizer sees none of the shards
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = fm.batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank == 0:  # between the forward's gathers and the backward's
            probe(torch.ones(4)).sum().backward()
            probe_opt.step()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


def test_an_optimizer_of_one_rank_alone_starts_no_agreement():
    # Were rank 0's probe step taken for a change, its next gather would agree alone: a hang.
    params = run_pooled(_rank_local_optimizer, 2, timeout=60)
    for a, b in zip(*params):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ on CUDA: no sync at all


def _no_sync_in_steady_state(rank, world, args):
    """Steady-state steps of ``qsdp train`` under ``set_sync_debug_mode("error")``: any host
    sync, qsdp's or torch's, raises. One check read per step remains: it is a copy to the host
    that waits on the device, so it is taken outside the error mode."""
    from qsdp.train.loop import _worker_plan, validate_args
    from qsdp.train.trainer import Trainer

    config = validate_args(args)
    dataset, plan = _worker_plan(args, None, config, rank, world)
    trainer = Trainer(args, plan, dataset, torch.device("cuda", rank))
    for step in (1, 2):
        trainer.log(step, trainer.train_step(step))
    import qsdp.gradient_check as gc

    check, reads = gc.check_gradients, []

    def check_outside_the_error_mode(*a, **kw):
        torch.cuda.set_sync_debug_mode(0)
        try:
            reads.append(1)
            return check(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    qsdp.check_gradients = check_outside_the_error_mode
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in (3, 4, 5):
            trainer.log(step, trainer.train_step(step))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return len(reads)


def _gpu_args(tmp_path, preset):
    from qsdp.train.data import sample_corpus_path
    from qsdp.train.loop import TrainArgs

    # The sample text shipped in the package: a GPU machine may lack the corpus extra.
    return TrainArgs(preset=preset, out=str(tmp_path / "run"), data=str(sample_corpus_path()), model="tiny",
                     steps=6, batch_size=2, seq_len=32, eval_every=0, ckpt_every=0, log_every=1, progress=False,
                     device="cuda", backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("preset", ["fsdp", "sdp4bit"])
def test_on_cuda_steady_state_steps_of_qsdp_train_sync_only_in_the_check(preset, tmp_path, monkeypatch):
    # NCCL runs one rank a GPU: as many ranks as GPUs, up to 2 (with one, FSDP2 calls no comm).
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path / "cache"))
    world = min(2, torch.cuda.device_count())
    reads = run_pooled(_no_sync_in_steady_state, world, _gpu_args(tmp_path, preset),
                      start_method="spawn", backend="nccl", timeout=240)
    assert reads == [3] * world
