"""``python -m benchmarks.gpu_report`` (``make gpu-report``): every GPU measurement, stage by stage.

For a CUDA host at hand for a short while, where torch, Triton and pytest are installed and no
package registry is reachable. The stages (:data:`STAGES`), in priority order, each run as its
own process within a time budget of its own (stopped at worst, it fits :data:`MAX_STAGE_S`, 5
minutes), their budgets and stopping graces summing to at most :data:`TOTAL_BUDGET_S` (25
minutes, the first compilations included), so that two or three commands of 10 minutes
(``--next --budget``) run them all. Budgets come from the times measured on an H200
(:data:`MEASURED_S`, from ``benchmarks/results/gpu/h200-c14eb26``); a stage without a measured
time gets what is left, and its record's seconds are its first measurement:

1. ``test-gpu``: ``make test-gpu``'s smoke (:mod:`qsdp.bench.gpu_smoke`) for the ``gpu`` tests
   and the codec steps (``qsdp bench codecs``);
2. ``codec-share``: ``qsdp bench codec-share`` on the GPU: one rank of 2 x 4 trained in one process
   by FSDP2 with ``quantize_comms``' comm objects, a GPT of 162M parameters (``gpt2-125m``, an
   untied head) in bf16: each preset's wall step against fsdp's and the share of qsdp's work in it;
3. ``kernels``: ``qsdp bench kernels`` at 1M, 16M, 64M and 256M elements, against a device copy
   and ``torch.compile`` of each kernel's reference;
4. ``train-gpu`` and ``train-gpu-4bit``: the smoke's training, split in two (the eight runs of
   one command did not end within 200 s on the H200): ``fsdp`` (once: it has no codec) and
   ``qsdp`` trained with the Triton kernels and with the reference, then the FSDP2 example; then
   ``sdp4bit`` and ``zeropp``. Each run is limited so that all of a stage's fit its budget;
5. ``gloo-step``: one step of the same GPT and micro-batch on 4 ranks (2 emulated nodes x 2)
   sharing the GPU over gloo, per preset (:mod:`qsdp.bench.workload` under torchrun);
6. ``cluster``: ``qsdp bench cluster --device cuda`` at 20 Mbit/s, 1 Gbit/s and unlimited, with
   the advisor's predictions. It needs root and ``pyroute2``: a host without the package gets it
   from a wheel in ``--wheels DIR`` (``--pack-wheels DIR`` writes one here from this
   installation); without either the stage is skipped and says why.

A stage past its budget is stopped (SIGTERM to its process group, SIGKILL 15 s later), recorded
as ``over_budget``, and the next one runs. The plan is printed first, then a line as each stage
starts (its budget) and ends, and in between every line its commands print, as they print it
(prefixed with the stage's name, flushed) and a line as each of its commands ends: a stage is
never silent for longer than its own parts are. Everything goes to ``<out>/<device>-<commit>/`` (e.g.
``benchmarks/results/gpu/h100-0ddf04a/``): ``report.json`` (the host's versions and every
stage's record), a ``README.md`` naming the device, driver, CUDA, torch, Triton, NCCL and Python
versions, the command and the date, with a row per stage, and each stage's own JSON. Stages named
with ``--only`` are added to a folder that already holds others.

Each record keeps the commit the stage ran at and a hash of the files it measures
(``Stage.measures``, hashed by :mod:`benchmarks.stage_validity` from the files' contents: a copy
of the tree without ``.git`` hashes the same). The result stays valid until those files change,
so the results of several short runs add up to one report: ``--next`` runs only the stages
with no valid result in ``--results`` (the committed ``benchmarks/results/gpu``) or ``--out``,
in priority order, and ``--budget SECONDS`` starts a stage only while its budget fits in what
is left of the command's time (the others wait for a later run). ``--dry-run`` lists each
stage's newest valid result, or why it is due (missing; stale, with the files changed since),
and what would run with its budget and commands, without running anything (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qsdp.results import cpu_model
from qsdp.usage import number

from . import stage_validity
from .stage_validity import Fingerprint, Measures, StageState

__all__ = ["TOTAL_BUDGET_S", "MAX_STAGE_S", "MAX_COMMAND_S", "MEASURED_S", "STAGES", "train_runs", "Command", "Stage", "StageRecord", "Context", "device_slug",
           "result_dir", "git_commit", "environment", "stage_fingerprint", "stage_states", "newest_valid", "run_command",
           "run_stage", "run_stages", "write_readme", "main"]

TOTAL_BUDGET_S = 25 * 60
# A GPU host at hand for a short while may allow one command 10 minutes and all of them 15: every
# stage, stopped at worst, takes at most 5 minutes, so a 10-minute command runs at least two.
MAX_STAGE_S = 5 * 60
MAX_COMMAND_S = 10 * 60
# Seconds each stage (or part of one) took on one H200 (the records in benchmarks/results/gpu/:
# h200-c14eb26, kernels from h200-39c9a1d): the budgets below give each at least twice that. The
# gpu tests get more: at 39c9a1d and 55a503d failing tests held them past 120 s.
MEASURED_S = {"codec-share": 51.2, "gpu tests": 57.4, "kernels": 76.0}
ROOT = Path(__file__).resolve().parents[1]  # the repository: the tests and the example live there
RESULTS = ROOT / "benchmarks" / "results" / "gpu"  # the committed results, whatever --out says
TAIL_CHARS = 3000
KILL_GRACE_S = 15.0
PRESETS = ("fsdp", "qsdp", "sdp4bit", "zeropp")
KERNEL_SIZES = ("1M", "16M", "64M", "256M")
RATES = ("20mbit", "1gbit", "unlimited")
# The step both the codec share and the gloo step measure: GPT-2 small's shape (162M parameters
# with its untied head), 8 sequences of 1024 tokens per rank, bf16.
STEP_MODEL = ("--model", "gpt2-125m", "--batch-size", "8", "--seq-len", "1024", "--param-dtype", "bfloat16")


@dataclass(frozen=True)
class Command:
    """One process of a stage; ``stdout_to``: a file (in the results folder) its stdout goes to."""

    argv: tuple[str, ...]
    stdout_to: str | None = None

    def text(self) -> str:
        return " ".join(self.argv) + (f" > {self.stdout_to}" if self.stdout_to else "")


@dataclass
class Context:
    """Where a run writes (``folder``), what runs its commands (``python``), what it may install
    from (``wheels``), the environment it adds to a stage's (by stage name), the commit its
    records name and the tree whose files they hash (``root``)."""

    folder: Path
    python: str = sys.executable
    wheels: str | None = None
    scratch: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / f"qsdp-gpu-report-{os.getpid()}")
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    commit: str = "unknown"
    root: Path = ROOT


@dataclass(frozen=True)
class Stage:
    """One stage: its name, time budget, what it shows, its commands, what it writes, why it
    cannot run here (``None``: it can; it may prepare the context first), what it does after its
    commands, its one-line result from its files, and the source its result depends on (its
    result stays valid until one of those files changes: :mod:`benchmarks.stage_validity`)."""

    name: str
    budget_s: float
    what: str
    commands: Callable[[Context], list[Command]]
    files: tuple[str, ...] = ()
    blocker: Callable[[Context], str | None] = lambda ctx: None
    finish: Callable[[Context], None] = lambda ctx: None
    summary: Callable[[Path], str] = lambda folder: ""
    measures: Measures = Measures()


@dataclass
class StageRecord:
    """How a stage ended: ``passed``, ``failed``, ``over_budget`` or ``skipped``; the commit it
    ran at, when it finished (UTC) and the hash of what it measures
    (:class:`~benchmarks.stage_validity.Fingerprint`: ``source_hash``, ``source_files``,
    ``commands_hash``)."""

    name: str
    budget_s: float
    status: str = "not run"
    seconds: float = 0.0
    commands: list[str] = field(default_factory=list)
    returncodes: list[int] = field(default_factory=list)
    reason: str = ""
    summary: str = ""
    files: list[str] = field(default_factory=list)
    output_tail: str = ""
    commit: str = ""
    finished: str = ""
    source_hash: str = ""
    source_files: dict[str, str] = field(default_factory=dict)
    commands_hash: str = ""


# --------------------------------------------------------------------------- the stages


def _py(ctx: Context, *args: str, stdout_to: str | None = None) -> Command:
    return Command((ctx.python, *args), stdout_to)


# The smoke's parts each stage runs, and how long one part may take there: its training runs
# (and the example) are limited so that all of them fit the stage's budget with the smoke's own
# start (a process importing torch) to spare.
SMOKE_START_S = 30
TRAIN_PRESETS = {"train-gpu": ("fsdp", "qsdp"), "train-gpu-4bit": ("sdp4bit", "zeropp")}


def _smoke(ctx: Context, folder: str, part_s: float, *args: str) -> Command:
    return _py(ctx, "-m", "qsdp.bench.gpu_smoke", "--out", str(ctx.folder / folder),
               "--stage-timeout", f"{part_s:.0f}", *args)


def _test_gpu(ctx: Context) -> list[Command]:
    budget = _budget("test-gpu")
    return [_smoke(ctx, "test-gpu", budget - SMOKE_START_S, "--skip", "kernels", "train", "example")]


def train_runs(stage: str) -> int:
    """The processes a training stage's smoke runs one after the other: each preset's runs
    (:func:`qsdp.bench.gpu_smoke.train_modes`), and the example after ``train-gpu``'s."""
    from qsdp.bench.gpu_smoke import train_modes

    return sum(len(train_modes(p)) for p in TRAIN_PRESETS[stage]) + (stage == "train-gpu")


