"""One training step: compute, communication, and how much of the communication shows.

* **Compute.** Model FLOPs (:func:`qsdp.gpt_shape.flops_per_token`, the ``6 N`` estimate plus
  attention) over peak bf16 TFLOP/s times one MFU per GPU type, times the pipeline bubble
  ``(m + PP - 1) / m`` for ``m`` micro-batches; or a measured compute time.
* **Communication.** :func:`qsdp.perfmodel.comm_time.comm_time` of the step's collectives
  (:mod:`qsdp.perfmodel.collectives`), codec time included.
* **Host.** On a GPU the census's host floor of every comm step times the GPU host's factor
  (``Hardware.host_factor``, :mod:`qsdp.perfmodel.host_census`): the GPU waits for the host between
  the short codec kernels, so this time hides behind nothing.
* **Step.** ``compute + max(0, communication - overlap * compute) + host``: communication hides
  behind at most ``overlap`` of the compute time.

:func:`predict_step` is the entry point for one job on one cluster; :func:`simulate_step` and
:func:`simulate_hsdp_step` take a :class:`~qsdp.perfmodel.setup.Setup` and a
:class:`~qsdp.perfmodel.hardware.Hardware`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from ..config import QuantConfig
from ..gpt_shape import flops_per_token, n_params
from .collectives import Collective, collective_bytes, hsdp_collectives, replica_elements, step_collectives
from .comm_time import comm_time
from .hardware import Hardware, cluster_hardware
from .limits import step_parts
from .setup import SEQ_LEN, Setup, fsdp2_setup, gpt_shape, shard_sizes


def compute_time(setup: Setup, hw: Hardware) -> float:
    """Seconds of forward+backward per step on one GPU: model FLOPs of its share of the tokens
    over ``tflops * mfu``, times the pipeline bubble ``(m + PP - 1) / m``."""
    cfg = setup.gpt()
    tokens = setup.seq_len * setup.micro_batch * setup.micro_batches  # per DP rank
    flops = flops_per_token(cfg, setup.seq_len) * tokens / (setup.tp * setup.pp)
    bubble = (setup.micro_batches + setup.pp - 1) / setup.micro_batches
    return flops / (hw.tflops * 1e12 * hw.mfu) * bubble


def _timed(colls: Sequence[Collective], hw: Hardware, ring_nodes: int, m: int, setup: Setup, overlap: float,
           kernels: Mapping[str, float] | None, compute_s: float | None) -> dict[str, Any]:
    ct = comm_time(colls, hw, ring_nodes, m, kernels)
    comp = compute_time(setup, hw) if compute_s is None else compute_s
    comm = ct["weights"] + ct["grads"] + ct["control"]
    exposed = max(0.0, comm - overlap * comp)
    parts = step_parts(colls, hw, ring_nodes, m, kernels)
    host = parts["host_s"]
    return {"step_s": comp + exposed + host, "compute_s": comp, "comm_s": comm, "exposed_comm_s": exposed,
            "host_s": host, "launches": int(parts["launches"]),
            "weights_s": ct["weights"], "grads_s": ct["grads"], "kernels_s": ct["kernels"],
            "bytes": collective_bytes(colls), "parts": parts}


def simulate_step(setup: Setup, preset: str | QuantConfig, hw: Hardware, *, overlap: float = 0.0,
                  kernels: Mapping[str, float] | None = None, param_bytes: int = 2,
                  grad_bytes: int = 4, compute_s: float | None = None) -> dict[str, Any]:
    """Predicted fully sharded step and its parts, for one preset: seconds ``step_s``,
    ``compute_s`` (``compute_s`` given: that), ``comm_s``, ``exposed_comm_s``, ``host_s`` (the
    host's work on the collectives' comm steps, which launch ``launches`` kernels), ``weights_s``,
    ``grads_s``, ``kernels_s`` (codec time, inside the two before); ``bytes`` one rank puts on
    the wire (:func:`~qsdp.perfmodel.collectives.step_bytes`); ``parts``: where the
    communication time goes (:func:`~qsdp.perfmodel.limits.step_parts`); ``replica_bytes`` its
    weight-difference replicas hold; the data-parallel group's ``dp_nodes`` x ``dp_ranks_per_node``."""
    nodes, m = setup.dp_topology(hw.gpus_per_node)
    shards = shard_sizes(setup)
    colls = step_collectives(preset, shards, nodes, m, zero3=setup.zero3,
                             param_bytes=param_bytes, grad_bytes=grad_bytes, host_staged=hw.host_staged)
    return {**_timed(colls, hw, nodes, m, setup, overlap, kernels, compute_s),
            "replica_bytes": replica_elements(preset, shards, nodes, m) * param_bytes,
            "dp_nodes": nodes, "dp_ranks_per_node": m}


