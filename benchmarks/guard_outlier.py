"""``python -m benchmarks.guard_outlier``: a layer with outlier gradients is the one the guard moves.

The ``tiny`` GPT in 4 local processes as 2 nodes x 2 ranks (gloo) trains on the embedded corpus
under a preset with the accuracy guard at its defaults (a round right after the first update,
then every 50 steps, gradients moved from step 50 on). One block's MLP input projection
(``blocks.B.mlp.c_fc.weight``) gets the same large values added to its gradient on every rank
(a loss term ``sum(W * S)`` taken inside the forward, ``S`` fixed: no SGD noise, a quantizer
range far wider than its neighbours'). Per seed: which groups moved, which part, and the ratios
the deciding round measured. Paired with a run without the outliers (same seed), which moves
nothing.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

import qsdp
from qsdp.guard import GuardConfig
from qsdp.launch import launch_local
from qsdp.results import emit, meta
from qsdp.train.data import ByteTokenizer, TokenDataset, load_corpus
from qsdp.train.trainer import adamw
from qsdp.bench.workload import _sharded_gpt

SPIKE = 1.0  # the outliers' value, added to every 97th element of the weight's gradient


def run(preset: str, seed: int, block: int | None, steps: int, batch_size: int, seq_len: int) -> dict[str, Any]:
    """On each rank: ``steps`` AdamW steps with the guard at its defaults; its moves and readings."""
    torch.set_num_threads(1)
    dataset = TokenDataset.from_text(load_corpus(None), ByteTokenizer(), seed=seed)
    torch.manual_seed(seed)
    model, _ = _sharded_gpt("tiny", dataset.vocab_size, seq_len, torch.device("cpu"), "float32")
    terms: list[torch.Tensor] = []
    if block is not None:
        def outliers(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            spikes = torch.zeros(module.weight.shape)
            spikes.view(-1)[::97] = SPIKE
            terms.append((module.weight * spikes).sum())
        model.blocks[block].mlp.c_fc.register_forward_hook(outliers)
    handle = qsdp.quantize_comms(model, preset, overrides={"local_world_size": 2}, guard=GuardConfig())
    optimizer = adamw(model.parameters(), 3e-3, 0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        x, y = dataset.batch(step, rank, world, batch_size, seq_len)
        _, loss = model(x, y)
        (loss + sum(terms)).backward()
        terms.clear()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    guard = handle.guard
    return {"moves": [e.line() for e in guard.escalations],
            "moved": sorted({(e.name, e.part) for e in guard.escalations}),
            "readings": [{"step": s, "q_sgd": [r.grad_ratio for r in rs], "w_err_step": [r.weight_ratio for r in rs]}
                         for s, rs in guard.readings],
            "groups": guard.names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.guard_outlier", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sdp4bit")
    parser.add_argument("--block", type=int, default=2, help="the block given outlier gradients (default 2)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=56, help="past the first round that moves gradients (53)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--save", metavar="FILE")
    args = parser.parse_args(argv)
    runs = []
    for seed in range(args.seeds):
        for block in (args.block, None):
            r = launch_local(run, 4, args.preset, seed, block, args.steps, 8, 64)[0]
            runs.append({"seed": seed, "outliers_in": None if block is None else f"blocks.{block}", **r})
            print(f"seed {seed}, outliers {'in blocks.' + str(block) if block is not None else 'none'}: "
                  f"moved {r['moved'] or 'nothing'}", flush=True)
    target = f"blocks.{args.block}"
    with_outliers = [r for r in runs if r["outliers_in"]]
    result = {"preset": args.preset, "block": target, "steps": args.steps, "spike": SPIKE, "runs": runs,
              "only_that_layer_moved": all(r["moved"] == [(target, "gradients")] for r in with_outliers),
              "nothing_moved_without": all(not r["moved"] for r in runs if not r["outliers_in"])}
    result["meta"] = meta("guard_outlier", argv, "cpu (gloo)", program="python -m benchmarks.guard_outlier")
    return emit(result, as_json=args.json, save=args.save,
                format_text=lambda r: f"only {target}'s gradients moved: {r['only_that_layer_moved']}; "
                                      f"nothing moved without outliers: {r['nothing_moved_without']}")


if __name__ == "__main__":
    raise SystemExit(main())
