"""The host's work per collective on a GPU: kernel launches, and a measured cost per launch.

On a GPU a collective's codec kernels are short, and between them the host runs the comm
object's Python and launches the next one: where the host takes longer than the kernels, the
GPU waits. The model prices that as the kernel launches of every collective's comm step (torch
kernels plus Triton kernels, the collectives themselves counted apart) times a host cost per
launch (``Hardware.launch_us``), added to the step (:func:`qsdp.perfmodel.simulate_step`).

The counts are data, here alone (:data:`LAUNCHES`, :data:`TWO_LEVEL_PER_SLICE`), to be replaced
by a census of the launches when one is measured. The cost per launch of the H200 host
(:data:`H200_LAUNCH_US`) is what :func:`qsdp.perfmodel.host_cost.launch_cost_us` finds in one
measurement of ``qsdp bench codec-share`` on one H200 (:data:`H200_CODEC_SHARE`).
"""

from __future__ import annotations

# Kernel launches per call of each comm step (qsdp.perfmodel.CALLS) on the GPU path, beyond
# FSDP2's own collective, counted by reading the CUDA path of qsdp.comm at commit c14eb26. A
# two-level reduce-scatter: each rounding slice launches 3 Triton kernels and about 6 torch ops
# (a gather of its columns, the wire's copies, the deliveries), about 15 for a zeropp group (one
# slice) and about 80 for an sdp4bit one (eight): 6 per group and 9 per slice. A quantized gather encodes
# and decodes (2 Triton kernels); a weight difference encodes the difference and adds the
# decoded ones to the replica (2); a replica fill copies the node's rows into place (1); the
# agreement is one all-reduce (and one host read, not a launch); a one-level reduce-scatter
# encodes, decodes and sums, divides, copies out and checks the result for NaN/Inf (7); the
# plain steps are FSDP2's collectives alone.
LAUNCHES: dict[str, int] = {
    "gather": 0, "quantized_gather": 2, "difference_update": 2, "replica_fill": 1, "agreement": 0,
    "reduce_scatter": 0, "one_level_reduce_scatter": 7, "two_level_slice": 6,
}
TWO_LEVEL_PER_SLICE = 9
# The quantized HSDP all-reduce (qsdp.comm.hsdp.ReplicaAllReduce), read as above: two copies
# into the padded rows, the encode and the decode-sum-encode of the first phase (4), the decode
# and the inverse Hadamard transform of the second (2).
HSDP_ALL_REDUCE = (4, 2)

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
# launch_cost_us() of the figures above, rounded to 0.1 us (tests/test_perfmodel.py recomputes it).
H200_LAUNCH_US = 96.1


def two_level_launches(slices: int, first: bool) -> int:
    """Launches of one exchange of a two-level reduce-scatter carrying ``slices`` rounding
    slices; ``first``: the group's first exchange, which also carries the group's own."""
    return TWO_LEVEL_PER_SLICE * slices + (LAUNCHES["two_level_slice"] if first else 0)
