"""Resuming on another layout: ``qsdp train --resume`` on 4 -> 3 -> 4 ranks (sdp4bit, 2 nodes
x 2, then 3 nodes x 1, then 2 x 2 again), under ``--hsdp`` from 2 replicas to 1 and back, and
``load_checkpoint`` in a loop of one's own. At each load the gathered weights and optimizer
state equal the checkpoint's bit for bit, the first gathers deliver exactly those weights, the
loss curve continues the uninterrupted run's at the same global batch, and the data stream
continues from the samples already drawn. The global batch is kept on any number of ranks: in
shares that differ by one sequence, weighted so that the gradient is the global batch's mean,
and in micro-batches no larger than the run's per-rank batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import fsdp_models as fm
import qsdp
from distributed import run_pooled
from qsdp.train.args import validate_args
from qsdp.train.checkpoint import latest_checkpoint, load_checkpoint, read_meta, save_checkpoint
from qsdp.train.loop import TrainArgs, _worker_plan
from qsdp.train.metrics import read_metrics
from qsdp.train.trainer import Trainer

# Measured with these settings (torch 2.13, CPU): the resumed curves stay within 0.0020 (sdp4bit,
# 4 -> 3 -> 4 ranks, 6 steps) and 0.0076 (HSDP, 2 -> 1 -> 2 replicas) of the uninterrupted one,
# at losses of 3.4 to 5.6; the bound leaves room for another machine's rounding.
LOSS_GAP = 0.05


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qsdp-cache"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)


def _args(out, corpus, **kw) -> TrainArgs:
    base = dict(out=str(out), data=corpus, model="tiny", preset="sdp4bit", steps=9, decay_steps=9, batch_size=2,
                seq_len=16, lr=3e-3, eval_every=0, eval_batches=2, ckpt_every=3, keep_checkpoints=0,
                progress=False)
    return TrainArgs(**{**base, **kw})


def _full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """The whole model and optimizer state, gathered (collective), by flat name."""
    options = StateDictOptions(full_state_dict=True)
    state = {f"model.{k}": v for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, optimizer, options=options)["state"]
    state.update({f"optim.{name}.{k}": v for name, kv in optim.items() for k, v in kv.items()})
    return {k: v.detach().clone() for k, v in state.items()}


def _checkpoint_state(path, tmp_path) -> dict[str, torch.Tensor]:
    """A checkpoint's model and optimizer state as whole tensors, read without a process group."""
    file = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(file))
    saved = torch.load(file, weights_only=False)
    state = {f"model.{k}": v for k, v in saved["model"].items()}
    # The optimizer state is saved flattened: "state.{parameter}.{entry}" (qsdp.train.parts).
    state.update({f"optim.{k.removeprefix('state.')}": v for k, v in saved["optim"].items() if k.startswith("state.")})
    return state


