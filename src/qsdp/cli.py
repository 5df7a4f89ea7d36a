"""The ``qsdp`` command line: ``train``, ``demo``, ``plot`` and ``bench``.

``qsdp train`` validates every input first (arguments, config, data, run directory, checkpoint),
then runs the training job (:func:`qsdp.train.loop.train_worker`):

- under ``torchrun`` (its environment variables are set), directly in this process;
- otherwise in ``--nproc`` local worker processes started by torch's elastic launcher (the
  machinery behind ``torchrun``), with a c10d rendezvous on a free local port.

With ``--max-restarts N`` the elastic launcher restarts the workers up to N times after a failure
(a worker killed, a lost peer); a restarted group resumes from the run's last checkpoint.

A bad input ends with one line ``qsdp: error: ...`` on stderr and exit code 2; a failure inside
the workers ends with one line naming the root cause (the first rank that failed) and exit code
1 (2 if that cause is a bad input), not a traceback from every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from qsdp.launch import under_torchrun
from qsdp.train.files import atomic_write

__all__ = ["main"]

PROG = "qsdp"
EXIT_USAGE = 2


class UsageError(Exception):
    """A bad input found by the command line itself: one line, exit code 2."""


class WorkerFailure(Exception):
    """The workers failed; ``code`` is the exit code, the message the root cause."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: ``qsdp: error: ...`` (exit code 2)."""

    def error(self, message: str):  # type: ignore[override]
        hint = f" (see '{self.prog} --help')"
        self.exit(EXIT_USAGE, f"{PROG}: error: {message}{hint}\n")


def _error(message: str) -> None:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# Arguments


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. weights.bits=4), got {text!r}")
    return key.strip(), _parse_value(value)


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    from qsdp.train.loop import TrainArgs

    d = TrainArgs()
    g = p.add_argument_group("run")
    g.add_argument("--preset", default=d.preset,
                   help=f"communication preset (default {d.preset}): fsdp, qsdp, sdp4bit, zeropp or a variant")
    g.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", type=_override,
                   default=[], help="override a config field, e.g. weights.bits=4 (repeatable)")
    g.add_argument("--model", default=d.model, help=f"model size (default {d.model})")
    g.add_argument("--data", default=None, metavar="FILE.txt",
                   help="UTF-8 text file to train on (default: the embedded chit-chat corpus)")
    g.add_argument("--tokenizer", default=d.tokenizer, help=f"byte or bpe (default {d.tokenizer})")
    g.add_argument("--out", default=d.out, help=f"run directory (default {d.out})")
    g.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/latest")
    g.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=d.steps, help=f"total optimizer steps (default {d.steps})")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step")
    g.add_argument("--seq-len", type=int, default=d.seq_len)
    g.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    g.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    g.add_argument("--warmup", type=int, default=None, help="warmup steps (default 10%% of the schedule, at most 1000)")
    g.add_argument("--decay-steps", type=int, default=None,
                   help="length of the cosine schedule (default --steps)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip, help="0 = off")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--eval-every", type=int, default=d.eval_every, help="0 = only at the end")
    g.add_argument("--eval-batches", type=int, default=d.eval_batches)
    g.add_argument("--log-every", type=int, default=d.log_every)
    g.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="0 = only at the end")
    g.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="0 = keep all")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--cache-dir", default=None, help="token cache (default $QSDP_CACHE_DIR or ~/.cache/qsdp)")
    g = p.add_argument_group("processes")
    g.add_argument("--nproc", type=int, default=None,
                   help="local worker processes to launch (default 1; ignored under torchrun)")
    g.add_argument("--local-world-size", type=int, default=None,
                   help="ranks per node for the two-level reduce-scatter (emulates nodes on one machine)")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="keep the weights gathered between forward and backward (ZeRO-2 like)")
    g.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="cpu (gloo) or cuda (NCCL, one GPU a worker); default cuda if available")
    g.add_argument("--param-dtype", default=None, help="float32 or bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--timeout", dest="timeout_s", type=float, default=None,
                   help="seconds a collective may wait before the job fails (default 600)")
    g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart the local workers up to N times after a failure; a restart resumes "
                        "from the last checkpoint in --out (default 0; under torchrun use its own "
                        "--max-restarts)")
    g = p.add_argument_group("reliability")
    g.add_argument("--on-nonfinite", default=d.on_nonfinite, choices=["skip", "raise"],
                   help="when a rank reduces a NaN/Inf gradient: skip the step on every rank and "
                        "count it (default), or stop the run with an error naming the step")