def _train(stage: str) -> Callable[[Context], list[Command]]:
    def commands(ctx: Context) -> list[Command]:
        part_s = (_budget(stage) - SMOKE_START_S) / train_runs(stage)
        skip = ("tests", "kernels", "codecs") + (() if stage == "train-gpu" else ("example",))
        return [_smoke(ctx, stage, part_s, "--skip", *skip, "--presets", *TRAIN_PRESETS[stage])]
    return commands


def _budget(name: str) -> float:
    return next(s.budget_s for s in STAGES if s.name == name)


def _codec_share(ctx: Context) -> list[Command]:
    return [_py(ctx, "-m", "qsdp.cli", "bench", "codec-share", "--device", "cuda", *STEP_MODEL,
                "--presets", *PRESETS, "--save", str(ctx.folder / "codec-share.json"))]


def _gloo_runs(ctx: Context) -> Path:
    return ctx.scratch / "gloo-step"


def _gloo_prepare(ctx: Context) -> None:
    _gloo_runs(ctx).mkdir(parents=True, exist_ok=True)  # each run writes its JSON there


def _gloo_step(ctx: Context) -> list[Command]:
    runs = _gloo_runs(ctx)
    return [_py(ctx, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
                "qsdp.bench.workload", "--preset", p, *STEP_MODEL, "--device", "cuda", "--ranks-per-node", "2",
                "--warmup", "2", "--steps", "3", "--out", str(runs / f"{p}.json")) for p in PRESETS]


