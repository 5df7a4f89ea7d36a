"""HSDP with a quantized inter-node gradient all-reduce: FSDP2 shards inside each node, the
nodes hold replicas, and only the all-reduce between the nodes is quantized (4-bit, Hadamard).

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/hsdp.py
    torchrun --nproc-per-node 4 examples/hsdp.py --nodes 2    # one machine seen as 2 nodes x 2

``--native``: FSDP2's own HSDP mesh instead (``fully_shard(mesh=<(replicate, shard) mesh>)``),
quantized by the same ``quantize_comms(model, preset)`` with no groups named.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import qsdp


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="hsdp4", help="hsdp4: only the inter-node all-reduce quantized")
    parser.add_argument("--nodes", type=int, default=None, help="default: world size / LOCAL_WORLD_SIZE")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--native", action="store_true", help="shard on FSDP2's native 2-D HSDP mesh")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = args.nodes or world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    groups = qsdp.hsdp_groups(nodes=nodes)  # a (replicate, shard) mesh: shard inside the node

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), *[Block(64) for _ in range(4)], torch.nn.Linear(64, 1))
    if torch.cuda.is_available():
        model = model.cuda()
    mesh = groups.mesh if args.native else groups.shard_mesh
    for block in model[1:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.native:  # the replicas are the mesh's first dimension
        handle = qsdp.quantize_comms(model, args.preset)
    else:
        handle = qsdp.quantize_comms(model, args.preset, group=groups.shard_group,
                                     replicate_group=groups.replicate_group)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(rank)
    device = next(model.parameters()).device
    for step in range(args.steps):
        x = torch.randn(32, 16, generator=gen).to(device)
        y = x[:, :4].sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            stats = handle.comm_stats(reset=False)
            grads, weights = stats["grads"], stats["weights"]
            print(f"step {step:3d}  loss {loss.item():.4f}  grads between nodes "
                  f"{grads['inter']['bits_per_element']:.2f} b/elt, inside {grads['intra']['bits_per_element']:.2f} b/elt; "
                  f"weights inside {weights['intra']['bits_per_element']:.2f} b/elt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
