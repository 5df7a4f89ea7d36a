"""``python -m benchmarks.convergence``: the papers' central claim, same loss with fewer bits, with intervals.

Every variant trains the same model on the same data (the embedded corpus or ``--data FILE``)
with the same schedule, in 4 local workers treated as 2 nodes x 2 ranks. Runs are paired: for
each seed, the baseline and every variant start from the same weights and see the same batches,
so the only difference inside a pair is what travels on the wire. The table has the shape of
SDP4Bit's Table 1: final validation loss per variant and its relative gap to ``fsdp``, here the
mean over the seeds with a 95% t interval over the paired gaps; the targets are judged on the
interval. The loss curves of the first seed are plotted with :func:`qsdp.train.plots.plot_runs`
(into that seed's directory unless ``--plots`` says where, so that sweeps over other seeds
sharing ``--out`` keep their own).

Variants: ``fsdp`` (baseline), SDP4Bit's ablations ``qw4`` (4-bit direct weights), ``qwd4``
(4-bit weight differences), ``tlq4`` (two-level 8/4-bit gradients), ``tlq-hs`` (with Hadamard),
the full ``sdp4bit``, the ``zeropp`` baseline (qW + ULq), QSDP's ``qsdp`` (W8G8), its halves
``qsdp-w8`` (weights only) and ``qsdp-g8`` (gradients only), and ``qsdp-w4g4``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from qsdp.config import resolve_config
from qsdp.text_table import aligned
from qsdp.guard import DEFAULT_EVERY
from qsdp.train.args import TrainArgs
from qsdp.train.launcher import launch, plan_run
from qsdp.train.owned import NotOwnedError, check_clearable, clear_owned, mark_owned
from qsdp.train.plots import plot_runs
from qsdp.usage import save_path

from qsdp.results import emit, meta

from ._cli import run_script
from .paired import paired_gap

PROGRAM = "python -m benchmarks.convergence"
# The marker of the run directories a sweep wrote (see qsdp.train.owned).
OWNER = PROGRAM
# The convergence ablation: the baseline, the SDP4Bit paper's Table 1 variants (weights alone,
# gradients alone), the presets, QSDP's halves alone, then QSDP's aggressive 4-bit setting.
CONVERGENCE_VARIANTS: tuple[str, ...] = (
    "fsdp", "qw4", "qwd4", "tlq4", "tlq-hs", "sdp4bit", "zeropp", "qsdp", "qsdp-w8", "qsdp-g8",
    "qsdp-w4g4")
# The targets of the project's convergence claim: the upper end of the interval of the relative
# gap of the final validation loss.
TARGETS = {"sdp4bit": 0.003, "qsdp": 0.001}


@dataclass(frozen=True)
class Spec:
    """What one convergence comparison trains: every variant once per seed, the same way."""

    variants: tuple[str, ...] = CONVERGENCE_VARIANTS
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    model: str = "tiny"
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    param_dtype: str = "bfloat16"
    data: str | None = None
    nproc: int = 4
    ranks_per_node: int = 2
    eval_batches: int = 32
    device: str = "cpu"

    def backend(self) -> str | None:
        """gloo on CPU and where the ranks share GPUs (NCCL needs one GPU a rank), else NCCL."""
        if self.device != "cuda":
            return None
        import torch

        return "nccl" if torch.cuda.device_count() >= self.nproc else "gloo"

    def device_name(self) -> str:
        """What the result's ``meta.device`` says: the CPU, or the GPU and the backend."""
        if self.device != "cuda":
            return "cpu (gloo)"
        import torch

        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()} ({self.backend()}, {self.nproc} ranks)"


# Named settings: ``tiny`` (every variant, quick) and ``small`` (a model of several million
# parameters trained until its loss flattens, the baseline and the two full presets).
SETTINGS: dict[str, dict[str, Any]] = {
    "tiny": dict(model="tiny", steps=300, seeds=5, lr=3e-3, batch_size=8, variants=CONVERGENCE_VARIANTS),
    "small": dict(model="small", steps=1500, seeds=2, lr=2e-3, batch_size=2, variants=("fsdp", "sdp4bit", "qsdp")),
}


