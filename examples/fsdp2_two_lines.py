"""An ordinary FSDP2 training script; the quantized communication is the two marked lines.

    torchrun --nproc-per-node 4 examples/fsdp2_two_lines.py --preset sdp4bit --emulate-nodes 2
    torchrun --nproc-per-node 4 examples/fsdp2_two_lines.py --preset sdp4bit  # 1 node: 32-bit weights, 8-bit grads
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/fsdp2_two_lines.py  # 2 nodes
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import qsdp  # (1/2)


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="sdp4bit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--emulate-nodes", type=int, default=None, metavar="N",
                        help="treat this machine's ranks as N nodes (consecutive ranks per node), to see the "
                             "inter-node 4-bit traffic on one machine; real nodes are found from the host")
    args = parser.parse_args()

    if torch.cuda.is_available():  # one GPU a process, as torchrun numbers them
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    if args.emulate_nodes:  # qsdp reads a process's node from QSDP_NODE before the host name
        if dist.get_world_size() % args.emulate_nodes:
            raise SystemExit(f"--emulate-nodes {args.emulate_nodes} must divide the {dist.get_world_size()} ranks")
        os.environ["QSDP_NODE"] = f"node{rank * args.emulate_nodes // dist.get_world_size()}"
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), *[Block(64) for _ in range(4)], torch.nn.Linear(64, 1))
    model.to(device)
    for block in model[1:-1]:
        fully_shard(block)
    fully_shard(model)
    qsdp.quantize_comms(model, args.preset)  # (2/2)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(32, 16, generator=gen).to(device)  # the inputs and targets on the model's device
        y = x[:, :4].sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            wire = qsdp.comm_stats()  # bits per element the byte meter saw since the last print, by link
            bits = lambda kind, level: f"{wire[kind][level]['bits_per_element']:5.2f}"  # noqa: E731
            print(f"step {step:3d}  loss {loss.item():.4f}  weights inter {bits('weights', 'inter')} intra "
                  f"{bits('weights', 'intra')}  grads inter {bits('grads', 'inter')} intra {bits('grads', 'intra')} b/elt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