def _gloo_finish(ctx: Context) -> None:
    rows = {}
    for p in PRESETS:
        path = _gloo_runs(ctx) / f"{p}.json"
        if path.exists():
            r = json.loads(path.read_text())
            rows[p] = {k: r.get(k) for k in ("step_time_s", "step_times_s", "tokens_per_step", "n_params",
                                             "param_dtype", "codec_kernels", "stats")}
    result = {"ranks": 4, "nodes": 2, "ranks_per_node": 2, "backend": "gloo (CUDA tensors through the host)",
              "model": "gpt2-125m", "batch_size": 8, "seq_len": 1024, "warmup": 2, "steps": 3,
              "step_time": "median of rank 0's timed steps", "presets": rows}
    (ctx.folder / "gloo-step.json").write_text(json.dumps(result, indent=2) + "\n")


def _kernels(ctx: Context) -> list[Command]:
    return [_py(ctx, "-m", "qsdp.cli", "bench", "kernels", "--json", "--sizes", *KERNEL_SIZES,
                stdout_to="kernels.json")]


def _cluster(ctx: Context) -> list[Command]:
    return [_py(ctx, "-m", "qsdp.cli", "bench", "cluster", "--device", "cuda", "--rates", *RATES,
                "--save", str(ctx.folder / "cluster-rates.json"))]


def cluster_blocker(ctx: Context, euid: int | None = None) -> str | None:
    """Why the sweep cannot run here (``None``: it can): root, and ``pyroute2``, installed or
    installed now from a wheel in ``ctx.wheels`` into the scratch folder (added to the stage's
    ``PYTHONPATH``)."""
    from qsdp.bench import netns
    from .wheels import find_wheel, install_target

    if (os.geteuid() if euid is None else euid) != 0:
        return "needs root (network namespaces and qdiscs): run the report as root"
    if netns.missing_package() is None:
        return None
    wheel = find_wheel(ctx.wheels, "pyroute2") if ctx.wheels else None
    if wheel is None:
        where = f"no pyroute2-*.whl in {ctx.wheels}" if ctx.wheels else "no --wheels folder was given"
        return (f"pyroute2 is not installed here and {where}: write its wheel on a machine that has it "
                "with `python -m benchmarks.gpu_report --pack-wheels DIR`, carry DIR here and pass "
                "--wheels DIR (make gpu-report WHEELS=DIR)")
    try:
        site = install_target(wheel, ctx.scratch / "site", ctx.python)
    except subprocess.CalledProcessError as e:
        return f"pip could not install {wheel.name}: {(e.stderr or e.stdout or '').strip()[-300:]}"
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    ctx.env["cluster"] = {"PYTHONPATH": path}
    return None


def _load(folder: Path, name: str) -> Any:
    return json.loads((folder / name).read_text())


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def summarize_smoke(subfolder: str) -> Callable[[Path], str]:
    """The summary of a smoke run into ``subfolder``: its stages passed, and pytest's own count
    line where it ran the tests."""
    def summary(folder: Path) -> str:
        stages = _load(folder, f"{subfolder}/gpu_smoke.json")["stages"]
        ok = sum(s["passed"] for s in stages)
        counts = ""
        for s in stages:
            if s["name"] == "gpu tests":
                found = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", s["output_tail"], re.MULTILINE)
                counts = f"; pytest: {found[-1]}" if found else ""
        return f"{ok}/{len(stages)} smoke stages passed{counts}"
    return summary


summarize_test_gpu = summarize_smoke("test-gpu")


CODEC_SHARE_GOAL = 0.03  # sdp4bit's share of the step, at most
WALL_STEP_GOAL = 1.10  # every preset's wall step over fsdp's, at most


def _wall_vs_fsdp(rows: dict[str, Any]) -> dict[str, float]:
    """Each preset's wall step over fsdp's: the row's own ``wall_vs_fsdp``, or (a result from
    before it was written) the ratio of the ``wall_step_ms`` measured in the same run."""
    base = rows.get("fsdp", {}).get("wall_step_ms")
    out = {}
    for p, r in rows.items():
        ratio = r.get("wall_vs_fsdp")
        if ratio is None and base and r.get("wall_step_ms") is not None:
            ratio = r["wall_step_ms"] / base
        if ratio is not None:
            out[p] = ratio
    return out