def simulate_hsdp_step(setup: Setup, preset: str | QuantConfig, hw: Hardware, *, overlap: float = 0.0,
                       kernels: Mapping[str, float] | None = None, param_bytes: int = 2,
                       grad_bytes: int = 4, compute_s: float | None = None) -> dict[str, Any]:
    """Predicted HSDP step (the keys of :func:`simulate_step`): each data-parallel group shards
    over its ranks in one node (``M``) and replicates across its ``D`` nodes."""
    nodes, m = setup.dp_topology(hw.gpus_per_node)
    shards = shard_sizes(dataclasses.replace(setup, gpus=m * setup.tp * setup.pp))
    colls = hsdp_collectives(preset, shards, nodes, m, zero3=setup.zero3,
                             param_bytes=param_bytes, grad_bytes=grad_bytes)
    # Rings run inside the node (one node of M ranks); the all-reduce's all-to-alls name their
    # inter-node peers themselves.
    return {**_timed(colls, hw, 1, m, setup, overlap, kernels, compute_s),
            "replica_bytes": replica_elements(preset, shards, 1, m) * param_bytes,
            "dp_nodes": nodes, "dp_ranks_per_node": m}


def predict_step(preset: str | QuantConfig, params: int | None = None, nodes: int = 1, ranks_per_node: int = 8, *,
                 shape: Mapping[str, int] | None = None, gpu: str | Hardware = "h800",
                 link_gbit: float | None = None, link_gbit_per_gpu: float | None = None,
                 link_latency_us: float | None = None, intra_gbps: float | None = None,
                 host_factor: float | None = None,
                 kernels: Mapping[str, float] | None = None, hsdp: bool = False, seq_len: int = SEQ_LEN,
                 micro_batch: int = 1, overlap: float = 0.0, compute_s: float | None = None,
                 param_bytes: int = 2, grad_bytes: int = 4) -> dict[str, Any]:
    """The predicted step of ``preset`` for a GPT trained with FSDP2 (one group per block, weights
    gathered before forward and backward) on ``nodes`` x ``ranks_per_node`` ranks.

    The model: ``params`` parameters (a GPT-3-like shape is chosen) or ``shape`` (``n_layer``,
    ``n_embd``, ``n_head``, optional ``vocab_size``), ``micro_batch`` sequences of ``seq_len``
    tokens per rank. The cluster: GPU type ``gpu`` (a name of
    :data:`~qsdp.perfmodel.hardware.HARDWARE`, or a :class:`~qsdp.perfmodel.hardware.Hardware`),
    its links replaced where given: ``link_gbit`` (one node's inter-node link, Gbit/s per
    direction, as the collectives achieve it) or ``link_gbit_per_gpu`` (a GPU's share of it),
    ``link_latency_us``, ``intra_gbps`` (GB/s per GPU), ``host_factor`` (the host's time per
    microsecond of a comm step's census host floor); ``kernels`` the codec speeds
    (:func:`~qsdp.perfmodel.codec_time.load_kernels`). ``hsdp``: shard inside the node, replicate
    across nodes. ``compute_s``: a measured forward+backward time instead of the FLOPs model.
    ``param_bytes``/``grad_bytes``: the all-gather and reduce dtypes' sizes (2 or 4).

    Returns the dict of :func:`simulate_step` (seconds, bytes) plus ``params`` and
    ``inter_gbps_per_gpu``.
    """
    if (params is None) == (shape is None):
        raise ValueError("give either params or shape")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap} must be in [0, 1]")
    hw = cluster_hardware(gpu, ranks_per_node, link_gbit=link_gbit, link_gbit_per_gpu=link_gbit_per_gpu,
                          link_latency_us=link_latency_us, intra_gbps=intra_gbps, host_factor=host_factor)
    setup = fsdp2_setup(hw.name, nodes, ranks_per_node, shape if shape is not None else gpt_shape(params),
                        seq_len=seq_len, micro_batch=micro_batch)
    simulate = simulate_hsdp_step if hsdp else simulate_step
    r = simulate(setup, preset, hw, overlap=overlap, kernels=kernels, param_bytes=param_bytes,
                 grad_bytes=grad_bytes, compute_s=compute_s)
    return {**r, "params": n_params(setup.gpt()), "inter_gbps_per_gpu": hw.inter_gbps}
