"""Small models and a training loop shared by the FSDP2 tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    """An MLP-mixer-like regression net: blocks are FSDP groups, plus a tiny 1-D head layer."""

    def __init__(self, width: int = 32, depth: int = 2, out: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, out)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(seed: int = 0, width: int = 32, depth: int = 2, dtype=torch.float32,
          reshard_after_forward: bool = True, param_dtype=None) -> TinyNet:
    torch.manual_seed(seed)
    model = TinyNet(width, depth).to(dtype)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype else MixedPrecisionPolicy()
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


def batch(step: int, rank: int, n: int = 16, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 8, generator=g)
    y = torch.stack([x[:, 0] * 2 - x[:, 1], x[:, 2] * x[:, 3], x[:, 4].sin()], dim=1)
    return x.to(dtype), y.to(dtype)


def optimizer_steps(model, opt, first: int, count: int, rank: int) -> list[float]:
    """``count`` steps of the caller's ``opt`` from step ``first`` on this rank's batches of the
    regression task (a loop that saves and resumes keeps its optimizer); returns the losses."""
    losses = []
    for step in range(first, first + count):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(model, steps: int, rank: int, lr: float = 1e-2, dtype=torch.float32, accumulate: int = 1,
          device="cpu") -> list[float]:
    """Adam on a fixed regression task, ``accumulate`` micro-batches a step (gradient sync only
    on the last, as FSDP2 users accumulate); returns the (rank-local) losses."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            if accumulate > 1:
                model.set_requires_gradient_sync(micro == accumulate - 1)
            x, y = (t.to(device) for t in batch(step * accumulate + micro, rank, dtype=dtype))
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