def _train_args(ns: argparse.Namespace):
    from qsdp.train.loop import TrainArgs

    names = {f.name for f in dataclasses.fields(TrainArgs)}
    kwargs = {k: v for k, v in vars(ns).items() if k in names and v is not None}
    kwargs["overrides"] = dict(ns.overrides)
    return TrainArgs(**kwargs)


# ---------------------------------------------------------------------------------------------
# Validation


def _check_writable(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create --out directory {out!r}: {e.strerror or e}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=out, prefix=".qsdp-write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"--out directory {out!r} is not writable: {e.strerror or e}") from None


def _validate_train(args, nproc: int | None, *, full: bool, max_restarts: int = 0) -> int:
    """Check every input of a run before anything starts; returns the world size. ``full``
    also builds the dataset (and its caches) here, in the launching process."""
    from qsdp.train.data import load_corpus
    from qsdp.train.loop import check_out_dir, check_resume, prepare_dataset, restart_count, validate_args

    validate_args(args)
    if max_restarts < 0:
        raise UsageError(f"--max-restarts must be a non-negative integer, got {max_restarts}")
    if under_torchrun() and max_restarts:
        raise UsageError("--max-restarts is for the workers qsdp launches; under torchrun pass "
                         "torchrun's own --max-restarts")
    if under_torchrun():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if nproc is not None and nproc != world:
            raise UsageError(f"--nproc {nproc} conflicts with torchrun's WORLD_SIZE={world}; "
                             "leave --nproc out under torchrun")
    else:
        world = 1 if nproc is None else nproc
        if world < 1:
            raise UsageError(f"--nproc must be a positive number of processes, got {world}")
        import torch

        from qsdp.train.loop import use_cuda

        if use_cuda(args) and world > torch.cuda.device_count():
            raise UsageError(f"--nproc {world} needs {world} GPUs (one a worker); this machine has "
                             f"{torch.cuda.device_count()}")
    lws = args.local_world_size
    if lws is not None and world % lws:
        raise UsageError(f"--local-world-size {lws} must divide the number of processes {world} "
                         "(ranks per node x nodes)")
    _check_writable(args.out)
    if full:
        _, data_id = prepare_dataset(args)
    else:
        load_corpus(args.data)
        data_id = None
    if restart_count() > 0:
        pass  # torchrun restarted this worker: the job resumes from the run's own checkpoint
    elif args.resume:
        check_resume(args, world, data_id)
    else:
        check_out_dir(args)
    return world


# ---------------------------------------------------------------------------------------------
# Launching workers


def _worker_entry(args, error_dir: str) -> dict[str, Any] | None:
    """What each launched worker runs (top level, so the spawn start method can pickle it)."""
    from qsdp.train.loop import PeerError, USER_ERRORS, train_worker

    try:
        summary = train_worker(args)
        return summary if int(os.environ.get("RANK", "0")) == 0 else None
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the launcher
        rank = int(os.environ.get("RANK", "-1"))
        record = {
            "rank": rank, "time": time.time(), "type": type(e).__name__, "message": str(e),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "user": isinstance(e, USER_ERRORS), "secondary": isinstance(e, PeerError),
            "traceback": traceback.format_exc(),
        }
        with contextlib.suppress(OSError):
            path = Path(error_dir) / f"rank{rank}.attempt{record['attempt']}.json"
            atomic_write(path, lambda f: f.write(json.dumps(record).encode("utf-8")))
        # Exit quietly: the launcher prints the root cause once. os._exit skips the interpreter's
        # teardown, where a process group whose peer died can abort in its C++ threads
        # ("terminate called without an active exception") and print a wall of noise.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


@contextlib.contextmanager
def _quiet_elastic_logs():
    names = ["torch.distributed.elastic", "torch.distributed.launcher",
             "torch.distributed.elastic.multiprocessing.api",
             "torch.distributed.elastic.agent.server.api", "torch.multiprocessing",
             "torch.multiprocessing.spawn"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _root_cause(error_dir: Path, failures: dict[int, Any], out: str) -> WorkerFailure:
    records = []
    for p in error_dir.glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(p.read_text(encoding="utf-8")))
    if records:
        last = max(r.get("attempt", 0) for r in records)  # with --max-restarts: the final attempt
        records = [r for r in records if r.get("attempt", 0) == last]
        r = min(records, key=lambda r: (r["secondary"], r["time"], not r["user"]))
        if r["user"]:
            return WorkerFailure(r["message"], EXIT_USAGE)
        where = ""
        with contextlib.suppress(OSError):
            path = Path(out) / "error.txt"
            path.write_text(r["traceback"], encoding="utf-8")
            where = f" (traceback: {path})"
        return WorkerFailure(f"rank {r['rank']}: {r['type']}: {r['message']}{where}")
    for rank, f in sorted(failures.items()):
        how = f"killed by {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"
        return WorkerFailure(f"worker rank {rank} died ({how}) without reporting an error")
    return WorkerFailure("the workers failed without reporting an error")


def _launch(args, nproc: int, max_restarts: int = 0) -> dict[str, Any]:
    """Run ``train_worker(args)`` in ``nproc`` local processes (restarted up to
    ``max_restarts`` times; a restarted group resumes from the run's last checkpoint); returns
    rank 0's summary."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from qsdp.launch import launch_local

    # torchrun's default is one thread per worker; here the machine's cores shared by the workers.
    env_threads = "OMP_NUM_THREADS" not in os.environ
    if env_threads:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    error_dir = Path(tempfile.mkdtemp(prefix="qsdp-errors-"))
    try:
        with _quiet_elastic_logs():
            results = launch_local(_worker_entry, nproc, args, str(error_dir), max_restarts=max_restarts)
    except ChildFailedError as e:
        raise _root_cause(error_dir, e.failures, args.out) from None
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
        if env_threads:
            os.environ.pop("OMP_NUM_THREADS", None)
    return results[0]


def run_training(args, nproc: int | None = None, max_restarts: int = 0) -> dict[str, Any]:
    """Validate and run one training job (the ``qsdp train`` command without the printing);
    returns the summary. Raises UsageError / the loop's user errors / WorkerFailure."""
    from qsdp.train.loop import train_worker

    if under_torchrun():
        _validate_train(args, nproc, full=False, max_restarts=max_restarts)
        return train_worker(args)
    world = _validate_train(args, nproc, full=True, max_restarts=max_restarts)
    return _launch(args, world, max_restarts)


# ---------------------------------------------------------------------------------------------
# Commands


def _cmd_train(ns: argparse.Namespace) -> int:
    args = _train_args(ns)
    summary = run_training(args, ns.nproc, ns.max_restarts)
    if int(os.environ.get("RANK", "0")) == 0:
        notes = ""
        if summary.get("nonfinite_skipped"):
            notes += f", {summary['nonfinite_skipped']} steps skipped (non-finite gradients)"
        if summary.get("restarts"):
            start = summary["start_step"]
            notes += (f", {summary['restarts']} restart(s) (resumed from step {start})" if start
                      else f", {summary['restarts']} restart(s) (no checkpoint yet: started again)")
        print(f"{PROG}: done: {summary['steps']} steps of {args.model} with {summary['config']['name']}, "
              f"final val loss {summary['final_val_loss']:.4f}, "
              f"{_fmt_bytes(summary['wire_bytes_total'])} on the wire{notes}; run in {args.out}")
    return 0


DEMO_PRESETS = ("fsdp", "qsdp", "sdp4bit")
# Measured on an idle 2-core CPU machine: the three runs of 4 workers take about 2 minutes
# (about 6 under heavy load from other jobs), and the byte-level loss falls from ln(256) = 5.5
# to about 2.4.
DEMO_DEFAULTS = dict(model="tiny", steps=150, batch_size=8, seq_len=64, lr=3e-3, warmup=20,
                     eval_every=50, eval_batches=8, ckpt_every=0, keep_checkpoints=1, log_every=1)
_DEMO_ARTIFACTS = ("metrics.jsonl", "summary.json", "checkpoints", "error.txt")


def _cmd_demo(ns: argparse.Namespace) -> int:
    from qsdp.train.loop import TrainArgs
    from qsdp.train.plots import plot_runs

    if under_torchrun():
        raise UsageError("qsdp demo launches its own workers; run it without torchrun")
    nproc, lws = 4, 2
    opts = {**DEMO_DEFAULTS, **({"steps": ns.steps} if ns.steps is not None else {})}
    runs = {p: TrainArgs(preset=p, out=os.path.join(ns.out, p), local_world_size=lws,
                         param_dtype="bfloat16", device="cpu", cache_dir=ns.cache_dir, **opts)
            for p in DEMO_PRESETS}
    _check_writable(ns.out)
    for p, args in runs.items():  # validate all three before the first one starts
        for name in _DEMO_ARTIFACTS:  # the demo owns these: a new demo replaces an old one
            path = Path(args.out) / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        _validate_train(args, nproc, full=p == DEMO_PRESETS[0])
    print(f"{PROG} demo: GPT '{opts['model']}' on the chit-chat corpus (byte tokenizer), "
          f"{opts['steps']} steps, {nproc} workers as 2 nodes x {lws} ranks (gloo, CPU), "
          f"bf16 weights, presets {', '.join(DEMO_PRESETS)}", flush=True)
    summaries = {}
    t0 = time.perf_counter()
    for i, (p, args) in enumerate(runs.items(), 1):
        print(f"[{i}/{len(runs)}] {p} -> {args.out}", flush=True)
        summaries[p] = _launch(args, nproc)
    elapsed = time.perf_counter() - t0
    print()
    print(_demo_table(summaries))
    plots = plot_runs([a.out for a in runs.values()], ns.out)
    print(f"\nwall time {elapsed:.0f} s. Plots: {', '.join(plots)}")
    print(f"Runs (metrics.jsonl, summary.json, checkpoints/): "
          f"{', '.join(a.out for a in runs.values())}")
    return 0


def _fmt_bytes(n: float) -> str:
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _demo_table(summaries: dict[str, dict[str, Any]]) -> str:
    base = summaries.get("fsdp")
    head = ["preset", "val loss", "vs fsdp", "bits/elt weights", "grads intra", "grads inter",
            "bytes on wire", "reduction", "step (median)"]
    rows = [head]
    for p, s in summaries.items():
        w, g = s["wire"]["weights"], s["wire"]["grads"]
        gap = reduction = "-"
        if base is not None:
            gap = f"{100 * (s['final_val_loss'] / base['final_val_loss'] - 1):+.2f}%"
            reduction = f"{base['wire_bytes_total'] / s['wire_bytes_total']:.2f}x" if s["wire_bytes_total"] else "-"
        rows.append([
            p, f"{s['final_val_loss']:.4f}", gap,
            f"{w['total']['bits_per_element']:.2f}", f"{g['intra']['bits_per_element']:.2f}",
            f"{g['inter']['bits_per_element']:.2f}", _fmt_bytes(s["wire_bytes_total"]), reduction,
            f"{1000 * s['median_step_time_s']:.0f} ms",
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(wd) if i == 0 else c.rjust(wd) for i, (c, wd) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * wd for wd in widths))
    return "\n".join(lines)


def _cmd_plot(ns: argparse.Namespace) -> int:
    from qsdp.train.metrics import METRICS_FILE
    from qsdp.train.plots import plot_runs

    run_dirs: list[str] = []
    for d in ns.dirs:
        path = Path(d)
        if path.is_dir() and not (path / METRICS_FILE).is_file():
            # A directory of runs (like runs/demo): plot the runs inside it.
            inner = sorted(str(c) for c in path.iterdir() if (c / METRICS_FILE).is_file())
            if inner:
                run_dirs += inner
                continue
        run_dirs.append(d)
    out = ns.out
    if out is None:
        if len(ns.dirs) == 1 and Path(ns.dirs[0]).is_dir():
            out = ns.dirs[0]
        else:
            common = os.path.commonpath([os.path.abspath(d) for d in run_dirs])
            out = os.path.dirname(common) if common in map(os.path.abspath, run_dirs) else common
    try:
        paths = plot_runs(run_dirs, out)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    for p in paths:
        print(p)
    return 0


BENCHMARKS = {
    "volume": "qsdp.bench.volume",
    "simulate": "qsdp.bench.simulate",
    "cluster": "qsdp.bench.cluster",
    "kernels": "qsdp.bench.kernels",
    "convergence": "qsdp.bench.convergence",
    "soak": "qsdp.bench.soak",
}


def _cmd_bench(ns: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS.get(ns.bench, "qsdp.advise"))
    try:
        rc = module.main(ns.bench_args)
    except SystemExit as e:  # its own argparse: --help, usage errors
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    return int(rc or 0)


def _parser() -> _Parser:
    import qsdp

    p = _Parser(prog=PROG, description="Quantized sharded data parallel training (FSDP2 + 8/4-bit comms).")
    p.add_argument("--version", action="version", version=f"%(prog)s {qsdp.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    t = sub.add_parser("train", help="train a GPT with quantized FSDP2 communication",
                       description="Train a GPT with FSDP2 and qsdp's quantized collectives.")
    _add_train_arguments(t)
    t.set_defaults(func=_cmd_train)

    d = sub.add_parser("demo", help="fsdp vs qsdp vs sdp4bit on 4 local CPU workers",
                       description="Train a tiny GPT with fsdp, qsdp and sdp4bit on 4 local workers "
                                   "(2 emulated nodes x 2 ranks) and compare loss, bytes and step time.")
    d.add_argument("--out", default="runs/demo", help="demo directory (default runs/demo)")
    d.add_argument("--steps", type=int, default=None, help=f"steps per run (default {DEMO_DEFAULTS['steps']})")
    d.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    d.set_defaults(func=_cmd_demo)

    pl = sub.add_parser("plot", help="loss curves of runs (PNG)",
                        description="Plot loss vs step and loss vs bytes on the wire of one or more runs.")
    pl.add_argument("dirs", nargs="+", metavar="DIR", help="run directories (or a directory of runs)")
    pl.add_argument("--out", default=None, help="where the PNGs go (default: the runs' parent directory)")
    pl.set_defaults(func=_cmd_plot)

    a = sub.add_parser("advise", help="does quantization pay for this job: predicted steps, a recommendation",
                       add_help=False, prefix_chars="\0")  # every argument goes to qsdp.advise
    a.add_argument("advise_args", nargs=argparse.REMAINDER)
    a.set_defaults(func=lambda ns: _cmd_bench(argparse.Namespace(bench="advise", bench_args=ns.advise_args)))

    b = sub.add_parser("bench", help="benchmarks", description="Benchmarks of qsdp.")
    b.add_argument("bench", choices=sorted(BENCHMARKS), help="which benchmark")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="its arguments")
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The ``qsdp`` command; returns the exit code."""
    from qsdp.train.loop import USER_ERRORS, CollectiveTimeoutError, NonFiniteGradientError, PeerError

    try:
        ns = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
    # Under torchrun every rank validates the same inputs: one line per node, not per rank.
    speak = not under_torchrun() or os.environ.get("LOCAL_RANK", "0") == "0"
    try:
        return ns.func(ns)
    except (UsageError, *USER_ERRORS) as e:
        if speak:
            _error(str(e))
        return EXIT_USAGE
    except WorkerFailure as e:
        _error(str(e))
        return e.code
    except PeerError:
        return 1  # under torchrun: the rank that failed first reports the cause
    except (NonFiniteGradientError, CollectiveTimeoutError) as e:  # under torchrun: a run-time stop
        if speak:
            _error(f"rank {os.environ.get('RANK', '0')}: {type(e).__name__}: {e}")
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except Exception as e:  # the elastic launcher's SignalException (SIGTERM, SIGINT)
        if type(e).__name__ == "SignalException":
            _error(f"interrupted ({e})")
            return 130
        raise


if __name__ == "__main__":
    sys.exit(main())
