"""``qsdp bench memory``: what each preset's comms keep and add, per rank, against ``fsdp``.

A GPT large enough for the buffers to show (``--layers`` x ``--width``, fp32) trains in 4 local
processes treated as 2 nodes x 2 ranks (gloo), once per case. Per rank:

* ``persistent_comm_bytes``: the tensors qsdp's comm objects hold between steps (weight-difference
  replicas, flags), summed over the FSDP groups;
* ``step_peak_bytes``: the peak of the bytes allocated above what was held when a training step
  began (forward, backward, optimizer step), after two warm-up steps. CUDA:
  ``torch.cuda.max_memory_allocated``; CPU: the allocator's own events recorded by
  ``torch.profiler`` (every allocation and free, in order), so the number is the tensors' bytes,
  not resident-set noise;
* ``param_shard_bytes``: the rank's share of the parameters, for scale.

Cases: ``fsdp`` (ZeRO-3), ``fsdp-zero2`` (``reshard_after_forward=False``: unsharded parameters
kept from forward to backward), ``qsdp``, ``zeropp``, ``sdp4bit`` (node replicas, the default on
2 x 2), ``sdp4bit-full`` (``weights.replica=full``) and ``sdp4bit-one-node`` (the 4 ranks as one node,
where nothing crosses a node and no replica is held).
"""

from __future__ import annotations

from typing import Any

from qsdp.text_table import aligned

from .report import emit, meta
from qsdp.usage import UsageParser, save_path

CASES: dict[str, tuple[str, dict[str, Any], bool]] = {
    # name: (preset, overrides, reshard_after_forward)
    "fsdp": ("fsdp", {}, True),
    "fsdp-zero2": ("fsdp", {}, False),
    "qsdp": ("qsdp", {}, True),
    "zeropp": ("zeropp", {}, True),
    "sdp4bit": ("sdp4bit", {}, True),
    "sdp4bit-full": ("sdp4bit", {"weights.replica": "full"}, True),
    # The same 4 ranks as one node: nothing crosses a node, so no replica is held.
    "sdp4bit-one-node": ("sdp4bit", {"local_world_size": 4}, True),
}


def persistent_bytes(handle: Any) -> int:
    """Bytes of the tensors held by the comm objects of a :class:`qsdp.QuantizedComms`."""
    import torch

    return sum(
        v.numel() * v.element_size()
        for comm in [*handle.all_gathers, *handle.reduce_scatters]
        for v in vars(comm).values() if isinstance(v, torch.Tensor)
    )


def _cpu_peak(step) -> int:
    """Run ``step()``; the peak of bytes allocated minus freed since it began (profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _cuda_peak(step) -> int:
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _one_case(name: str, layers: int, width: int, seq_len: int, batch: int, ranks_per_node: int,
              device) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import qsdp
    from qsdp.train.model import GPT, GPTConfig, transformer_blocks

    preset, overrides, reshard = CASES[name]
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(GPTConfig(vocab_size=256, block_size=seq_len, n_layer=layers, n_head=8, n_embd=width))
    for block in transformer_blocks(model):
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    handle = qsdp.quantize_comms(model, preset, overrides={"local_world_size": ranks_per_node, **overrides})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())

    def step() -> None:
        x = torch.randint(0, 256, (batch, seq_len + 1), generator=g).to(device)
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # replicas and optimizer state established
        step()
    peak = _cuda_peak(step) if device.type == "cuda" else _cpu_peak(step)
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    result = {"persistent_comm_bytes": persistent_bytes(handle), "step_peak_bytes": peak,
              "param_shard_bytes": shard}
    handle.close()
    return result


def _worker(cases: list[str], layers: int, width: int, seq_len: int, batch: int, ranks_per_node: int,
            use_cuda: bool) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    try:
        return {c: _one_case(c, layers, width, seq_len, batch, ranks_per_node, device) for c in cases}
    finally:
        dist.destroy_process_group()


def measure(cases: list[str], *, layers: int = 4, width: int = 512, seq_len: int = 64, batch: int = 4,
            nproc: int = 4, ranks_per_node: int = 2, use_cuda: bool = False) -> dict[str, Any]:
    """Every case on ``nproc`` local ranks; JSON-ready, per case and rank."""
    from ..launch import launch_local
    from ..train.model import GPTConfig, n_params

    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; allowed: {', '.join(CASES)}")
    per_rank = launch_local(_worker, nproc, cases, layers, width, seq_len, batch, ranks_per_node, use_cuda)
    params = n_params(GPTConfig(vocab_size=256, block_size=seq_len, n_layer=layers, n_head=8, n_embd=width))
    out: dict[str, Any] = {"params": params, "model_bytes": 4 * params, "nodes": nproc // ranks_per_node,
                           "ranks_per_node": ranks_per_node, "cases": {}}
    for c in cases:
        ranks = [per_rank[r][c] for r in sorted(per_rank)]
        out["cases"][c] = {"per_rank": ranks, **{
            f"max_{k}": max(r[k] for r in ranks) for k in ("persistent_comm_bytes", "step_peak_bytes")}}
    base = out["cases"].get("fsdp")
    for r in out["cases"].values():
        if base:
            r["step_peak_vs_fsdp"] = r["max_step_peak_bytes"] / base["max_step_peak_bytes"]
    return out


def format_table(result: dict[str, Any]) -> str:
    mb = 1e6
    rows = [("case", "comm state/rank", "step peak/rank", "vs fsdp")]
    for c, r in result["cases"].items():
        rows.append((c, f"{r['max_persistent_comm_bytes'] / mb:.2f} MB", f"{r['max_step_peak_bytes'] / mb:.2f} MB",
                     f"{r.get('step_peak_vs_fsdp', float('nan')):.2f}x"))
    lines = aligned(rows)
    head = (f"{result['params'] / 1e6:.1f}M parameters ({result['model_bytes'] / mb:.1f} MB fp32), "
            f"{result['nodes']} nodes x {result['ranks_per_node']} ranks")
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(prog="qsdp bench memory", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE",
                        help=f"default all: {', '.join(CASES)}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512, help="n_embd (a multiple of 8)")
    parser.add_argument("--cuda", action="store_true", help="one GPU per local rank (modulo the GPUs there are)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.width < 8 or args.width % 8:
        parser.error(f"--layers={args.layers} must be >= 1 and --width={args.width} a positive multiple of 8")
    result = measure(args.cases, layers=args.layers, width=args.width, use_cuda=args.cuda)
    import torch

    device = torch.cuda.get_device_name() if args.cuda else "cpu (gloo)"
    result["meta"] = meta("memory", argv, device)
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)