GUARDED = "+guard"  # a variant name ending so: the preset with the accuracy guard (its default K)


def _train_args(spec: Spec, variant: str, seed: int, out: str, progress: bool) -> TrainArgs:
    preset, guarded = variant.removesuffix(GUARDED), variant.endswith(GUARDED)
    return TrainArgs(
        preset=preset, guard_every=DEFAULT_EVERY if guarded else 0,
        out=os.path.join(out, f"seed{seed}", variant), model=spec.model,
        data=spec.data, steps=spec.steps, batch_size=spec.batch_size, seq_len=spec.seq_len,
        lr=spec.lr, warmup=max(1, spec.steps // 10), eval_every=max(1, spec.steps // 6),
        eval_batches=spec.eval_batches, ckpt_every=0, keep_checkpoints=1, seed=seed,
        local_world_size=spec.ranks_per_node, param_dtype=spec.param_dtype, device=spec.device,
        backend=spec.backend(), progress=progress,
    )


def _finished_summary(args: TrainArgs) -> dict[str, Any] | None:
    """The summary of a finished run with exactly these arguments, if its directory holds one."""
    path = os.path.join(args.out, "summary.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        summary = json.load(f)
    wanted = json.loads(json.dumps({k: v for k, v in dataclasses.asdict(args).items() if k != "progress"}))
    done = {k: v for k, v in summary.get("args", {}).items() if k != "progress"}
    return summary if done == wanted else None


def _record(summary: dict[str, Any], seed: int, wall: float) -> dict[str, Any]:
    wire = summary["wire"]
    return {
        "seed": seed, "final_val_loss": summary["final_val_loss"],
        "final_train_loss": summary["final_train_loss"], "wire_bytes_total": summary["wire_bytes_total"],
        "weights_bits_per_elt": wire["weights"]["total"]["bits_per_element"],
        "weights_inter_bits_per_elt": wire["weights"]["inter"]["bits_per_element"],
        "grads_intra_bits_per_elt": wire["grads"]["intra"]["bits_per_element"],
        "grads_inter_bits_per_elt": wire["grads"]["inter"]["bits_per_element"],
        "wall_time_s": wall, "n_params": summary["n_params"], "tokens_per_step": summary["tokens_per_step"],
        **({"guard": summary["guard"]} if summary.get("guard") else {}),
    }


def _train_all(spec: Spec, out: str, reuse: bool, progress: bool) -> dict[str, list[dict[str, Any]]]:
    """Every (seed, variant) run, seed by seed so that partial results are already paired."""
    runs = {(s, v): _train_args(spec, v, s, out, progress) for s in spec.seeds for v in spec.variants}
    finished = {k: summary for k, a in runs.items() if reuse and (summary := _finished_summary(a))}
    todo = {k: a for k, a in runs.items() if k not in finished}
    if reuse:
        # A sweep owns the run directories it marked: one left unfinished, or with other
        # arguments, restarts; one it did not write is refused before anything is deleted.
        try:
            for a in todo.values():
                check_clearable(a.out, OWNER)
        except NotOwnedError as e:
            raise SystemExit(str(e)) from None  # one line (run_script)
        for a in todo.values():
            clear_owned(a.out, OWNER)
    # Every input is checked (and the data prepared) before the first run starts.
    plans = {k: plan_run(a, spec.nproc, prepare_data=True) for k, a in todo.items()}
    for a in todo.values():
        mark_owned(a.out, OWNER)
    records: dict[str, list[dict[str, Any]]] = {v: [] for v in spec.variants}
    for i, ((seed, v), args) in enumerate(runs.items(), 1):
        head = f"[{i}/{len(runs)}] seed {seed} {v} -> {args.out}"
        if (seed, v) in finished:
            summary = finished[(seed, v)]
            print(f"{head}: finished before, reused", file=sys.stderr, flush=True)
            records[v].append(_record(summary, seed, summary["wall_time_s"]))
            continue
        print(head, file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        summary = launch(args, plans[(seed, v)])
        records[v].append(_record(summary, seed, time.perf_counter() - t0))
        print(f"{head}: val loss {summary['final_val_loss']:.5f} in {records[v][-1]['wall_time_s']:.0f} s",
              file=sys.stderr, flush=True)
    return records


def _summarize(records: dict[str, list[dict[str, Any]]], seeds: tuple[int, ...]) -> dict[str, Any]:
    base = [r["final_val_loss"] for r in records.get("fsdp", [])]
    presets: dict[str, Any] = {}
    for v, runs in records.items():
        losses = [r["final_val_loss"] for r in runs]
        first = runs[0]
        presets[v] = {
            "final_val_loss_mean": sum(losses) / len(losses),
            "weights_bits_per_elt": first["weights_bits_per_elt"],
            "weights_inter_bits_per_elt": first["weights_inter_bits_per_elt"],
            "grads_intra_bits_per_elt": first["grads_intra_bits_per_elt"],
            "grads_inter_bits_per_elt": first["grads_inter_bits_per_elt"],
            "wall_time_s": sum(r["wall_time_s"] for r in runs),
            "rel_gap_vs_fsdp": paired_gap(losses, base, seeds).to_dict() if base else None,
            "runs": runs,
        }
    return presets


def _plot_seed(out: str, seed: int, variants: tuple[str, ...], plots: str | None) -> list[str]:
    """The loss curves of ``seed``'s runs under ``out``, drawn into ``plots`` (default: the
    seed's directory)."""
    seed_dir = os.path.join(out, f"seed{seed}")
    missing = [v for v in variants if not os.path.isfile(os.path.join(seed_dir, v, "metrics.jsonl"))]
    if missing:
        raise FileNotFoundError(f"no runs of {', '.join(missing)} in {seed_dir} to plot")
    return plot_runs([os.path.join(seed_dir, v) for v in variants], plots or seed_dir)


def run(spec: Spec, *, out: str = "runs/convergence", reuse: bool = False,
        progress: bool = False, plots: str | None = None) -> dict[str, Any]:
    """Train every variant with every seed and return the JSON-ready result; the first seed's
    loss curves go to ``plots`` (default: ``OUT/seed<first>``)."""
    for v in spec.variants:
        resolve_config(v.removesuffix(GUARDED))  # every name is valid before the first run starts
    records = _train_all(spec, out, reuse, progress)
    first = next(iter(records.values()))[0]
    plots = _plot_seed(out, spec.seeds[0], spec.variants, plots)
    setup = {
        "model": spec.model, "n_params": first["n_params"], "steps": spec.steps,
        "tokens_per_step": first["tokens_per_step"], "param_dtype": spec.param_dtype,
        "nodes": spec.nproc // spec.ranks_per_node, "ranks_per_node": spec.ranks_per_node,
        "batch_size": spec.batch_size, "seq_len": spec.seq_len, "lr": spec.lr,
        "data": spec.data or "chitchat-dataset (embedded)", "eval_batches": spec.eval_batches,
        "device": spec.device,
    }
    return _result(setup, records, plots)


def _result(setup: dict[str, Any], records: dict[str, list[dict[str, Any]]], plots: list[str]) -> dict[str, Any]:
    """The report of paired ``records`` (variant -> one record per seed, in the same seed order)."""
    seeds = tuple(r["seed"] for r in records["fsdp"])
    presets = _summarize(records, seeds)
    return {
        **setup, "tokens": setup["steps"] * setup["tokens_per_step"], "seeds": list(seeds),
        # Summed over the runs: a run reused from an earlier sweep counts its own training time.
        "wall_time_s": sum(r["wall_time_s"] for runs in records.values() for r in runs),
        "presets": presets, "plots": plots,
        "targets": check_targets(presets), "qsdp_halves": qsdp_halves(presets),
    }


# What must agree for saved results to be parts of one comparison.
SETUP_FIELDS = ("setting", "model", "n_params", "steps", "tokens_per_step", "param_dtype", "nodes",
                "ranks_per_node", "batch_size", "seq_len", "lr", "data", "eval_batches", "device")


def _setup(result: dict[str, Any], field: str) -> Any:
    # Results saved before the device was recorded were trained on CPU.
    return result.get(field, "cpu") if field == "device" else result.get(field)


class MergeError(ValueError):
    """Saved results that are not parts of one comparison."""


def merge(parts: dict[str, dict[str, Any]], variants: list[str] | None = None) -> dict[str, Any]:
    """One paired report from results saved by separate sweeps over disjoint seeds (for example
    one seed per machine). ``parts`` maps a name (the file) to its saved result; the plots are
    those of the part with the lowest seed, and ``meta.parts`` keeps what produced each part.
    ``variants``: only these (with ``fsdp``), which every part must hold; the parts may then
    hold others besides (a sweep extended by more seeds of some of its variants)."""
    if len(parts) < 2:
        raise MergeError("merging needs at least two results")
    if variants is not None:
        parts = {name: _only(part, name, variants) for name, part in parts.items()}
    names = sorted(parts, key=lambda n: min(parts[n]["seeds"]))
    first = parts[names[0]]
    for name in names[1:]:
        part = parts[name]
        differ = [f"{k}: {_setup(first, k)!r} in {names[0]}, {_setup(part, k)!r} in {name}"
                  for k in SETUP_FIELDS if _setup(part, k) != _setup(first, k)]
        if list(part["presets"]) != list(first["presets"]):
            differ.append(f"variants: {list(first['presets'])} in {names[0]}, {list(part['presets'])} in {name}")
        if differ:
            raise MergeError("not parts of one comparison: " + "; ".join(differ))
    owner: dict[int, str] = {}
    for name in names:
        for seed in parts[name]["seeds"]:
            if seed in owner:
                raise MergeError(f"seed {seed} is in both {owner[seed]} and {name}: parts must have disjoint seeds")
            owner[seed] = name
    records = {v: sorted((r for n in names for r in parts[n]["presets"][v]["runs"]), key=lambda r: r["seed"])
               for v in first["presets"]}
    result = _result({k: _setup(first, k) for k in SETUP_FIELDS if k != "setting"}, records, first["plots"])
    result["setting"] = first.get("setting")
    result["meta"] = {"parts": {n: parts[n].get("meta") for n in names}}
    return result


def _only(part: dict[str, Any], name: str, variants: list[str]) -> dict[str, Any]:
    """``part`` with only ``fsdp`` and ``variants``, in that order."""
    keep = ["fsdp", *(v for v in variants if v != "fsdp")]
    missing = [v for v in keep if v not in part["presets"]]
    if missing:
        raise MergeError(f"{name} holds no {', '.join(missing)} (it holds {', '.join(part['presets'])})")
    return {**part, "presets": {v: part["presets"][v] for v in keep}}


def check_targets(presets: dict[str, Any]) -> dict[str, Any]:
    """Each target as measured, judged on the interval: met (``True``) or missed (``False``),
    never hidden; ``None`` where one seed gives no interval to judge. ``reading`` says what a miss
    means: the interval on the wrong side of the bound, or the interval too wide to show either."""
    out: dict[str, Any] = {}
    for name, bound in TARGETS.items():
        gap = (presets.get(name) or {}).get("rel_gap_vs_fsdp")
        if gap is not None:
            lo, hi = gap["ci_low"], gap["ci_high"]
            met = None if hi is None else hi <= bound
            reading = ("one seed: no interval" if met is None else "upper end within the bound" if met
                       else "whole interval above the bound" if lo > bound
                       else "interval contains the bound: neither shown nor refuted")
            out[f"{name}_within_{bound:.1%}"] = {
                "mean": gap["mean"], "ci_low": lo, "ci_high": hi, "bound": bound, "met": met, "reading": reading}
    if "qw4" in presets and "qwd4" in presets and presets["qw4"]["rel_gap_vs_fsdp"]:
        qw, qwd = presets["qw4"]["rel_gap_vs_fsdp"], presets["qwd4"]["rel_gap_vs_fsdp"]
        met = None if qw["ci_low"] is None or qwd["ci_high"] is None else qw["ci_low"] > qwd["ci_high"]
        reading = ("one seed: no interval" if met is None else "intervals apart" if met
                   else "qw4 better, intervals apart" if qw["ci_high"] < qwd["ci_low"] else "intervals overlap")
        out["qw4_worse_than_qwd4"] = {"qw4_ci_low": qw["ci_low"], "qwd4_ci_high": qwd["ci_high"],
                                      "met": met, "reading": reading}
    return out


def qsdp_halves(presets: dict[str, Any]) -> dict[str, Any] | None:
    """Which half of ``qsdp`` makes its gap: the mean gaps of the weights-only and gradients-only
    variants (``None`` unless both ran against the baseline)."""
    gaps = {half: (presets.get(v) or {}).get("rel_gap_vs_fsdp") for half, v in
            (("weights", "qsdp-w8"), ("grads", "qsdp-g8"))}
    if None in gaps.values():
        return None
    means = {half: g["mean"] for half, g in gaps.items()}
    return {**{f"{half}_only_mean_gap": m for half, m in means.items()},
            "larger": max(means, key=lambda h: abs(means[h]))}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def format_table(result: dict[str, Any]) -> str:
    rows = [("variant", "val loss (mean)", "vs fsdp (mean)", "95% interval", "weights b/elt",
             "weights inter", "grads intra", "grads inter")]
    for v, r in result["presets"].items():
        gap = r["rel_gap_vs_fsdp"] or {}
        interval = "-" if gap.get("ci_low") is None else f"[{_pct(gap['ci_low'])}, {_pct(gap['ci_high'])}]"
        rows.append((v, f"{r['final_val_loss_mean']:.5f}", _pct(gap.get("mean")), interval,
                     f"{r['weights_bits_per_elt']:.2f}", f"{r['weights_inter_bits_per_elt']:.2f}",
                     f"{r['grads_intra_bits_per_elt']:.2f}",
                     f"{r['grads_inter_bits_per_elt']:.2f}"))
    lines = aligned(rows, rule=True)
    head = (f"GPT '{result['model']}' ({result['n_params'] / 1e6:.2f}M parameters, {result['param_dtype']}), "
            f"{result['steps']} steps x {result['tokens_per_step']} tokens = {result['tokens'] / 1e6:.2f}M tokens, "
            f"{result['nodes']} nodes x {result['ranks_per_node']} ranks on {_setup(result, 'device')}, "
            f"seeds {result['seeds']} (paired), "
            f"corpus: {result['data']}, wall {result['wall_time_s'] / 60:.1f} min")
    verdicts = {True: "met", False: "MISSED", None: "undecided"}
    tail = [f"target {k}: {verdicts[v['met']]}, {v['reading']} "
            f"({', '.join(f'{a}={_fmt(b)}' for a, b in v.items() if a not in ('met', 'reading'))})"
            for k, v in result["targets"].items()]
    if result.get("qsdp_halves"):
        h = result["qsdp_halves"]
        tail.append(f"qsdp halves: weights only {_pct(h['weights_only_mean_gap'])}, gradients only "
                    f"{_pct(h['grads_only_mean_gap'])}: the {h['larger']} make the larger gap")
    return "\n".join([head, *lines, *tail, "plots: " + ", ".join(result["plots"])])


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.5g}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="tiny",
                        help="defaults for the options below: " + "; ".join(
                            f"{k}: {v['model']} model, {v['steps']} steps of {v['batch_size']} sequences "
                            f"per rank, {v['seeds']} seeds, "
                            f"{len(v['variants'])} variants" for k, v in SETTINGS.items()))
    parser.add_argument("--variants", nargs="+", default=None,
                        help="presets or variants to compare (with --merge: only these, of the parts)")
    parser.add_argument("--seeds", type=int, default=None, metavar="N", help="number of paired seeds")
    parser.add_argument("--seed", type=int, default=0, help="first seed (seeds are SEED .. SEED+N-1)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--data", default=None, metavar="FILE", help="any UTF-8 text corpus (default: embedded)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--param-dtype", default="bfloat16",
                        help="compute and all-gather dtype (float32 on CPUs without native bf16)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where every run trains; cuda: NCCL with a GPU per rank, else gloo "
                        "between ranks sharing the GPUs (a sweep's runs and parts share one device)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--local-world-size", type=int, default=2)
    parser.add_argument("--out", default="runs/convergence", help="run directories")
    parser.add_argument("--plots", metavar="DIR", help="where the first seed's loss curves go (default: "
                        "OUT/seed<first>); with --merge, drawn afresh from the lowest seed's runs in OUT")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the runs in OUT that finished with the same arguments, start the "
                        "others afresh (resume an interrupted sweep)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar for each run")
    parser.add_argument("--merge", nargs="+", metavar="RESULT.json",
                        help="train nothing: combine results saved (--save) by sweeps of the same "
                        "setting over disjoint seeds, e.g. one seed per machine, into one paired report")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    return parser


