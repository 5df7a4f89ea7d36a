"""The benchmark workload: a few timed training steps of a GPT under FSDP2 + qsdp.

Runs in a worker process of an existing torch.distributed world (torchrun, or
:func:`qsdp.launch.launch_local`); also runnable as ``python -m qsdp.bench.workload ...`` under
torchrun, writing rank 0's result as JSON (what the cluster benchmark launches in each node).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import qsdp
from qsdp.codecs.usage import implementations_run
from qsdp.train.args import PARAM_DTYPES
from qsdp.train.model import MODEL_SIZES, count_params, default_vocab, make_gpt, transformer_blocks

from .step_phases import phase_times


def _sharded_gpt(model_name: str, vocab: int, seq_len: int, dev: torch.device, param_dtype: str,
                 mesh: Any = None) -> tuple[torch.nn.Module, int]:
    """The GPT on ``dev``, every block and the root under FSDP2 (on ``mesh``: a 2-D one is
    FSDP2's native HSDP), in ``param_dtype`` (gradients reduced in fp32), and its parameter count."""
    torch.manual_seed(0)
    model = make_gpt(model_name, vocab, seq_len).to(dev)
    n_params = count_params(model)
    dtype = PARAM_DTYPES[param_dtype]
    policy = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
              if dtype != torch.float32 else MixedPrecisionPolicy())
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, n_params


def _timed_steps(model: torch.nn.Module, vocab: int, batch_size: int, seq_len: int, dev: torch.device,
                 warmup: int, steps: int, profiler: Any) -> list[float]:
    """Each timed step's wall time, between barriers; the meter, the codec record and the
    profiler start after the warm-up."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            qsdp.comm_stats(reset=True)
            implementations_run(reset=True)  # like the meter: the codecs of the timed steps
            if profiler is not None:
                profiler.start()
        dist.barrier()
        started = time.perf_counter()
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator).to(dev)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dev.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels are done before its time is taken
        dist.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return times


def run_steps(
    preset: str,
    steps: int,
    model_name: str = "tiny",
    seq_len: int = 64,
    batch_size: int = 4,
    ranks_per_node: int | None = None,
    warmup: int = 1,
    profile: bool = False,
    device: str = "cpu",
    param_dtype: str = "float32",
    vocab: int | None = None,
) -> dict[str, Any]:
    """``warmup`` + ``steps`` optimizer steps on random tokens; returns rank-local step times and
    the byte meter over the timed steps (and, with ``profile``, the host time per phase of the
    timed steps: see :mod:`qsdp.bench.phases`). Initializes (and destroys) the process group
    from the environment if none exists. ``device="cuda"``: the ranks share the GPUs (rank on
    GPU ``LOCAL_RANK % count``, gloo carrying CUDA tensors); ``param_dtype``: FSDP2's mixed
    precision (gradients reduced in fp32); ``vocab``: default :func:`default_vocab`."""
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo")
    try:
        vocab = vocab or default_vocab(model_name)
        model, n_params = _sharded_gpt(model_name, vocab, seq_len, dev, param_dtype)
        overrides = {} if ranks_per_node is None else {"local_world_size": ranks_per_node}
        qsdp.quantize_comms(model, preset, overrides=overrides)
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
        times = _timed_steps(model, vocab, batch_size, seq_len, dev, warmup, steps, profiler)
        result = {
            "preset": preset,
            "stats": qsdp.comm_stats(reset=True),
            "step_times_s": times,
            "step_time_s": statistics.median(times) if times else 0.0,
            "tokens_per_step": batch_size * seq_len * dist.get_world_size(),
            "n_params": n_params,
            "device": dev.type,
            "param_dtype": param_dtype,
            "codec_kernels": implementations_run(),
        }
        if profiler is not None:
            profiler.stop()
            result["phases_s"] = phase_times(profiler.key_averages(), sum(times), steps)
        return result
    finally:
        if own_group:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qsdp.bench.workload")
    parser.add_argument("--preset", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", default="tiny", choices=tuple(MODEL_SIZES))
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--param-dtype", choices=tuple(PARAM_DTYPES), default="float32")
    parser.add_argument("--vocab", type=int, default=None, help="default: 50257 for gpt2-* sizes, else 256")
    parser.add_argument("--out", help="rank 0 writes its result here as JSON")
    args = parser.parse_args(argv)

    result = run_steps(args.preset, args.steps, args.model, args.seq_len, args.batch_size,
                       args.ranks_per_node, args.warmup, device=args.device,
                       param_dtype=args.param_dtype, vocab=args.vocab)
    if args.out and os.environ.get("RANK", "0") == "0":
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
