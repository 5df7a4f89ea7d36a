"""``python -m qsdp.bench.gpu_smoke``: the whole GPU check in one command (``make test-gpu``).

On a CUDA machine where torch, triton and pytest are preinstalled and no package registry is
reachable (the package itself is installed with ``pip install --no-deps --no-build-isolation -e
.``: none of its extras), in order:

1. the ``gpu``-marked tests (pytest, on the test files that declare some; the skipped ones are
   listed with their reasons, e.g. a test that needs more GPUs than the machine has);
2. ``qsdp bench kernels --json`` and ``qsdp bench codecs --json``, their JSON saved;
3. ``qsdp train`` of each preset for a few steps as 4 ranks (2 emulated nodes x 2) sharing the
   one GPU (gloo backend, CUDA tensors) on the sample text shipped in the package with the byte
   tokenizer (no extra needed), once with the Triton kernels and once with
   ``QSDP_DISABLE_TRITON=1``: each run must report the codecs it used (``codec_kernels``):
   ``"triton"`` then ``"torch"`` for a quantized preset, and the per-step losses of the two must
   agree within ``--rtol`` (the kernels give the reference's bytes; only CUDA's own float
   non-determinism can separate them); a preset that quantizes nothing (``fsdp``) has no codec to
   compare: it trains once and must report ``"none"``;
4. the FSDP2 example under torchrun on the GPU.

Each stage (each training run is one) prints a line as it ends, flushed, so a long smoke is
never silent for longer than its slowest stage, at most ``--stage-timeout`` seconds: ``make
gpu-report`` splits the training over stages that each fit its budget with it.

Results: ``gpu_smoke.json`` (each stage's command, exit code, seconds and output tail, the loss
comparison, the meta) in ``--out`` (default ``$OUT`` when set, else ``benchmarks/results/gpu``).
Exit status 0 when every stage passed. ``--device cpu`` runs the training comparison on the CPU
(the Triton stages are skipped and every run must report ``torch``): the same code path, for
machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from qsdp.config import PRESETS, resolve_config
from qsdp.train.data import sample_corpus_path
from qsdp.train.metrics import read_metrics, read_summary

from .report import BENCH_PRESETS, meta

__all__ = ["Stage", "compare_losses", "expected_kernels", "quantizes", "train_modes", "gpu_tests_command", "gpu_test_files",
           "train_command", "stage_line", "run_stages", "parse_args", "main"]

STAGES = ("tests", "kernels", "codecs", "train", "example")
ROOT = Path(__file__).resolve().parents[3]  # the repository, for the tests and the example
TAIL_CHARS = 4000
# One size for the kernel table: the three default sizes, each compiled for the torch.compile
# baseline, would take most of the ten minutes the whole smoke may use on one H100.
BENCH_ARGS = {"kernels": ("--sizes", "64M")}


@dataclass
class Stage:
    """One step of the smoke: what ran and how it ended."""

    name: str
    command: list[str]
    returncode: int | None = None
    seconds: float = 0.0
    output_tail: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.problems


def _default_out() -> str:
    return os.environ.get("OUT") or os.path.join("benchmarks", "results", "gpu")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The smoke's arguments; exits with status 2 naming a bad one."""
    parser = argparse.ArgumentParser(prog="python -m qsdp.bench.gpu_smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results directory (default $OUT or benchmarks/results/gpu)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--presets", nargs="+", default=list(BENCH_PRESETS))
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks sharing the device (default 4)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="emulated ranks per node (default 2)")
    parser.add_argument("--rtol", type=float, default=1e-3,
                        help="largest relative loss difference, Triton vs reference (default 1e-3)")
    parser.add_argument("--skip", nargs="+", default=[], choices=STAGES, help="stages to leave out")
    parser.add_argument("--stage-timeout", type=float, default=300.0, help="seconds one stage may take")
    args = parser.parse_args(argv)
    unknown = [p for p in args.presets if p not in PRESETS]
    if unknown:
        parser.error(f"unknown preset(s) {', '.join(unknown)}; allowed: {', '.join(PRESETS)}")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.nproc < 1 or args.ranks_per_node < 1 or args.nproc % args.ranks_per_node:
        parser.error(f"--ranks-per-node {args.ranks_per_node} must divide --nproc {args.nproc} (both positive)")
    if not (math.isfinite(args.rtol) and args.rtol >= 0):
        parser.error(f"--rtol must be a non-negative number, got {args.rtol}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here (use --device cpu)")
    args.out = args.out or _default_out()
    return args


def _text(out: str | bytes | None) -> str:
    # TimeoutExpired carries bytes even from a text-mode run
    return out.decode("utf-8", "replace") if isinstance(out, bytes) else (out or "")


