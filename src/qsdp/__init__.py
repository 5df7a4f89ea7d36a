"""qsdp: quantized sharded data parallel training for PyTorch.

Two lines on top of an FSDP2 script::

    import qsdp
    qsdp.quantize_comms(model, "sdp4bit")   # after fully_shard, before the first step
"""

from .comm.meter import comm_stats, format_stats
from .guard import GuardConfig
from .config import (
    PRESETS,
    ConfigError,
    GradComm,
    HsdpComm,
    QuantConfig,
    WeightComm,
    preset_names,
    resolve_config,
)
from .fsdp import QuantizedComms, quantize_comms
from .gradient_check import GradientCheck, check_gradients
from .hsdp import HsdpGroups, hsdp_groups

__version__ = "0.1.0"

__all__ = [
    "quantize_comms", "QuantizedComms", "comm_stats", "format_stats",
    "QuantConfig", "WeightComm", "GradComm", "ConfigError",
    "PRESETS", "preset_names", "resolve_config", "__version__",
    "hsdp_groups", "HsdpGroups", "HsdpComm", "check_gradients", "GradientCheck", "GuardConfig",
]
