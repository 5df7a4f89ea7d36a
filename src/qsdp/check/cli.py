"""``qsdp check``'s arguments: parse, validate before any work, measure, print or save."""

from __future__ import annotations

import argparse
import sys

import torch

from ..config import ConfigError, preset_names, resolve_config
from ..overrides import SetOverride, parse_override
from ..results import emit, meta
from ..train.args import PARAM_DTYPES
from ..train.data import DataError
from ..train.model import MODEL_SIZES
from .measure import CheckSpec, measure_many
from .models import ModelError
from .report import format_text, result
from ..usage import UsageParser, save_path




def _parser() -> argparse.ArgumentParser:
    d = CheckSpec()
    p = UsageParser(prog="qsdp check", description=(
        "Will a preset's quantized communication hurt this model? Per FSDP group: the variance the "
        "gradient path adds next to SGD's own, the weight error next to one optimizer step, the "
        "weight-difference compressor's error, and a verdict. One process, CPU or CUDA."))
    p.add_argument("--model", default=d.model, help=f"a GPT size ({', '.join(MODEL_SIZES)}), a Hugging Face "
                   f"config .json, or module:function returning an nn.Module (default {d.model})")
    p.add_argument("--preset", default="sdp4bit", help=f"preset or variant: {', '.join(preset_names())}; "
                   "several, comma-separated, are measured along one run and compared")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action=SetOverride, type=parse_override,
                   default=[], help="override a config field, e.g. grads.bits_inter=8 (repeatable)")
    p.add_argument("--nodes", type=int, default=d.nodes, help=f"D, emulated nodes (default {d.nodes})")
    p.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node,
                   help=f"M, emulated ranks per node (default {d.ranks_per_node})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help=f"exact optimizer steps before measuring (default {d.warmup_steps}; too few and "
                   "q/SGD overstates the gradient risk: the output flags it)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"measured optimizer steps (default {d.steps})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"AdamW's learning rate (default {d.lr:g}); the "
                   "weight error per step grows as it falls: check with your schedule's smallest")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="0 = off")
    p.add_argument("--param-dtype", default=d.param_dtype, choices=sorted(PARAM_DTYPES),
                   help="the dtype the weights travel in")
    p.add_argument("--data", default=None, metavar="FILE.txt", help="UTF-8 text (default: the embedded corpus)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=None, type=_device, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _device(text: str) -> str:
    """``--device``: cpu, cuda or cuda:N (what torch names), checked while parsing."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = CheckSpec(model=a.model, nodes=a.nodes, ranks_per_node=a.ranks_per_node, batch_size=a.batch_size,
                     seq_len=a.seq_len, warmup_steps=a.warmup_steps, steps=a.steps, lr=a.lr,
                     weight_decay=a.weight_decay, grad_clip=a.grad_clip, param_dtype=a.param_dtype,
                     data=a.data, seed=a.seed, device=device)
    try:
        spec.validate()
        cfgs = [resolve_config(name, dict(a.overrides)) for name in a.preset.split(",")]
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available")
    except (ValueError, ConfigError) as e:
        parser.error(str(e))
    try:
        results = [result(m) for m in measure_many(spec, cfgs, progress=None if a.quiet else _progress)]
    except (ModelError, DataError) as e:
        parser.error(str(e))
    dev = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    command = "qsdp check " + " ".join(argv if argv is not None else sys.argv[1:])
    res = results[0] if len(results) == 1 else {"results": results}
    res["meta"] = {**meta("check", argv, dev), "command": command}
    return emit(res, as_json=a.json, save=a.save, format_text=format_text)


def _progress(done: int, total: int) -> None:
    end = "\n" if done == total else "\r"
    print(f"qsdp check: step {done}/{total}", end=end, file=sys.stderr, flush=True)