def _merge_files(paths: list[str], argv: list[str] | None, out: str, plots: str | None,
                 variants: list[str] | None = None) -> dict[str, Any]:
    parts = {}
    for path in paths:
        try:
            with open(path) as f:
                parts[path] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise MergeError(f"cannot read {path}: {e}") from e
        if not {"seeds", "presets", "plots"} <= parts[path].keys():
            raise MergeError(f"{path} is not a result of the convergence benchmark")
    result = merge(parts, variants)
    if plots:
        try:
            result["plots"] = _plot_seed(out, result["seeds"][0], tuple(result["presets"]), plots)
        except FileNotFoundError as e:
            raise MergeError(f"--plots: {e}") from e
    devices = sorted({str((p.get("meta") or {}).get("device")) for p in parts.values()})
    result["meta"] = meta("convergence", argv, ", ".join(devices), program=PROGRAM, **result["meta"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.merge:
        try:
            result = _merge_files(args.merge, argv, args.out, args.plots, args.variants)
        except MergeError as e:
            parser.error(str(e))
        return emit(result, as_json=args.json, save=args.save, format_text=format_table)
    setting = SETTINGS[args.setting]
    steps = setting["steps"] if args.steps is None else args.steps
    n_seeds = setting["seeds"] if args.seeds is None else args.seeds
    if steps < 1:
        parser.error(f"--steps={steps} must be at least 1")
    if n_seeds < 1:
        parser.error(f"--seeds={n_seeds} must be at least 1")
    variants = tuple(args.variants or setting["variants"])
    if "fsdp" not in variants:
        parser.error("--variants must include the baseline 'fsdp': every gap is paired with it")
    spec = Spec(
        variants=variants, seeds=tuple(range(args.seed, args.seed + n_seeds)),
        model=args.model or setting["model"], steps=steps,
        batch_size=setting["batch_size"] if args.batch_size is None else args.batch_size,
        seq_len=args.seq_len, lr=setting["lr"] if args.lr is None else args.lr,
        param_dtype=args.param_dtype, data=args.data, nproc=args.nproc, ranks_per_node=args.local_world_size,
        device=args.device)
    result = run(spec, out=args.out, reuse=args.reuse, progress=not args.no_progress, plots=args.plots)
    result["setting"] = args.setting
    result["meta"] = meta("convergence", argv, spec.device_name(), program=PROGRAM)
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)


if __name__ == "__main__":
    raise SystemExit(run_script(main, PROGRAM))