def _run(stage: Stage, timeout: float, env: dict[str, str] | None = None, stdout_to: Path | None = None,
         log_to: Path | None = None) -> Stage:
    """Run the stage's command (output captured; stdout saved to ``stdout_to`` when given and the
    command passed; stdout and stderr to ``log_to`` when given, whatever the outcome: a command
    stopped at its timeout leaves what it printed until then)."""
    started = time.perf_counter()
    try:
        proc = subprocess.run(stage.command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})}, cwd=ROOT)
        stage.returncode = proc.returncode
        output = proc.stdout + proc.stderr
        if stdout_to is not None and proc.returncode == 0:
            stdout_to.write_text(proc.stdout, encoding="utf-8")
    except subprocess.TimeoutExpired as e:
        stage.returncode = 124
        output = f"{_text(e.stdout)}{_text(e.stderr)}\ntimed out after {timeout:g} s"
    stage.seconds = time.perf_counter() - started
    if log_to is not None:
        log_to.write_text(output, encoding="utf-8")
    stage.output_tail = output[-TAIL_CHARS:]
    return stage


def train_command(preset: str, run_dir: Path, args: argparse.Namespace) -> list[str]:
    """``qsdp train`` of one preset: ``nproc`` ranks sharing the device over gloo, on the sample
    text with the byte tokenizer (nothing beyond torch needed)."""
    return [sys.executable, "-m", "qsdp.cli", "train", "--preset", preset, "--model", "tiny",
            "--data", sample_corpus_path(), "--tokenizer", "byte",
            "--steps", str(args.steps), "--batch-size", "4", "--seq-len", "64", "--eval-every", "0",
            "--eval-batches", "4", "--ckpt-every", "0", "--keep-checkpoints", "1", "--no-progress",
            "--nproc", str(args.nproc), "--local-world-size", str(args.ranks_per_node),
            "--device", args.device, "--backend", "gloo", "--out", str(run_dir)]


def quantizes(preset: str) -> bool:
    """Whether a training run of ``preset`` (no ``--hsdp``, several nodes) quantizes anything:
    its weights or its gradients travel quantized."""
    config = resolve_config(preset)
    return config.weights.mode != "plain" or config.grads.mode != "plain"


def expected_kernels(preset: str, device: str, triton_disabled: bool) -> str:
    """The ``codec_kernels`` a run must report, the codecs it used: ``none`` for a preset that
    quantizes nothing (``fsdp``), ``triton`` for a quantized one on CUDA with the kernels
    switched on, else ``torch``."""
    if not quantizes(preset):
        return "none"
    return "triton" if device == "cuda" and not triton_disabled else "torch"


def compare_losses(fused: Sequence[float], reference: Sequence[float], rtol: float) -> dict[str, Any]:
    """Per-step training losses of two runs of the same job: the largest relative difference
    and whether it is within ``rtol`` (runs of different lengths or with a non-finite loss
    never agree)."""
    if len(fused) != len(reference) or not fused:
        return {"steps": [len(fused), len(reference)], "max_rel_diff": None, "bit_identical": False, "agree": False}
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(fused, reference)]
    finite = all(math.isfinite(x) for x in [*fused, *reference])
    worst = max(diffs) if finite else math.inf
    return {"steps": len(fused), "max_rel_diff": worst, "bit_identical": list(fused) == list(reference),
            "agree": finite and worst <= rtol}


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def _train_stage(preset: str, mode: str, args: argparse.Namespace, out: Path) -> Stage:
    disabled = mode == "reference"
    run_dir = out / f"{preset}-{mode}"
    stage = Stage(f"train {preset} ({mode})", train_command(preset, run_dir, args))
    _run(stage, args.stage_timeout, env={"QSDP_DISABLE_TRITON": "1"} if disabled else {"QSDP_DISABLE_TRITON": "0"})
    if stage.returncode == 0:
        kernels = read_summary(run_dir).get("codec_kernels")
        want = expected_kernels(preset, args.device, disabled)
        if kernels != want:
            stage.problems.append(f"codec_kernels is {kernels!r}, expected {want!r}")
    return stage


def train_modes(preset: str) -> tuple[str, ...]:
    """The runs of ``preset``: with the Triton kernels and with the reference, compared; once
    for a preset that quantizes nothing (there is no codec to compare)."""
    return ("triton", "reference") if quantizes(preset) else ("triton",)