class FirstGathers:
    """What every FSDP group's first training forward received from its all-gather."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.hooks = []
        for prefix, module in model.named_modules():
            if isinstance(module, FSDPModule):
                self.hooks.append(module.register_forward_pre_hook(self._hook(prefix)))

    def _hook(self, prefix: str):
        def record(module, _inputs):
            for name, p in module.named_parameters():  # gathered: a plain tensor, no longer a DTensor
                key = f"model.{prefix + '.' if prefix else ''}{name}"
                if not isinstance(p, DTensor) and key not in self.weights:
                    self.weights[key] = p.detach().clone()
        return record

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def _observed_run(rank, world, args, observe_data=False):
    """The training job of :func:`qsdp.train.loop.train_worker`, observed: the state right after
    the load (rank 0's), whether the first gathers delivered it, and each step's input rows."""
    dataset, plan = _worker_plan(args, None, validate_args(args), rank, world)
    args = plan.run_args(args)
    dist.barrier()
    trainer = Trainer(args, plan, dataset, torch.device("cpu"))
    loaded = _full_state(trainer.model, trainer.optimizer)
    first = FirstGathers(trainer.model)
    inputs: list[np.ndarray] = []
    if observe_data:
        trainer.model.register_forward_pre_hook(
            lambda m, a: inputs.append(a[0].numpy().copy()) if m.training else None)
    trainer.fit()
    first.close()
    delivered = sorted(k for k, v in first.weights.items() if torch.equal(v, loaded[k]))
    return {"loaded": loaded if rank == 0 else None, "gathered": sorted(first.weights), "exact": delivered,
            "batch_size": args.batch_size, "start": plan.resume_from, "inputs": inputs,
            "split": trainer.split}


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def _check_loaded(results, checkpoint, tmp_path) -> None:
    """The state at the load is the checkpoint's, bit for bit, and every rank's first gathers
    delivered exactly those weights."""
    expected = _checkpoint_state(checkpoint, tmp_path)
    loaded = results[0]["loaded"]
    assert loaded.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(loaded[k], expected[k])] == []
    for r in results:
        assert r["gathered"] and r["exact"] == r["gathered"]


def _epoch_windows(corpus, seq_len):
    """``{window tokens: window index}`` of the stream's samples (every window distinct)."""
    from qsdp.train.preflight import open_dataset

    ds = open_dataset(TrainArgs(data=corpus, seq_len=seq_len))
    data = ds.tokens[: ds.n_train]
    n = ds.samples_per_epoch(seq_len)
    windows = {bytes(np.asarray(data[i * seq_len:(i + 1) * seq_len], dtype=np.int64)): i for i in range(n)}
    assert len(windows) == n
    return windows, n


# 6 sdp4bit steps of 8 sequences, a checkpoint every 2: 2 on 4 ranks (2 nodes x 2), 2 on 3 (3 x 1),
# 2 on 4 again, against the same 6 steps on 4 ranks uninterrupted.
_EVERY_2 = dict(decay_steps=6, ckpt_every=2)


@pytest.fixture(scope="module")
def resumed_on_3(tmp_path_factory, corpus):
    """A run stopped after step 2 on 4 ranks and resumed on 3 up to step 4: its folder, and what
    each of the 3 ranks observed."""
    run = tmp_path_factory.mktemp("elastic") / "run"
    run_pooled(_observed_run, 4, _args(run, corpus, steps=2, local_world_size=2, **_EVERY_2), local_world_size=2,
               timeout=120)
    three = run_pooled(_observed_run, 3, _args(run, corpus, steps=4, local_world_size=1, resume=True, **_EVERY_2),
                       local_world_size=1, timeout=120)
    return run, three


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
    """The same 6 steps on 4 ranks without a stop: the run's folder."""
    ref = tmp_path_factory.mktemp("elastic") / "ref"
    run_pooled(_observed_run, 4, _args(ref, corpus, steps=6, local_world_size=2, **_EVERY_2), local_world_size=2,
               timeout=120)
    return ref


@pytest.mark.timeout(200)
def test_sdp4bit_resumed_on_3_of_4_ranks_loads_the_state_exactly_and_keeps_the_global_batch(resumed_on_3, tmp_path):
    run, three = resumed_on_3
    _check_loaded(three, run / "checkpoints" / "step_00000002", tmp_path)
    # 8 a step kept: 3, 3 and 2 sequences, in 2 micro-batches of at most the 2 each rank had.
    assert [r["start"].name for r in three] == ["step_00000002"] * 3
    assert {(r["split"].counts, r["split"].accumulation, r["batch_size"]) for r in three} == {((3, 3, 2), 2, 2)}


@pytest.mark.timeout(200)
def test_sdp4bit_resumed_on_4_then_3_then_4_ranks_keeps_the_state_exact_and_continues_the_curve(
        resumed_on_3, uninterrupted, corpus, tmp_path):
    # Back on 4 ranks from the 3 ranks' checkpoint of step 4, up to step 6.
    run, _ = resumed_on_3
    four = run_pooled(_observed_run, 4, _args(run, corpus, steps=6, local_world_size=2, resume=True, **_EVERY_2),
                      local_world_size=2, timeout=120)
    _check_loaded(four, run / "checkpoints" / "step_00000004", tmp_path)
    assert {(r["start"].name, r["split"].counts, r["split"].accumulation) for r in four} == {
        ("step_00000004", (2, 2, 2, 2), 1)}
    a, b = _losses(uninterrupted), _losses(run)
    assert len(a) == len(b) == 6 and a[:2] == b[:2]
    assert max(abs(x - y) for x, y in zip(a, b)) < LOSS_GAP, (a, b)
    assert read_meta(latest_checkpoint(run))["samples"] == 6 * 8


@pytest.mark.timeout(200)
def test_a_resume_on_fewer_ranks_draws_every_sample_of_the_epoch_once_in_micro_batches_no_larger(tmp_path):
    """The inputs the model really received, 4 ranks, then 3 (shares of 3, 3 and 2), then 1 (8
    in 4 micro-batches), cover one epoch exactly, and no forward saw more than the 2 sequences
    each rank drew at the start."""
    corpus = tmp_path / "numbers.txt"
    corpus.write_text("".join(f"{i:05d}," for i in range(144)), encoding="utf-8")  # 864 bytes
    windows, n = _epoch_windows(str(corpus), 16)
    assert n == 48  # 778 train tokens: 48 windows, 6 steps of 8
    common = dict(seq_len=16, model="tiny", eval_batches=1, ckpt_every=2)
    out = tmp_path / "run"
    runs = [run_pooled(_observed_run, 4, _args(out, str(corpus), steps=2, **common), True, timeout=120),
            run_pooled(_observed_run, 3, _args(out, str(corpus), steps=4, resume=True, **common), True, timeout=120),
            run_pooled(_observed_run, 1, _args(out, str(corpus), steps=6, resume=True, **common), True, timeout=120)]
    forwards = [[len(step) for r in res for step in r["inputs"]] for res in runs]
    assert [max(f) for f in forwards] == [2, 2, 2] and [len(f) for f in forwards] == [4 * 2, 3 * 2 * 2, 2 * 4]
    drawn = [windows[bytes(row.astype(np.int64))] for res in runs for r in res
             for step in r["inputs"] for row in step]
    assert len(drawn) == 48 and sorted(drawn) == list(range(n))  # none twice, none skipped
    assert read_meta(latest_checkpoint(out))["samples"] == 48


# --------------------------------------------------------------------------- the weighted gradient


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for name, p in model.named_parameters()}


