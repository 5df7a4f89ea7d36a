"""The ``qsdp`` command line: ``train``, ``demo``, ``plot`` and ``bench``; parsing and dispatch.

``qsdp train`` validates every input first (arguments, config, data, run directory, checkpoint),
then runs the training job (:mod:`qsdp.train.launcher`): under ``torchrun`` (its environment
variables are set) directly in this process, otherwise in ``--nproc`` local worker processes
started by torch's elastic launcher. With ``--max-restarts N`` the workers are restarted up to N
times after a failure; a restarted group resumes from the run's last checkpoint.

A bad input ends with one line ``qsdp: error: ...`` on stderr and exit code 2; a failure inside
the workers ends with one line naming the root cause (the first rank that failed) and exit code
1 (2 if that cause is a bad input), not a traceback from every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path

import qsdp
from qsdp.launch import under_torchrun
from qsdp.overrides import SetOverride, parse_override
from qsdp.train import demo
from qsdp.train.args import (
    BACKENDS,
    DEVICES,
    ON_NONFINITE,
    PARAM_DTYPES,
    USER_ERRORS,
    CollectiveTimeoutError,
    NonFiniteGradientError,
    PeerError,
    TrainArgs,
)
from qsdp.train.checkpoint import PeerLoadError
from qsdp.train.data import TOKENIZER_KINDS
from qsdp.train.launcher import EXIT_USAGE, UsageError, WorkerFailure, run_training
from qsdp.train.launcher import quiet_elastic_logs as _quiet_elastic_logs  # noqa: F401 - compatibility
from qsdp.train.launcher import root_cause as _root_cause  # noqa: F401 - compatibility
from qsdp.train.metrics import METRICS_FILE
from qsdp.train.model import MODEL_SIZES
from qsdp.train.plots import plot_runs
from qsdp.train.runtime import first_to_report
from qsdp.usage import PROG, UsageParser, number

__all__ = ["main", "run_training", "BENCHMARKS"]

# Local worker processes one command may start (more nodes are torchrun's job); the launcher also
# checks that the open-file limit allows them (qsdp.train.launcher.check_open_files).
MAX_NPROC = 1024

# `qsdp bench NAME ARGS...`: each module has `main(argv) -> int` with its own argparse.
BENCHMARKS = {
    "volume": "qsdp.bench.volume",
    "simulate": "qsdp.bench.simulate",
    "cluster": "qsdp.bench.cluster",
    "faults": "qsdp.bench.faults",
    "kernels": "qsdp.bench.kernels",
    "codecs": "qsdp.bench.codecs",
    "codec-share": "qsdp.bench.codec_share",
    "host-time": "qsdp.bench.host_time",
    "memory": "qsdp.bench.memory",
    "phases": "qsdp.bench.phases",
    "census": "qsdp.bench.census",
    "guard": "qsdp.bench.guard_cost",
}
# Benchmarks that only produce this repository's evidence: run from a clone (benchmarks/).
MOVED_TO_REPOSITORY = {"convergence": "python -m benchmarks.convergence", "soak": "python -m benchmarks.soak"}
# `qsdp advise ARGS...` dispatches like a benchmark: its module parses its own arguments.
_MODULES = {**BENCHMARKS, "advise": "qsdp.advise", "presets": "qsdp.preset_table", "check": "qsdp.check.cli"}


_Parser = UsageParser  # a usage error is one line: ``qsdp: error: ...`` (exit code 2)


def _error(message: str) -> None:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()


def _traceback_file(error: BaseException, out: str | None = None) -> str | None:
    """Write ``error``'s traceback to a file, in the run's directory ``out`` when there is one
    (``error.txt``; ``error-rank{R}.txt`` for a rank under torchrun), else (or if that cannot be
    written) a new temporary file; its path, or None if nothing could be written."""
    text = (f"qsdp {qsdp.__version__}: {' '.join(sys.argv)}\n"
            + "".join(traceback.format_exception(type(error), error, error.__traceback__)))
    if out is not None:
        name = f"error-rank{os.environ.get('RANK', '0')}.txt" if under_torchrun() else "error.txt"
        try:
            path = Path(out) / name
            path.write_text(text, encoding="utf-8")
            return str(path)
        except OSError:
            pass
    try:
        fd, path = tempfile.mkstemp(prefix="qsdp-traceback-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    except OSError:
        return None


def _unexpected(error: BaseException, out: str | None = None) -> int:
    """A failure no check foresaw: one line with the path of the full traceback, exit code 1
    (the traceback itself on stderr when no file could be written)."""
    path = _traceback_file(error, out)
    where = f" (traceback: {path})" if path else ""
    message = str(error).strip().splitlines()
    _report(f"unexpected {type(error).__name__}{': ' + message[0] if message else ''}{where}", always=True)
    if path is None:
        sys.stderr.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
        sys.stderr.flush()
    return 1


def _report(message: str, always: bool = False) -> None:
    """Print one error line. Outside torchrun: as it is. Under torchrun, once the job's process
    group existed: the first rank of the job to fail prints it with its rank (whichever node it
    is on; ``always``: every rank prints its own), the others stay quiet; before that (every rank
    checks the same inputs): local rank 0 only, one line a node."""
    if not under_torchrun():
        _error(message)
        return
    first = first_to_report()
    if first is None:
        if always or os.environ.get("LOCAL_RANK", "0") == "0":
            _error(message)
    elif first or always:
        _error(f"rank {os.environ.get('RANK', '?')}: {message}")


def _add_run_group(parser: argparse.ArgumentParser, defaults: TrainArgs) -> None:
    group = parser.add_argument_group("run")
    group.add_argument("--preset", default=defaults.preset,
                       help=f"communication preset (default {defaults.preset}): "
                            f"{', '.join(qsdp.PRESETS)} or a variant")
    group.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action=SetOverride, type=parse_override,
                       default=[], help="override a config field, e.g. weights.bits=4 (repeatable)")
    group.add_argument("--model", default=defaults.model,
                       help=f"model size: {', '.join(MODEL_SIZES)} (default {defaults.model})")
    group.add_argument("--data", default=None, metavar="FILE.txt",
                       help="UTF-8 text file to train on (default: the embedded chit-chat corpus)")
    group.add_argument("--tokenizer", default=defaults.tokenizer,
                       help=f"{' or '.join(TOKENIZER_KINDS)} (default {defaults.tokenizer})")
    group.add_argument("--out", default=defaults.out, help=f"run directory (default {defaults.out})")
    group.add_argument("--resume", action="store_true",
                       help="continue from OUT/checkpoints/latest, on any number of ranks and nodes")
    group.add_argument("--resume-from", metavar="step_XXXXXXXX", default=None,
                       help="continue from this checkpoint of OUT/checkpoints instead of latest (e.g. the "
                            "previous complete one a damaged checkpoint's error names); implies --resume")
    group.add_argument("--new-global-batch", action="store_true",
                       help="on a resume with another number of ranks, train with --batch-size per rank "
                            "instead of keeping the checkpoint's global batch")
    group.add_argument("--seed", type=int, default=defaults.seed)


def _add_optimization_group(parser: argparse.ArgumentParser, defaults: TrainArgs) -> None:
    group = parser.add_argument_group("optimization")
    group.add_argument("--steps", type=int, default=defaults.steps,
                       help=f"total optimizer steps (default {defaults.steps})")
    group.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per rank per step")
    group.add_argument("--seq-len", type=int, default=defaults.seq_len)
    group.add_argument("--lr", type=float, default=defaults.lr, help=f"peak learning rate (default {defaults.lr})")
    group.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    group.add_argument("--warmup", type=int, default=None,
                       help="warmup steps (default 10%% of the schedule, at most 1000)")
    group.add_argument("--decay-steps", type=int, default=None,
                       help="length of the cosine schedule (default --steps)")
    group.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    group.add_argument("--grad-clip", type=float, default=defaults.grad_clip, help="0 = off")


def _add_logging_group(parser: argparse.ArgumentParser, defaults: TrainArgs) -> None:
    group = parser.add_argument_group("logging and checkpoints")
    group.add_argument("--eval-every", type=int, default=defaults.eval_every, help="0 = only at the end")
    group.add_argument("--eval-batches", type=int, default=defaults.eval_batches)
    group.add_argument("--log-every", type=int, default=defaults.log_every)
    group.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every, help="0 = only at the end")
    group.add_argument("--keep-checkpoints", type=int, default=defaults.keep_checkpoints, help="0 = keep all")
    group.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    group.add_argument("--sync-timing", action="store_true",
                       help="wait for the GPU at the end of every step so that step_time_s is that step's "
                            "own (one more host sync per step)")
    group.add_argument("--cache-dir", default=None,
                       help="token cache (default $QSDP_CACHE_DIR or ~/.cache/qsdp)")


def _add_process_group(parser: argparse.ArgumentParser, defaults: TrainArgs) -> None:
    group = parser.add_argument_group("processes")
    group.add_argument("--nproc", type=number(1, MAX_NPROC, integer=True), default=None,
                       help="local worker processes to launch (default 1; ignored under torchrun)")
    group.add_argument("--local-world-size", type=int, default=None,
                       help="ranks per node for the two-level reduce-scatter (emulates nodes on one machine)")
    group.add_argument("--hsdp", action="store_true",
                       help="HSDP: shard inside each node of --local-world-size ranks, replicate across "
                            "the nodes (at least 2) with the config's inter-node all-reduce")
    group.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                       help="keep the weights gathered between forward and backward (ZeRO-2 like)")
    group.add_argument("--device", default=None, choices=DEVICES,
                       help="where tensors live (default cuda if available)")
    group.add_argument("--backend", default=None, choices=BACKENDS,
                       help="process group backend (default nccl on CUDA, gloo on CPU); gloo with "
                            "--device cuda lets several workers share one GPU")
    group.add_argument("--param-dtype", default=None,
                       help=f"{' or '.join(PARAM_DTYPES)} (default: bf16 on CUDA, fp32 on CPU)")
    group.add_argument("--timeout", dest="timeout_s", type=float, default=None,
                       help=f"seconds a collective may wait, and a local worker may go without progress, before the "
                            f"job fails naming the stuck rank (default {defaults.timeout_s:g})")
    group.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="restart the local workers up to N times after a failure; a restart resumes "
                            "from the last checkpoint in --out (default 0; under torchrun use its own "
                            "--max-restarts)")
    group = parser.add_argument_group("reliability")
    group.add_argument("--guard-every", type=int, default=defaults.guard_every, metavar="K",
                       help="the accuracy guard: every K optimizer steps, measure each FSDP group's quantization "
                            "noise on the run's data and give a group over qsdp check's limits more bits from "
                            "then on, on every rank alike (default 0: off; 50 adds about 1%% bytes: docs/check.md)")
    group.add_argument("--on-nonfinite", default=defaults.on_nonfinite, choices=ON_NONFINITE,
                       help="when a rank reduces a NaN/Inf gradient: skip the step on every rank and "
                            "count it (default), or stop the run with an error naming the step")


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainArgs()
    _add_run_group(parser, defaults)
    _add_optimization_group(parser, defaults)
    _add_logging_group(parser, defaults)
    _add_process_group(parser, defaults)


def _train_args(ns: argparse.Namespace) -> TrainArgs:
    names = {f.name for f in dataclasses.fields(TrainArgs)}
    kwargs = {k: v for k, v in vars(ns).items() if k in names and v is not None}
    kwargs["overrides"] = dict(ns.overrides)
    return TrainArgs(**kwargs)


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
        per_rank = summary.get("args", {}).get("batch_size", args.batch_size)
        if per_rank != args.batch_size:
            notes += (f", {per_rank} sequences per rank (not --batch-size {args.batch_size}) to keep the "
                      f"checkpoint's global batch of {per_rank * summary['world_size']}")
        layout = f" as HSDP ({summary['nodes']} nodes x {summary['local_world_size']})" if summary.get("hsdp") else ""
        print(f"{PROG}: done: {summary['steps']} steps of {args.model} with {summary['config']['name']}{layout}, "
              f"final val loss {summary['final_val_loss']:.4f}, "
              f"{demo.format_bytes(summary['wire_bytes_total'])} on the wire{notes}; run in {args.out}")
    return 0


def _plot_dirs(dirs: list[str]) -> list[str]:
    run_dirs: list[str] = []
    for d in dirs:
        path = Path(d)
        if path.is_dir() and not (path / METRICS_FILE).is_file():
            # A directory of runs (like runs/demo): plot the runs inside it.
            inner = sorted(str(c) for c in path.iterdir() if (c / METRICS_FILE).is_file())
            if inner:
                run_dirs += inner
                continue
        run_dirs.append(d)
    return run_dirs


def _cmd_plot(ns: argparse.Namespace) -> int:
    run_dirs = _plot_dirs(ns.dirs)
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


def _cmd_bench(ns: argparse.Namespace) -> int:
    if ns.bench in MOVED_TO_REPOSITORY:
        raise UsageError(f"qsdp bench {ns.bench} produces the repository's evidence and is not installed: run "
                         f"`{MOVED_TO_REPOSITORY[ns.bench]}` from the root of a qsdp clone")
    # Imported by name: only the benchmark asked for is loaded.
    module = importlib.import_module(_MODULES[ns.bench])
    try:
        rc = module.main(ns.bench_args)
    except SystemExit as e:  # its own argparse (--help, a usage error already printed) or a message
        if isinstance(e.code, str):
            raise UsageError(e.code) from None
        rc = e.code
    return int(rc or 0)


def _parser() -> _Parser:
    p = _Parser(prog=PROG, description="Quantized sharded data parallel training (FSDP2 + 8/4-bit comms).")
    p.add_argument("--version", action="version", version=f"%(prog)s {qsdp.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    t = sub.add_parser("train", help="train a GPT with quantized FSDP2 communication",
                       description="Train a GPT with FSDP2 and qsdp's quantized collectives.")
    _add_train_arguments(t)
    t.set_defaults(func=_cmd_train)

    d = sub.add_parser("demo", help=f"{' vs '.join(demo.DEMO_PRESETS)} on {demo.NPROC} local CPU workers",
                       description=f"Train a tiny GPT with {', '.join(demo.DEMO_PRESETS)} on {demo.NPROC} "
                                   f"local workers ({demo.NPROC // demo.RANKS_PER_NODE} emulated nodes x "
                                   f"{demo.RANKS_PER_NODE} ranks) and compare loss, bytes and step time.")
    demo.add_arguments(d)
    d.set_defaults(func=demo.main)

    pl = sub.add_parser("plot", help="loss curves of runs (PNG)",
                        description="Plot loss vs step and loss vs bytes on the wire of one or more runs.")
    pl.add_argument("dirs", nargs="+", metavar="DIR", help="run directories (or a directory of runs)")
    pl.add_argument("--out", default=None, help="where the PNGs go (default: the runs' parent directory)")
    pl.set_defaults(func=_cmd_plot)

    # Commands whose every argument goes to their module's own parser (as a benchmark's does).
    for name, helptext in (("advise", "does quantization pay for this job: predicted steps, a recommendation"),
                           ("presets", "every preset's fields and bits per element on each link"),
                           ("check", "will a preset hurt this model: gradient and weight errors per layer")):
        own = sub.add_parser(name, help=helptext, add_help=False, prefix_chars="\0")
        own.add_argument("bench_args", nargs=argparse.REMAINDER)
        own.set_defaults(func=_cmd_bench, bench=name)

    b = sub.add_parser("bench", help="benchmarks", description="Benchmarks of qsdp.")
    b.add_argument("bench", choices=sorted({**BENCHMARKS, **MOVED_TO_REPOSITORY}), help="which benchmark")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="its arguments")
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The ``qsdp`` command; returns the exit code."""
    try:
        ns = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        if isinstance(e.code, str):
            _error(e.code)
            return EXIT_USAGE
        return int(e.code or 0)
    out = getattr(ns, "out", None) if getattr(ns, "command", None) == "train" else None
    try:
        return ns.func(ns)
    except (UsageError, *USER_ERRORS) as e:
        _report(str(e))
        return EXIT_USAGE
    except WorkerFailure as e:
        _error(str(e))
        if e.traceback:  # its traceback file could not be written: the traceback itself
            sys.stderr.write(e.traceback)
            sys.stderr.flush()
        return e.code
    except (PeerError, PeerLoadError):
        return 1  # under torchrun: the rank that failed first reports the cause
    except (NonFiniteGradientError, CollectiveTimeoutError) as e:  # under torchrun: a run-time stop
        _report(f"{type(e).__name__}: {e}")
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except SystemExit as e:  # a message, or an exit code with its message already printed
        if isinstance(e.code, str):
            _report(e.code)
            return EXIT_USAGE
        return int(e.code or 0)
    except Exception as e:
        if type(e).__name__ == "SignalException":  # the elastic launcher's (SIGTERM, SIGINT)
            _error(f"interrupted ({e})")
            return 130
        return _unexpected(e, out)

if __name__ == "__main__":
    sys.exit(main())
