"""Counter-based random numbers: a pure function of (seed, index).

Stochastic rounding must give the same bits on every rank, in the forward and the backward
gather of one step, and in a GPU kernel that reproduces the CPU reference exactly. A global
generator that advances cannot promise any of that; a hash of the element's index can.

The hash works on 32-bit words held in int64 tensors (so every product fits without overflow)
and is written with operations a Triton kernel has too: multiply, xor, shift, mask.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finalizer (lowbias32 constants) on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    x = x ^ (x >> 16)
    return x


def seed_key(seed: int, stream: int = 0) -> int:
    """Fold an arbitrary Python int seed and a stream number into one 32-bit key."""
    s = torch.tensor([(seed & _MASK32) ^ ((stream * 0x9E3779B9) & _MASK32)], dtype=torch.int64)
    # The high word goes in after a round of mixing: xor-ing both words together first made
    # seeds ``a + (b << 32)`` and ``b + (a << 32)`` (e.g. 1 and 2**32) collide. Unchanged for
    # seeds in [0, 2**32).
    return int(_mix32(_mix32(s) ^ ((seed >> 32) & _MASK32))[0])


def uniform(
    seed: int, n: int, *, offset: int = 0, stream: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``n`` floats in [0, 1) (float32, multiples of 2**-24), element ``i`` a function of
    ``(seed, stream, offset + i)`` alone."""
    key = seed_key(seed, stream)
    idx = torch.arange(offset, offset + n, dtype=torch.int64, device=device) & _MASK32
    x = _mix32((idx * 0x9E3779B1 + key) & _MASK32)
    x = _mix32(x ^ key)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


def fresh_seed() -> int:
    """A seed drawn from torch's global generator, for callers that did not pass one."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def derive_seed(*parts: int) -> int:
    """A 32-bit seed from a tuple of integers (base seed, collective id, step, rank, ...): each
    part is folded in through the hash, so nearby tuples give unrelated seeds."""
    key = 0x2545F491
    for p in parts:
        key = seed_key(int(p) ^ key, stream=len(str(p)))
    return key