def _one_process_gradients(args, dataset, start, shares):
    """The gradient of the plain model (no FSDP) at the run's initial weights for the samples
    ``start ..`` drawn in ``shares``: the mean loss of all of them, and the mean of the shares'
    own mean losses (what unweighted data parallelism would average)."""
    from qsdp.train.model import make_gpt

    torch.manual_seed(args.seed)
    model = make_gpt(args.model, dataset.vocab_size, args.seq_len)
    x, y = dataset.samples(start, sum(shares), args.seq_len)
    model(x, y)[1].backward()
    exact = _gradients(model)
    model.zero_grad(set_to_none=True)
    means = [model(xs, ys)[1] for xs, ys in zip(x.split(shares), y.split(shares)) if len(xs)]
    (torch.stack(means).mean()).backward()
    return exact, _gradients(model)


def _step_gradients(rank, world, args, splits):
    """The reduced gradients of the trainer's forward and backward at sample 40, for each of
    ``splits`` (``(global batch, micro-batch bound)``), from the initial weights."""
    from qsdp.train.elastic import split_batch
    from qsdp.train.preflight import Plan, open_dataset

    plan = Plan(config=validate_args(args), world_size=world)
    trainer = Trainer(args, plan, open_dataset(args), torch.device("cpu"))
    trainer.state.samples = 40  # a position inside the stream: step 6 of a global batch of 8
    out = []
    for total, micro in splits:
        trainer.split = split_batch(total, world, micro)
        trainer.forward_backward(step=6)
        out.append({"grads": _gradients(trainer.model), "split": trainer.split,
                    "sizes": trainer.split.micro_sizes(rank)})
        trainer.optimizer.zero_grad(set_to_none=True)
    return out