def summarize_codec_share(folder: Path) -> str:
    """Each preset's share of the step (the goal: sdp4bit at most 3%) and, where fsdp ran too,
    its wall step over fsdp's (the goal: every preset at most 1.10x)."""
    rows = _load(folder, "codec-share.json")["presets"]
    parts = [f"{p} {_pct(r['share'])}" for p, r in rows.items()]
    goal = ""
    if "sdp4bit" in rows and rows["sdp4bit"]["share"] is not None:
        goal = f" (sdp4bit <= 3%: {'met' if rows['sdp4bit']['share'] <= CODEC_SHARE_GOAL else 'missed'})"
    text = "qsdp's share of a step: " + ", ".join(parts) + goal
    ratios = {p: x for p, x in _wall_vs_fsdp(rows).items() if p != "fsdp"}
    if ratios:
        met = all(x <= WALL_STEP_GOAL for x in ratios.values())
        text += ("; wall step vs fsdp: " + ", ".join(f"{p} {x:.2f}x" for p, x in ratios.items())
                 + f" (every preset <= {WALL_STEP_GOAL:.2f}x: {'met' if met else 'missed'})")
    return text


def summarize_gloo_step(folder: Path) -> str:
    rows = _load(folder, "gloo-step.json")["presets"]
    return "4-rank gloo step: " + ", ".join(f"{p} {r['step_time_s']:.2f} s" for p, r in rows.items())


def summarize_kernels(folder: Path) -> str:
    """Bit-exactness, the slowest kernel against ``torch.compile`` and those below it, the
    range of fractions of a device copy."""
    kernels = _load(folder, "kernels.json")["kernels"]
    runs = [(name, r) for name, k in kernels.items() for r in k["by_size"]]
    exact = all(r["matches_reference"] for _, r in runs)
    ratios = [(r["speedup_vs_compiled_torch"], name, r["n"]) for name, r in runs
              if r.get("speedup_vs_compiled_torch") is not None]
    copy = [r["fraction_of_copy"] for _, r in runs]
    text = f"bit-exact: {'yes' if exact else 'NO'}; {min(copy):.0%}-{max(copy):.0%} of a copy"
    if ratios:
        worst = min(ratios)
        slower = sorted({name for ratio, name, _ in ratios if ratio < 1})
        text += (f"; vs torch.compile min {worst[0]:.2f}x ({worst[1]} at {worst[2] / 2**20:g}M); "
                 f"below 1x: {', '.join(slower) if slower else 'none'}")
    return text


def summarize_cluster(folder: Path) -> str:
    """The advisor's mean |error| and right picks (goals: at most 20%, every rate)."""
    adv = _load(folder, "cluster-rates.json").get("advisor")
    if not adv:
        return "no advisor predictions"
    return (f"advisor: mean |error| {_pct(adv['mean_abs_error'])} (goal <= 20%), right pick at "
            f"{adv['picks_ok']}/{adv['rates']} rates")


def _gpu_test_files(root: Path) -> list[str]:
    """The test files the smoke hands to pytest (those that declare ``gpu`` tests)."""
    from qsdp.bench.gpu_smoke import gpu_test_files

    return gpu_test_files(root / "tests")


# In priority order: what a short time on a GPU should measure first. Each stage names the code that
# measures and what it runs (followed through their imports, see ``Measures``): the command-line
# dispatcher is left out where it only hands over to a benchmark module.
STAGES: tuple[Stage, ...] = (
    Stage("test-gpu", 210, "make test-gpu's gpu tests (the skipped ones listed) and codec steps",
          _test_gpu, ("test-gpu/gpu_smoke.json", "test-gpu/codecs.json"), summary=summarize_test_gpu,
          measures=Measures(modules=("qsdp.bench.gpu_smoke", "qsdp.bench.codecs"),
                            files=("tests/conftest.py",), more=_gpu_test_files)),
    Stage("codec-share", 120, "one rank's step under FSDP2 + quantize_comms, GPT 162M bf16: each preset's wall "
          "step vs fsdp's, qsdp's share of it",
          _codec_share, ("codec-share.json",), summary=summarize_codec_share,
          measures=Measures(modules=("qsdp.bench.codec_share",))),
    Stage("kernels", 180, "the Triton kernels at 1M-256M elements: GB/s, of a copy, vs torch.compile",
          _kernels, ("kernels.json",), summary=summarize_kernels,
          measures=Measures(modules=("qsdp.bench.kernels",))),
    Stage("train-gpu", 240, "fsdp and qsdp trained on 4 ranks sharing the GPU, Triton vs reference; the example",
          _train("train-gpu"), ("train-gpu/gpu_smoke.json",), summary=summarize_smoke("train-gpu"),
          measures=Measures(modules=("qsdp.bench.gpu_smoke", "qsdp.cli"),
                            files=("examples/fsdp2_two_lines.py", "src/qsdp/train/sample.txt"))),
    Stage("train-gpu-4bit", 270, "sdp4bit and zeropp trained on 4 ranks sharing the GPU, Triton vs reference",
          _train("train-gpu-4bit"), ("train-gpu-4bit/gpu_smoke.json",), summary=summarize_smoke("train-gpu-4bit"),
          measures=Measures(modules=("qsdp.bench.gpu_smoke", "qsdp.cli"), files=("src/qsdp/train/sample.txt",))),
    Stage("gloo-step", 180, "one step of that GPT on 4 ranks sharing the GPU over gloo, per preset",
          _gloo_step, ("gloo-step.json",), blocker=_gloo_prepare, finish=_gloo_finish, summary=summarize_gloo_step,
          measures=Measures(modules=("qsdp.bench.workload",))),
    Stage("cluster", 195, "qsdp bench cluster --device cuda at 20 Mbit/s, 1 Gbit/s, unlimited, with predictions",
          _cluster, ("cluster-rates.json", "cluster-rates.png"), blocker=cluster_blocker, summary=summarize_cluster,
          measures=Measures(modules=("qsdp.bench.cluster", "qsdp.bench.workload", "qsdp.cli"))),
)


