"""The kernel launches of each collective's comm step on a GPU, and one H200 measurement.

The counts are data, here alone: :data:`CENSUS`, what ``qsdp bench census`` counts in the code
as it is (the model's default), and :data:`AT_C14EB26`, the code the H200 measurement ran
(:data:`H200_CODEC_SHARE`, one step of ``qsdp bench codec-share`` per preset on one H200). The
model prices the host by the census's host floor of each comm step, not by its launches
(:mod:`qsdp.perfmodel.host_census`); the launches are reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

@dataclass(frozen=True)
class LaunchCounts:
    """Kernel launches per call of each comm step (``Collective.call``) on the GPU path, beyond
    FSDP2's own collective (torch kernels plus Triton kernels; the collectives counted apart).

    ``per_call``: by step; a two-level reduce-scatter launches ``two_level_group`` once per group,
    ``two_level_exchange`` per exchange and ``two_level_slice`` per rounding slice; the quantized
    HSDP all-reduce ``hsdp_all_reduce`` (first phase, second phase). ``source`` says where the
    counts come from."""

    source: str
    per_call: Mapping[str, int]
    two_level_group: int
    two_level_exchange: int
    two_level_slice: int
    hsdp_all_reduce: tuple[int, int]

    def two_level(self, slices: int, first: bool) -> int:
        """Launches of one exchange of a two-level reduce-scatter carrying ``slices`` rounding
        slices; ``first``: the group's first exchange, which also carries the group's own."""
        return self.two_level_exchange + self.two_level_slice * slices + (self.two_level_group if first else 0)


# The code the H200 measurement below ran (commit c14eb26), counted by reading its CUDA path: a
# two-level reduce-scatter's rounding slice launched 3 Triton kernels and about 6 torch ops (a
# gather of its columns, the wire's copies, the deliveries), about 15 for a zeropp group (one
# slice) and about 80 for an sdp4bit one (eight): 6 per group and 9 per slice (`qsdp bench
# census` on that tree later counted 15 and 89: the reading is 12% short for sdp4bit, so the
# cost per launch derived from it is at most that much high). A quantized gather encodes and
# decodes (2 Triton kernels); a weight difference encodes the difference and adds the decoded
# ones to the replica (2); a replica fill copies the node's rows into place (1); the agreement
# is one all-reduce (and one host read, not a launch); a one-level reduce-scatter 7; the plain
# steps are FSDP2's collectives alone; the HSDP all-reduce two copies into the padded rows, the
# encode and the decode-sum-encode of the first phase (4), the decode and the inverse Hadamard
# transform of the second (2).
AT_C14EB26 = LaunchCounts(
    source="read from the CUDA path of commit c14eb26",
    per_call={"gather": 0, "quantized_gather": 2, "difference_update": 2, "replica_fill": 1, "agreement": 0,
              "reduce_scatter": 0, "one_level_reduce_scatter": 7},
    two_level_group=6, two_level_exchange=0, two_level_slice=9, hsdp_all_reduce=(4, 2),
)

# The code as it is, counted by `qsdp bench census` (benchmarks/results/census.json; a test holds
# these to it): the rounding slices of an exchange are a grid axis of one launch per codec step,
# and the last decoding kernel divides, casts into FSDP2's output and watches for NaN itself, so a
# two-level reduce-scatter launches 3 Triton kernels an exchange, whatever its slices, and one
# torch kernel a group (its first call's zeroing of the non-finite flag: the census counts a
# group's largest call); a one-level one 2 Triton and that torch kernel; the HSDP all-reduce 3
# (encode, the kernel cutting and padding the shard, and decode-sum-encode, then decode with the
# inverse transform). A node replica's fill launches nothing: one grouped gather puts each replica
# row straight into its node's block of FSDP2's buffer (on gloo, which groups gathers through
# copies of its own, it still gathers into a temporary and reorders it with one index_select).
CENSUS = LaunchCounts(
    source="qsdp bench census (benchmarks/results/census.json)",
    per_call={"gather": 0, "quantized_gather": 2, "difference_update": 2, "replica_fill": 0, "agreement": 0,
              "reduce_scatter": 0, "one_level_reduce_scatter": 3},
    two_level_group=1, two_level_exchange=3, two_level_slice=0, hsdp_all_reduce=(2, 1),
)

# One rank (rank 0 of 2 x 4) of GPT gpt2-125m (13 FSDP groups: the root, gathered once, and 12
# blocks, gathered twice), bf16, 8 x 1024 tokens, on one NVIDIA H200 (torch 2.11.0+cu130, commit
# c14eb26): `qsdp bench codec-share --device cuda --model gpt2-125m --batch-size 8 --seq-len 1024
# --param-dtype bfloat16 --presets fsdp qsdp sdp4bit zeropp`, ms per step: (GPU time, wall time).
H200_CODEC_SHARE: dict[str, tuple[float, float]] = {
    "fsdp": (37.82, 42.51), "qsdp": (38.07, 51.94), "zeropp": (39.72, 66.55), "sdp4bit": (43.21, 150.23),
}
CODEC_SHARE_GROUPS = (1,) + (2,) * 12  # weight gathers per group in one step (root, blocks)
CODEC_SHARE_WORLD = (2, 4)
# A block's shard of gpt2-125m on 8 ranks (7,087,872 / 8), taken for every group: a group's
# launches do not depend on its size once it rounds in 8 slices (the root's is larger).
CODEC_SHARE_SHARD = 885_984