@pytest.mark.timeout(120)
def test_uneven_shares_are_weighted_so_the_gradient_is_the_global_batch_mean(tmp_path, corpus):
    """3 ranks, plain FSDP gradients (no quantization): 8 sequences as 3, 3, 2 in micro-batches
    of at most 2, and 2 sequences with one rank left without any. The reduced gradient equals
    the one-process gradient of the mean over the same 8 (or 2) sequences; for the 8, it differs
    from the mean of the shares' means that unweighted data parallelism gives."""
    from qsdp.train.preflight import open_dataset

    args = _args(tmp_path / "run", corpus, preset="fsdp")
    per_rank = run_pooled(_step_gradients, 3, args, [(8, 2), (2, 1)], timeout=100)
    dataset = open_dataset(args)
    for case, (total, _) in enumerate([(8, 2), (2, 1)]):
        results = [r[case] for r in per_rank]
        split = results[0]["split"]
        if total == 8:
            assert split.counts == (3, 3, 2) and [r["sizes"] for r in results] == [(2, 1), (2, 1), (1, 1)]
        else:
            assert split.counts == (1, 1, 0) and split.idle_ranks() == 1 and results[2]["sizes"] == (0,)
        exact, unweighted = _one_process_gradients(args, dataset, 40, list(split.counts))
        for r in results:
            assert r["grads"].keys() == exact.keys()
            for name, grad in r["grads"].items():
                torch.testing.assert_close(grad, exact[name], rtol=1e-4, atol=1e-6, msg=name)
        if total == 8:  # the weighting is what makes the difference
            assert max(float((unweighted[k] - exact[k]).abs().max() / exact[k].abs().max()) for k in exact) > 1e-2


# --------------------------------------------------------------------------- what a resume may change


def _written_by(out, corpus, world, **kw) -> None:
    """``out`` holding the checkpoint of step 2 that a run of ``world`` ranks writes (its
    ``trainer.json``; the DCP files are not read before the checks)."""
    from qsdp.train.checkpoint import META_FILE
    from qsdp.train.preflight import Plan, prepare_dataset

    args = _args(out, corpus, **kw)
    plan = Plan(config=validate_args(args), world_size=world, data_id=prepare_dataset(args)[1])
    path = out / "checkpoints" / "step_00000002"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / META_FILE).write_text(__import__("json").dumps({"identity": plan.identity(args), "step": 2}))
    (out / "checkpoints" / "latest").write_text("step_00000002\n")


def _cli(argv, capsys) -> tuple[int, list[str]]:
    from qsdp.cli import main

    rc = main(argv)
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_resume_on_another_layout_keeps_the_global_batch_in_micro_batches_no_larger(tmp_path, corpus):
    from qsdp.train.preflight import preflight

    _written_by(tmp_path, corpus, 4, batch_size=8, local_world_size=2)  # 32 a step
    cases = {3: ((11, 11, 10), 2), 2: ((16, 16), 2), 1: ((32,), 4), 5: ((7, 7, 6, 6, 6), 1), 8: ((4,) * 8, 1)}
    for world, (counts, accumulation) in cases.items():
        args = _args(tmp_path, corpus, batch_size=8, local_world_size=1, resume=True)
        plan = preflight(args, world)
        split = plan.batch_split(plan.run_args(args))
        assert plan.resume_from.name == "step_00000002" and (split.counts, split.accumulation) == (counts, accumulation)
        assert max(max(split.micro_sizes(r)) for r in range(world)) <= 8  # each rank had 8
        assert [sum(split.micro_sizes(r)) for r in range(world)] == list(counts)
        assert plan.identity(plan.run_args(args))["global_batch"] == 32
    args = _args(tmp_path, corpus, batch_size=3, new_global_batch=True, resume=True)
    plan = preflight(args, 2)
    assert plan.batch_split(plan.run_args(args)).counts == (3, 3)


def _refusal_argv(out, corpus) -> list[str]:
    return ["train", "--data", corpus, "--out", str(out), "--model", "tiny", "--preset", "sdp4bit",
            "--steps", "9", "--decay-steps", "9", "--batch-size", "8", "--seq-len", "16", "--eval-every", "0",
            "--eval-batches", "2", "--ckpt-every", "3", "--keep-checkpoints", "0", "--lr", "3e-3", "--no-progress"]