# --------------------------------------------------------------------------- validity


def stage_fingerprint(stage: Stage, root: Path = ROOT) -> Fingerprint:
    """The hash of what ``stage`` measures in the tree at ``root``, its commands written with
    placeholders for the host's paths (so every host hashes the same tree the same)."""
    placeholder = Context(Path("<out>"), python="python", scratch=Path("<scratch>"))
    commands = "\n".join(c.text() for c in stage.commands(placeholder))
    return stage_validity.fingerprint(stage.measures, root, commands)


def stage_states(stages: Sequence[Stage], dirs: Sequence[Path], root: Path = ROOT) -> list[StageState]:
    """Each stage's state against the results in ``dirs``' ``<device>-<commit>/`` folders: its
    newest valid result, or why it is due (``missing`` / ``stale``)."""
    results = stage_validity.read_results(dirs, {s.name: s.files for s in STAGES + tuple(stages)})
    return [stage_validity.stage_state(s.name, stage_fingerprint(s, root), results) for s in stages]


def newest_valid(dirs: Sequence[Path] = (RESULTS,), root: Path = ROOT) -> dict[str, stage_validity.Result | None]:
    """The result each stage's figures are quoted from: its newest valid one in ``dirs``
    (``None``: the stage is due)."""
    return {st.stage: None if st.due else st.result for st in stage_states(STAGES, dirs, root)}


def stage_cost(stage: Stage) -> float:
    """The longest a stage can take: its budget and the grace a stopped one gets."""
    return stage.budget_s + KILL_GRACE_S


# --------------------------------------------------------------------------- running


def run_command(command: Command, timeout: float, *, cwd: Path, env: dict[str, str] | None = None,
                folder: Path | None = None, echo: Callable[[str], None] | None = None) -> tuple[int | None, str, bool]:
    """Run one command in a process group of its own for at most ``timeout`` seconds:
    ``(exit status, output tail, stopped)``; a command still running then gets SIGTERM (its
    cleanup may run), SIGKILL ``KILL_GRACE_S`` later, and ``stopped`` is True. Each line of its
    output (stdout and stderr; stderr only where stdout goes to ``command.stdout_to``) goes to
    ``echo`` as it is printed."""
    out = open(folder / command.stdout_to, "w") if command.stdout_to and folder else None
    tail: list[str] = [""]
    try:
        proc = subprocess.Popen(list(command.argv), stdout=out or subprocess.PIPE,
                                stderr=subprocess.PIPE if out else subprocess.STDOUT, cwd=cwd, text=True,
                                errors="replace", env={**os.environ, **(env or {})}, start_new_session=True)
        reader = threading.Thread(target=_read_lines, args=(proc.stderr if out else proc.stdout, tail, echo),
                                  daemon=True)
        reader.start()
        stopped = False
        try:
            proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            stopped = True
            _stop_group(proc)
        # The pipe ends when the group's last process does; a process that left the group may
        # hold it open: its lines after this are not waited for.
        reader.join(timeout=KILL_GRACE_S)
    finally:
        if out is not None:
            out.close()
    text = tail[0][-TAIL_CHARS:]
    if stopped:
        text += f"\nstopped after its budget of {timeout:.0f} s"
    return (None if stopped else proc.returncode), text, stopped


def _read_lines(pipe, tail: list[str], echo: Callable[[str], None] | None) -> None:
    """Keep the last ``2 * TAIL_CHARS`` characters of ``pipe`` in ``tail[0]``, passing each line
    to ``echo`` as it comes."""
    for text in pipe:
        tail[0] = (tail[0] + text)[-2 * TAIL_CHARS:]
        if echo is not None:
            echo(text.rstrip("\n"))
    pipe.close()


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_stage(stage: Stage, ctx: Context, *, cwd: Path = ROOT,
              echo: Callable[[str], None] | None = None) -> StageRecord:
    """Run one stage within its budget (see the module doc); never raises for the stage's own
    failure, which its record says. The record names ``ctx.commit`` and the hash of what the
    stage measures in ``ctx.root``, taken before it runs. ``echo``: gets each line its commands
    print, as they print it, and a line as each command ends."""
    measured = stage_fingerprint(stage, ctx.root)
    record = StageRecord(stage.name, stage.budget_s, commit=ctx.commit, source_hash=measured.source_hash,
                         source_files=measured.files, commands_hash=measured.commands_hash)
    started = time.monotonic()
    try:
        _run_stage(stage, ctx, cwd, record, started, echo)
    finally:
        record.seconds = time.monotonic() - started
        record.finished = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return record


