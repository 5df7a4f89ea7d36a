"""PyTorch Lightning ``ModelParallelStrategy`` (and Fabric) with FSDP2: qsdp at the end of
``configure_model`` / inside ``parallelize_fn``.

Lightning calls ``configure_model`` on a meta-device model, shards it there, then materialises it
(``to_empty`` + ``reset_parameters``), builds the optimizers and loads ``ckpt_path``. qsdp reads no
parameter data when it is attached and builds its weight-difference replicas at the first
all-gather, so they start from the weights that training really starts from.

    python examples/recipes/lightning_fsdp2.py --devices 4 --preset sdp4bit           # Trainer
    python examples/recipes/lightning_fsdp2.py --devices 4 --preset sdp4bit --fabric  # Fabric
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import lightning as L
import qsdp


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def mlp(width: int = 32, depth: int = 2) -> nn.Sequential:
    """``[B, 8] -> [B, 3]`` float32: input layer, ``depth`` residual blocks, head."""
    return nn.Sequential(nn.Linear(8, width), *[Block(width) for _ in range(depth)], nn.Linear(width, 3))


def shard_with_qsdp(model: nn.Sequential, mesh: DeviceMesh, preset: str) -> qsdp.QuantizedComms:
    """FSDP2 on the blocks and the root over ``mesh``'s data-parallel dimension, then qsdp."""
    dp = mesh["data_parallel"]
    for block in model[1:-1]:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return qsdp.quantize_comms(model, preset, group=dp.get_group())


def batch(step: int, rank: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression task: ``x [n, 8]``, ``y [n, 3]`` float32."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 8, generator=g)
    return x, torch.stack([x[:, 0] * 2 - x[:, 1], x[:, 2] * x[:, 3], x[:, 4].sin()], dim=1)


class Regression(L.LightningModule):
    """The model is built in ``configure_model`` (on the meta device under the strategy)."""

    def __init__(self, preset: str = "sdp4bit", lr: float = 1e-2) -> None:
        super().__init__()
        self.preset, self.lr = preset, lr
        self.net: nn.Sequential | None = None
        self.qsdp: qsdp.QuantizedComms | None = None

    def configure_model(self) -> None:
        if self.net is not None:  # Lightning may call this hook more than once
            return
        with torch.device("meta"):  # the strategy materialises it after sharding
            self.net = mlp()
        self.qsdp = shard_with_qsdp(self.net, self.device_mesh, self.preset)  # last line of the hook

    def training_step(self, xy, _):
        x, y = xy
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class RegressionData(torch.utils.data.IterableDataset):
    def __init__(self, steps: int, rank: int) -> None:
        self.steps, self.rank = steps, rank

    def __iter__(self):
        return (batch(s, self.rank) for s in range(self.steps))


def fabric_parallelize(preset: str, handles: list | None = None):
    """Fabric's ``parallelize_fn``: shard and attach qsdp, return the module. The
    :class:`qsdp.QuantizedComms` handle is appended to ``handles`` when given."""

    def parallelize(model: nn.Sequential, device_mesh: DeviceMesh) -> nn.Sequential:
        handle = shard_with_qsdp(model, device_mesh, preset)
        if handles is not None:
            handles.append(handle)
        return model

    return parallelize


def main() -> None:
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
    from lightning.pytorch.strategies import ModelParallelStrategy

    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--preset", default="sdp4bit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fabric", action="store_true")
    args = parser.parse_args()
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.fabric:
        trainer = L.Trainer(accelerator=accelerator, devices=args.devices, max_steps=args.steps,
                            strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1))
        trainer.fit(Regression(args.preset), RegressionData(args.steps, trainer.global_rank))
        return
    strategy = FabricModelParallel(parallelize_fn=fabric_parallelize(args.preset),
                                   data_parallel_size=args.devices, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator=accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = mlp()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    for step in range(args.steps):
        x, y = batch(step, fabric.global_rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