def test_a_global_batch_smaller_than_the_ranks_is_refused_once_before_any_worker_starts(tmp_path, corpus, capsys):
    _written_by(tmp_path, corpus, 2, batch_size=1)  # 2 a step
    rc, lines = _cli([*_refusal_argv(tmp_path, corpus), "--resume", "--nproc", "3", "--max-restarts", "2"], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert "a global batch of 2 sequences, fewer than the 3 ranks (each needs at least one)" in lines[0]
    assert "resume on at most 2 ranks, or pass --new-global-batch" in lines[0]
    assert not (tmp_path / "torchrun_job").exists()  # no worker ran


def test_a_running_job_restarted_on_more_ranks_than_its_global_batch_is_not_refused(tmp_path, corpus, monkeypatch):
    """Refused there, the restart would fail again at every one of the agent's restarts."""
    from qsdp.train.preflight import preflight, record_job

    _written_by(tmp_path, corpus, 2, batch_size=1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    record_job(str(tmp_path))  # the job trained here before it grew to 3 ranks
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    args = _args(tmp_path, corpus, batch_size=1)
    plan = preflight(args, 3)
    split = plan.batch_split(plan.run_args(args))
    assert plan.restarted and plan.resume_from.name == "step_00000002"
    assert split.counts == (1, 1, 0) and split.idle_ranks() == 1


def _four_ranks_then_stop(rank, world, args):
    from qsdp.train.loop import train_worker

    return train_worker(args)["global_batch"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_qsdp_train_resumes_a_4_rank_checkpoint_of_32_a_step_on_3_ranks(tmp_path, corpus, capsys):
    """The command line, as a user meets it: 32 sequences a step on 4 ranks, resumed with
    ``--nproc 3`` (once refused: 3 ranks cannot split 32 evenly)."""
    argv = [*_refusal_argv(tmp_path, corpus), "--steps", "3", "--decay-steps", "3", "--ckpt-every", "2"]
    first = _args(tmp_path, corpus, steps=2, decay_steps=3, batch_size=8, ckpt_every=2)
    assert run_pooled(_four_ranks_then_stop, 4, first, timeout=120) == [32] * 4
    rc, lines = _cli([*argv, "--resume", "--nproc", "3"], capsys)
    assert rc == 0, lines
    summary = __import__("json").loads((tmp_path / "summary.json").read_text())
    assert (summary["start_step"], summary["world_size"], summary["global_batch"]) == (2, 3, 32)
    assert (summary["rank_batches"], summary["micro_batch"], summary["accumulation_steps"]) == ([11, 11, 10], 8, 2)
    assert read_meta(latest_checkpoint(tmp_path))["samples"] == 3 * 32
    assert len(_losses(tmp_path)) == 3


def test_a_resume_still_refuses_another_model_config_data_or_seed_naming_what_may_change(tmp_path, corpus):
    from qsdp.train.args import TrainError
    from qsdp.train.preflight import check_resume, prepare_dataset

    _written_by(tmp_path, corpus, 4)
    other = _args(tmp_path, corpus, resume=True, seed=1, preset="qsdp")
    with pytest.raises(TrainError) as e:
        check_resume(other, 2, prepare_dataset(other)[1])
    message = str(e.value)
    assert "seed: checkpoint 0 != now 1" in message and "config.name: checkpoint 'sdp4bit' != now 'qsdp'" in message
    assert "world_size" not in message.split("(")[0]  # the layout is not a difference
    assert "a resume may change only the number of ranks" in message and "--local-world-size" in message


# --------------------------------------------------------------------------- a loop of one's own


def _own_loop(rank, world, path, resume_from, steps):
    """fully_shard + quantize_comms(sdp4bit) + load_checkpoint, a few Adam steps, a save."""
    model = fm.build(seed=5 if resume_from else 0)  # loaded state must replace other initial values
    handle = qsdp.quantize_comms(model, "sdp4bit")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start, loaded, counters = 0, None, None
    if resume_from:
        start = load_checkpoint(resume_from, model, opt, handle, torch.device("cpu"))["step"]
        counters = handle.state_dict()
    loaded = _full_state(model, opt)
    first = FirstGathers(model)
    for step in range(start, start + steps):
        x, y = fm.batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    first.close()
    save_checkpoint(path, start + steps, model, opt, handle, meta={})
    exact = sorted(k for k, v in first.weights.items() if torch.equal(v, loaded[k]))
    return {"loaded": loaded if rank == 0 else None, "gathered": sorted(first.weights), "exact": exact,
            "counters": counters, "after": handle.state_dict()}


def _versions(state) -> list[int]:
    return [g["version"] for g in state["all_gather"].values()] + [
        g["calls"] for g in state["reduce_scatter"].values()]


@pytest.mark.timeout(200)
def test_load_checkpoint_in_a_loop_of_ones_own_on_4_then_2_then_4_ranks(tmp_path):
    out = tmp_path / "own"
    ckpt = lambda step: out / "checkpoints" / f"step_{step:08d}"  # noqa: E731
    first = run_pooled(_own_loop, 4, str(out), None, 3, local_world_size=2, timeout=90)
    two = run_pooled(_own_loop, 2, str(out), str(ckpt(3)), 3, local_world_size=1, timeout=90)
    _check_loaded(two, ckpt(3), tmp_path)
    four = run_pooled(_own_loop, 4, str(out), str(ckpt(6)), 3, local_world_size=2, timeout=90)
    _check_loaded(four, ckpt(6), tmp_path)
    # Counters go on past the largest any rank of the old layout reached: no rounding stream
    # is used twice.
    for before, after in ((first, two), (two, four)):
        reached = np.max([_versions(r["after"]) for r in before], axis=0)
        assert all(v >= m for r in after for v, m in zip(_versions(r["counters"]), reached))


# --------------------------------------------------------------------------- HSDP


@pytest.mark.slow  # make test keeps the 4 -> 3 -> 4 rank resume; this one adds the replica count
@pytest.mark.timeout(300)
def test_hsdp_resumed_from_2_replicas_to_1_and_back_keeps_the_state_exact(tmp_path, corpus):
    ref, run = tmp_path / "ref", tmp_path / "hsdp"
    common = dict(hsdp=True, local_world_size=2, preset="sdp4bit")
    run_pooled(_observed_run, 4, _args(ref, corpus, **common), local_world_size=2, timeout=150)
    run_pooled(_observed_run, 4, _args(run, corpus, steps=3, **common), local_world_size=2, timeout=150)
    one = run_pooled(_observed_run, 2, _args(run, corpus, steps=6, resume=True, **common), local_world_size=2,
                    timeout=150)
    _check_loaded(one, run / "checkpoints" / "step_00000003", tmp_path)
    two = run_pooled(_observed_run, 4, _args(run, corpus, resume=True, **common), local_world_size=2, timeout=150)
    _check_loaded(two, run / "checkpoints" / "step_00000006", tmp_path)
    a, b = _losses(ref), _losses(run)
    assert a[:3] == b[:3] and max(abs(x - y) for x, y in zip(a, b)) < LOSS_GAP, (a, b)


# --------------------------------------------------------------------------- a node lost under torchrun


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_lost_on_3_emulated_nodes_leaves_2_that_keep_the_global_batch():
    """`qsdp bench faults --cases node-lost --nodes 3`: torchrun agents in network namespaces,
    node 1 killed for good; the 2 nodes left resume and finish with 9 a step as 5 and 4 in 2
    micro-batches of at most the 3 each rank drew, close to the uninterrupted run."""
    from qsdp.bench.cluster import missing_requirements
    from qsdp.bench.faults import VAL_LOSS_TOLERANCE, FaultJob, run_cases

    missing = missing_requirements()
    if missing:
        pytest.skip("needs " + "; ".join(missing))
    job = FaultJob(nodes=3, ranks_per_node=1, batch_size=3, steps=10, ckpt_every=2, fault_step=4, timeout_s=5.0,
                   outage_s=8.0, deadline_s=400.0)
    result = run_cases(["node-lost"], job, log=lambda msg: None)
    (row,) = result["cases"]
    assert (row["final_nodes"], row["final_global_batch"], row["final_rank_batches"]) == (2, 9, [5, 4])
    assert row["final_accumulation_steps"] == 2 and row["restarts"] == 1
    assert abs(row["val_loss_diff"]) < VAL_LOSS_TOLERANCE and row["left_behind_processes"] == 0
    assert result["namespaces_left"] == []  # detection time: the benchmark's to report, on a machine of its own