def _run_stage(stage: Stage, ctx: Context, cwd: Path, record: StageRecord, started: float,
               echo: Callable[[str], None] | None) -> None:
    reason = stage.blocker(ctx)
    if reason:
        record.status, record.reason = "skipped", reason
        return
    deadline = started + stage.budget_s
    commands = stage.commands(ctx)
    record.commands = [c.text() for c in commands]
    record.status = "passed"
    tails = []
    for i, command in enumerate(commands, 1):
        began = time.monotonic()
        rc, tail, stopped = run_command(command, deadline - time.monotonic(), cwd=cwd,
                                        env=ctx.env.get(stage.name), folder=ctx.folder, echo=echo)
        if echo is not None:
            ended = "stopped" if stopped else f"exited with {rc}"
            echo(f"command {i}/{len(commands)} {ended} after {time.monotonic() - began:.0f} s")
        tails.append(tail)
        if stopped:
            record.status, record.reason = "over_budget", f"stopped after its budget of {stage.budget_s:.0f} s"
            break
        record.returncodes.append(rc)
        if rc != 0:
            record.status = "failed"
            record.reason = record.reason or f"`{' '.join(command.argv[1:5])} ...` exited with {rc}"
    record.output_tail = "\n".join(tails)[-TAIL_CHARS:]
    if record.status != "over_budget":
        try:
            stage.finish(ctx)
            record.summary = stage.summary(ctx.folder)
        except (OSError, KeyError, ValueError, TypeError) as e:  # a result that is missing or malformed
            record.summary = f"no result to summarize ({type(e).__name__}: {e})"
            if record.status == "passed":
                record.status, record.reason = "failed", record.summary
    record.files = [f for f in stage.files if (ctx.folder / f).exists()]


# --------------------------------------------------------------------------- the folder


def device_slug(name: str) -> str:
    """A folder-name part for a device: its model, vendor words dropped, lower case.
    ``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``, ``"NVIDIA A100-SXM4-80GB"`` -> ``"a100"``,
    ``"NVIDIA GeForce RTX 4090"`` -> ``"rtx4090"``."""
    vendor = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct", "intel"}
    words = [w for w in re.split(r"[\s_\-/]+", name.lower()) if w and w not in vendor]
    picked = []
    for w in words:
        picked.append(re.sub(r"[^a-z0-9]", "", w))
        if any(c.isdigit() for c in w):
            break
    return "".join(picked) or "device"


def result_dir(out: str | Path, device_name: str, commit: str) -> Path:
    """``out/<device>-<commit>``."""
    return Path(out) / f"{device_slug(device_name)}-{commit}"


def git_commit(cwd: Path = ROOT) -> str:
    """The checkout's short commit, ``-dirty`` when tracked files differ from it, ``unknown``
    without git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "") if sha else "unknown"


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def environment() -> dict[str, Any]:
    """The host's device and versions: device, driver, CUDA, torch, Triton, NCCL, Python, CPU."""
    import platform

    import torch

    cuda = torch.cuda.is_available()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    nccl = None
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            pass
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "driver": _driver() if cuda else None,
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton_version, "nccl": nccl,
            "python": platform.python_version(), "host_cpu": f"{cpu_model()}, {os.cpu_count()} cores"}


