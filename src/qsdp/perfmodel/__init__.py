"""The performance model: the predicted step time of a preset for a GPT on a cluster.

An alpha-beta model of every collective the comm objects run in one step (their exact wire
bytes), the time of their quantization kernels, and the compute, under stated assumptions.
``qsdp advise`` and ``qsdp bench simulate`` stand on it; it needs torch alone.

* :mod:`~qsdp.perfmodel.hardware`: GPU types and their links (:data:`HARDWARE`).
* :mod:`~qsdp.perfmodel.rates`: link rates as people write them (``8x400gbit``).
* :mod:`~qsdp.perfmodel.collectives`: the collectives of a step and their bytes.
* :mod:`~qsdp.perfmodel.codec_time`: the codec speeds (measured by ``qsdp bench kernels``).
* :mod:`~qsdp.perfmodel.comm_time`: link time plus codec time of the collectives.
* :mod:`~qsdp.perfmodel.host_staged`: a host-staged step (gloo on CPUs), collective by collective.
* :mod:`~qsdp.perfmodel.setup`: the job (shape, parallelism, tokens, shards).
* :mod:`~qsdp.perfmodel.limits`: what limits a step (link bytes, all-to-all fan-out, codecs, ...).
* :mod:`~qsdp.perfmodel.step`: compute and the step; :func:`predict_step` is the entry point.
"""

from .codec_time import KERNEL_NAMES, kernel_gbps, kernel_times, load_kernels
from .collectives import (
    CALLS,
    Collective,
    collective_bytes,
    collective_elements,
    hsdp_collectives,
    replica_elements,
    step_bytes,
    step_collectives,
)
from .comm_time import comm_time, measured_call_s, host_time, link_bytes, wire_parts, wire_time
from .hardware import HARDWARE, NIC_EFFICIENCY, PAPER_GPUS, Hardware, cluster_hardware, custom_hardware
from .rates import format_gbit, parse_link, parse_rate
from .host_staged import synchronous_step
from .limits import LIMITS, fan_out, limit, step_parts
from .setup import (
    GPT2_VOCAB,
    MICRO_BATCH,
    MICRO_BATCHES,
    MODEL_SHAPES,
    SEQ_LEN,
    Setup,
    ShapeSetup,
    fsdp2_setup,
    gpt_shape,
    model_params,
    shard_sizes,
)
from .step import compute_time, predict_step, simulate_hsdp_step, simulate_step

__all__ = [
    "predict_step", "simulate_step", "simulate_hsdp_step", "compute_time",
    "Hardware", "HARDWARE", "NIC_EFFICIENCY", "PAPER_GPUS", "cluster_hardware", "custom_hardware",
    "parse_rate", "parse_link", "format_gbit",
    "CALLS", "Collective", "step_collectives", "step_bytes", "collective_bytes", "collective_elements",
    "hsdp_collectives", "replica_elements",
    "comm_time", "wire_time", "wire_parts", "link_bytes", "host_time", "measured_call_s",
    "synchronous_step", "step_parts", "fan_out", "limit", "LIMITS", "KERNEL_NAMES", "load_kernels", "kernel_gbps", "kernel_times",
    "Setup", "ShapeSetup", "fsdp2_setup", "gpt_shape", "model_params", "shard_sizes",
    "GPT2_VOCAB", "SEQ_LEN", "MICRO_BATCH", "MICRO_BATCHES", "MODEL_SHAPES",
]