def train_and_compare(args: argparse.Namespace, out: Path, log=print) -> tuple[list[Stage], dict[str, Any]]:
    """Every preset's runs (:func:`train_modes`) in ``out`` (which must not hold them yet), a
    line logged as each ends; the loss comparison per quantized preset (a disagreement fails
    the reference run)."""
    stages, comparison = [], {}
    for preset in args.presets:
        for mode in train_modes(preset):
            stage = _train_stage(preset, mode, args, out)
            if mode == "reference" and stage.passed and stages[-1].passed:
                comparison[preset] = compare_losses(_losses(out / f"{preset}-triton"),
                                                    _losses(out / f"{preset}-reference"), args.rtol)
                if not comparison[preset]["agree"]:
                    stage.problems.append(f"losses differ from the Triton run: {comparison[preset]}")
            stages.append(stage)
            log(stage_line(stage))
    return stages, comparison


def _bench_stage(name: str, out: Path, timeout: float) -> Stage:
    """``qsdp bench NAME --json``; its JSON saved as ``out/NAME.json``."""
    command = [sys.executable, "-m", "qsdp.cli", "bench", name, "--json", *BENCH_ARGS.get(name, ())]
    stage = Stage(f"bench {name}", command)
    return _run(stage, timeout, stdout_to=out / f"{name}.json")


def _example_stage(timeout: float) -> Stage:
    nproc = max(1, torch.cuda.device_count())  # NCCL: one process a GPU
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               str(ROOT / "examples" / "fsdp2_two_lines.py"), "--steps", "6", "--preset", "sdp4bit"]
    return _run(Stage("example", command), timeout)


def stage_line(stage: Stage) -> str:
    """The line printed as a stage ends: its name, seconds and how it ended."""
    why = "; ".join([f"exit {stage.returncode}", *stage.problems])
    return f"{stage.name:<28} {stage.seconds:7.1f} s  {'ok' if stage.passed else f'FAILED ({why})'}"


def _flushed(text: str) -> None:
    print(text, flush=True)


def run_stages(args: argparse.Namespace, out: Path, log=_flushed) -> tuple[list[Stage], dict[str, Any]]:
    """Every stage not skipped (on ``--device cpu`` only the training comparison), ``log``-ing
    a line (:func:`stage_line`) as each ends."""
    skip = set(args.skip) | ({"tests", "kernels", "codecs", "example"} if args.device == "cpu" else set())
    stages: list[Stage] = []
    comparison: dict[str, Any] = {}

    def ran(stage: Stage) -> None:
        stages.append(stage)
        log(stage_line(stage))

    if "tests" not in skip:
        ran(_run(Stage("gpu tests", gpu_tests_command()), args.stage_timeout, log_to=out / "pytest-gpu.log"))
    for name in ("kernels", "codecs"):
        if name not in skip:
            ran(_bench_stage(name, out, args.stage_timeout))
    if "train" not in skip:
        with tempfile.TemporaryDirectory(prefix="qsdp-gpu-smoke-") as runs:
            train_stages, comparison = train_and_compare(args, Path(runs), log)
        stages += train_stages
    if "example" not in skip:
        ran(_example_stage(args.stage_timeout))
    return stages, comparison


def gpu_tests_command() -> list[str]:
    """pytest on the ``gpu`` tests: a line per test as it ends (a run stopped at its timeout
    still says how far it got), the failures and the skipped tests with their reasons
    (``-rfEs``: a test that needs more GPUs than the machine has says how many), the slowest
    tests, and the stacks of a test that runs past 90 s (``faulthandler_timeout``)."""
    return [sys.executable, "-m", "pytest", "-v", "-rfEs", "--durations=15", "-o", "faulthandler_timeout=90",
            "-m", "gpu", "-p", "no:cacheprovider", *gpu_test_files()]


def gpu_test_files(tests: Path = ROOT / "tests") -> list[str]:
    """The test files that declare ``gpu`` tests. Only they are collected: the others may import
    packages of the dev extra (hypothesis, transformers), which a bare GPU host lacks."""
    return [str(p) for p in sorted(tests.glob("test_*.py")) if "pytest.mark.gpu" in p.read_text(encoding="utf-8")]


def _device_words(device: str) -> str:
    if device == "cuda":
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return f"cpu ({os.cpu_count()} cores)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the smoke; returns 0 when every stage passed, 1 otherwise (2: bad arguments)."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    stages, comparison = run_stages(args, out)
    result = {
        "passed": all(s.passed for s in stages), "wall_time_s": time.perf_counter() - started,
        "stages": [{**asdict(s), "passed": s.passed} for s in stages], "loss_comparison": comparison,
        "meta": meta("gpu_smoke", list(argv) if argv is not None else None, _device_words(args.device),
                     nproc=args.nproc, backend="gloo"),
    }
    result["meta"]["command"] = "python -m qsdp.bench.gpu_smoke " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "gpu_smoke.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{'all passed' if result['passed'] else 'FAILED'} in {result['wall_time_s']:.0f} s; "
          f"results in {out / 'gpu_smoke.json'}", flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