def write_readme(folder: Path, env: dict[str, Any], records: Sequence[StageRecord], command: str,
                 date: str) -> Path:
    """``folder/README.md``: what produced the folder and a row per stage."""
    head = [f"# {env['device']}, qsdp at commit {env['commit']}", "",
            f"What `{command}` measured on {date}: a row per stage, with the files it wrote here. "
            "`report.json` holds each stage's commands, exit statuses, time and output tail, and the hash of "
            "the files it measures (its result stays valid until they change).", "",
            "| | |", "|---|---|"]
    for key, label in (("device", "device"), ("driver", "driver"), ("cuda", "CUDA"), ("torch", "torch"),
                       ("triton", "Triton"), ("nccl", "NCCL"), ("python", "Python"), ("host_cpu", "host CPU"),
                       ("commit", "qsdp commit")):
        head.append(f"| {label} | {env.get(key) or 'unknown'} |")
    head += [f"| command | `{command}` |", f"| date | {date} |", "",
             "| stage | budget s | seconds | status | commit | source hash | files | result |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        files = ", ".join(f"`{f}`" for f in r.files)
        result = r.summary or r.reason
        status = r.status.replace("_", " ")
        head.append(f"| `{r.name}` | {r.budget_s:.0f} | {r.seconds:.0f} | {status} | {r.commit or 'unknown'} | "
                    f"{r.source_hash or 'none'} | {files} | {result.replace('|', '/')} |")
    path = folder / "README.md"
    path.write_text("\n".join(head) + "\n", encoding="utf-8")
    return path


def _echo(name: str) -> Callable[[str], None]:
    """Prints a line of stage ``name``'s output at once, prefixed with the stage's name."""
    return lambda text: print(f"{name:<14} | {text}", flush=True)


def _merge(previous: list[dict[str, Any]], new: Sequence[StageRecord]) -> list[StageRecord]:
    """The folder's records after this run: the new ones replace their names', in stage order."""
    records = {r["name"]: StageRecord(**r) for r in previous}
    records.update({r.name: r for r in new})
    order = [s.name for s in STAGES]
    return sorted(records.values(), key=lambda r: order.index(r.name) if r.name in order else len(order))


def line(record: StageRecord) -> str:
    """The one line printed for a finished stage."""
    text = record.summary or record.reason
    return (f"{record.name:<14} {record.seconds:5.0f}/{record.budget_s:.0f} s  "
            f"{record.status.replace('_', ' '):<11} {text}")


# --------------------------------------------------------------------------- the command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_report", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None,
                   help="where the <device>-<commit> folder goes (default $OUT when set, else benchmarks/results/gpu)")
    p.add_argument("--only", nargs="+", choices=[s.name for s in STAGES], metavar="STAGE",
                   help="run these stages only, adding them to the folder's report")
    p.add_argument("--skip", nargs="+", default=[], choices=[s.name for s in STAGES], metavar="STAGE",
                   help="stages to leave out")
    p.add_argument("--next", action="store_true",
                   help="run only the stages due: no valid result in --results or --out (missing, or stale: what it "
                        "measures changed since)")
    p.add_argument("--budget", type=number(0, low_open=True), metavar="SECONDS",
                   help="the time this command may take: a stage starts only while its budget and the "
                        f"{KILL_GRACE_S:.0f} s a stopped one gets fit in what is left; the others wait")
    p.add_argument("--results", default=str(RESULTS), metavar="DIR",
                   help="the committed results each stage's validity is read from (default benchmarks/results/gpu)")
    p.add_argument("--wheels", metavar="DIR", help="a folder of wheels to install missing pure-Python packages from "
                   "(pyroute2 for the cluster stage)")
    p.add_argument("--commit", help="the commit to name the folder by (default: git's; for a copy without .git)")
    p.add_argument("--dry-run", action="store_true",
                   help="list each stage's state (its newest valid result, or why it is due) and what would run, "
                        "with budgets and commands; run nothing")
    p.add_argument("--pack-wheels", metavar="DIR",
                   help="write the wheels a GPU host may lack (pyroute2) into DIR from this installation, then exit")
    return p


def selected(only: Sequence[str] | None, skip: Sequence[str]) -> list[Stage]:
    """The stages to run, in their (priority) order."""
    return [s for s in STAGES if (not only or s.name in only) and s.name not in skip]


def plan_text(stages: Sequence[Stage], states: Sequence[StageState] | None, budget: float | None) -> str:
    """What a run of ``stages`` does: each stage's budget and why it runs, which ones wait for
    time left over (``budget``: the command's seconds), the total."""
    why = {st.stage: st.reason for st in states or ()}
    run, wait = stage_validity.plan([(s.name, stage_cost(s)) for s in stages], budget)
    limit = f"within {budget:.0f} s" if budget is not None else "no time limit"
    lines = [f"plan ({limit}; a stage may take its budget and {KILL_GRACE_S:.0f} s to stop):"]
    by_name = {s.name: s for s in stages}
    for name in run:
        lines.append(f"  run  {name:<14} {by_name[name].budget_s:4.0f} s  {why.get(name, '')}".rstrip())
    for name in wait:
        lines.append(f"  wait {name:<14} {by_name[name].budget_s:4.0f} s  {why.get(name, '')} (starts only if the "
                     f"stages before it leave {stage_cost(by_name[name]):.0f} s)")
    if not stages:
        lines.append("  nothing to run")
    total = sum(by_name[n].budget_s for n in run)
    lines.append(f"total budget {total:.0f} s ({total / 60:.1f} min) for {len(run)} stage(s); each stage at most "
                 f"{MAX_STAGE_S / 60:.0f} min, all of them {sum(s.budget_s for s in STAGES) / 60:.1f} of at most "
                 f"{TOTAL_BUDGET_S / 60:.0f} min")
    return "\n".join(lines)


def states_text(states: Sequence[StageState], dirs: Sequence[Path]) -> str:
    """The newest valid result of each stage, or why it is due."""
    where = ", ".join(f"{d}/" for d in dirs)
    lines = [f"results in {where}: the newest valid result of each stage (valid: it recorded the hash of the "
             "files it measures as they are now)"]
    lines += [f"  {st.stage:<14} {st.state:<8} {st.reason}" for st in states]
    return "\n".join(lines)


def dry_run(stages: Sequence[Stage], ctx: Context, states: Sequence[StageState] | None = None,
            budget: float | None = None) -> str:
    """The plan for ``stages`` (:func:`plan_text`) with each stage's commands."""
    lines = [f"results: {ctx.folder}/", plan_text(stages, states, budget), "commands:"]
    for s in stages:
        lines.append(f"  {s.name:<14} {s.what}")
        lines += [f"    {c.text()}" for c in s.commands(ctx)]
    return "\n".join(lines)


def _results_dirs(args: argparse.Namespace, out: str) -> list[Path]:
    """The committed results and the output folder (on a GPU host ``$OUT`` may start empty), once."""
    dirs: dict[Path, Path] = {}
    for d in (Path(args.results), Path(out)):
        dirs.setdefault(d.resolve(), d)
    return list(dirs.values())


def _unknown_commit_tag(root: Path) -> str:
    """Stands in for the commit of a copy without git: the hash of everything the stages
    measure, so two copies of different code never share a folder."""
    hashes = "".join(stage_fingerprint(s, root).source_hash for s in STAGES)
    return "unknown-" + stage_validity.digest(hashes.encode())[:8]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the report (see the module doc): 0 when every stage run passed (skipped ones
    included; stages left waiting for time do not count), 1 otherwise, 2 for a bad argument or
    a host without CUDA."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.pack_wheels:
        from .wheels import pack_installed

        try:
            print(pack_installed("pyroute2", args.pack_wheels))
        except ValueError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        return 0
    stages = selected(args.only, args.skip)
    out = args.out or os.environ.get("OUT") or str(RESULTS)
    commit = args.commit or git_commit()
    dirs = _results_dirs(args, out)
    states = stage_states(stages, dirs)
    if args.next:
        due = {st.stage for st in states if st.due}
        stages = [s for s in stages if s.name in due]
    if args.dry_run:
        print(states_text(states, dirs))
        print(dry_run(stages, Context(Path(out) / f"<device>-{commit}", wheels=args.wheels), states, args.budget))
        return 0
    if not stages:
        print(states_text(states, dirs))
        print("nothing to run" + (": every stage selected has a valid result" if args.next else ""))
        return 0
    import torch

    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: torch.cuda.is_available() is False here: the report needs a "
                       "CUDA GPU (--dry-run lists its stages without one)\n")
    if commit == "unknown":
        commit = _unknown_commit_tag(ROOT)
    env = {**environment(), "commit": commit}
    folder = result_dir(out, env["device"], commit)
    folder.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.gpu_report " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{env['device']}, driver {env['driver']}, torch {env['torch']}, Triton {env['triton']}, "
          f"NCCL {env['nccl']}; results in {folder}", flush=True)
    print(plan_text(stages, states, args.budget), flush=True)
    deadline = None if args.budget is None else time.monotonic() + args.budget
    done = run_stages(stages, Context(folder, wheels=args.wheels, commit=commit), env, command, deadline=deadline)
    ok = all(r.status in ("passed", "skipped") for r in done)
    waiting = [s.name for s in stages if s.name not in {r.name for r in done}]
    print(f"{'every stage run passed' if ok else 'NOT every stage run passed'}"
          f"{'; waiting for a later run: ' + ', '.join(waiting) if waiting else ''}; {folder / 'README.md'}")
    return 0 if ok else 1


def run_stages(stages: Sequence[Stage], ctx: Context, env: dict[str, Any], command: str,
               cwd: Path = ROOT, deadline: float | None = None) -> list[StageRecord]:
    """Run ``stages`` one after the other, printing a line for each, and after each write
    ``report.json`` and ``README.md`` of ``ctx.folder`` (what it held from earlier runs kept,
    the stages run now replacing theirs): a run cut short keeps what it did. With a
    ``deadline`` (``time.monotonic()``), the next stage is the first of those left whose
    budget and stopping grace fit before it; the others wait (a line each). The records of
    this run."""
    report_path = ctx.folder / "report.json"
    previous = json.loads(report_path.read_text())["stages"] if report_path.exists() else []
    date = time.strftime("%Y-%m-%d")
    done: list[StageRecord] = []
    pending = list(stages)
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        run, _ = stage_validity.plan([(s.name, stage_cost(s)) for s in pending], left)
        if not run:
            break
        stage = next(s for s in pending if s.name == run[0])
        pending.remove(stage)
        print(f"{stage.name:<14} starts: budget {stage.budget_s:.0f} s"
              + (f", {left:.0f} s left" if left is not None else ""), flush=True)
        done.append(run_stage(stage, ctx, cwd=cwd, echo=_echo(stage.name)))
        print(line(done[-1]), flush=True)
        records = _merge(previous, done)
        report = {"environment": env, "command": command, "date": date, "stages": [asdict(r) for r in records]}
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        write_readme(ctx.folder, env, records, command, date)
    for stage in pending:
        left = max(0.0, deadline - time.monotonic()) if deadline is not None else 0.0
        print(f"{stage.name:<14} waits: needs {stage_cost(stage):.0f} s, {left:.0f} s left", flush=True)
    return done


if __name__ == "__main__":
    raise SystemExit(main())
