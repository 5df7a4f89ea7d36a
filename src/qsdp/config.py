"""Configuration: what travels on the wire for weights and gradients.

A preset is data, not a code path: the communication objects read these dataclasses. Every
field can be overridden (see :func:`resolve_config`), and :func:`validate` names the first bad
field, its value and what is allowed, before any collective runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from .codecs import ROUNDINGS, SUPPORTED_BITS

WEIGHT_MODES = ("plain", "direct", "difference")
REPLICAS = ("auto", "node", "full")
GRAD_MODES = ("plain", "one_level", "two_level")
HSDP_MODES = ("plain", "quantized")
# The rounding slices of ``grads.pipeline_slices="auto"``: SDP4Bit's 8, the measured best on GPUs.
AUTO_PIPELINE_SLICES = 8


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names the field and the value."""


@dataclass(frozen=True)
class WeightComm:
    """How FSDP2's weight all-gather travels.

    mode: ``plain`` (the parameter dtype, unquantized), ``direct`` (each rank quantizes its
        shard: QSDP, ZeRO++ qwZ, SDP4Bit's qW ablation) or ``difference`` (SDP4Bit qWD: the
        quantized change against a persistent replica held by every rank).
    bits, group_size, symmetric, rounding: the quantizer (see :func:`qsdp.codecs.quantize`).
    replica: where the ``difference`` mode keeps its replicas. ``full``: every rank holds the
        whole unsharded group (SDP4Bit's design). ``node``: with D nodes x M ranks, each rank
        holds the D rows of the ranks sharing its local rank (full/M); differences travel in
        ``bits`` between nodes and the rows in the parameter dtype inside a node (on one node,
        D = 1, the group is gathered exactly). ``auto``: ``node`` when D > 1 and M > 1, else
        ``full``.
    """

    mode: Literal["plain", "direct", "difference"] = "plain"
    bits: int = 8
    group_size: int = 2048
    symmetric: bool = True
    rounding: str = "stochastic"
    replica: Literal["auto", "node", "full"] = "auto"


@dataclass(frozen=True)
class GradComm:
    """How FSDP2's gradient reduce-scatter travels.

    mode: ``plain`` (reduce-scatter in the reduce dtype), ``one_level`` (QSDP: quantize once,
        all-to-all, dequantize and sum) or ``two_level`` (SDP4Bit TLq: ``bits_intra`` inside a
        node, dequantize+sum+requantize to ``bits_inter`` across nodes).
    bits: the one-level bit width.
    hadamard_block: 0 (off) or the block of the Walsh-Hadamard smoothing (SDP4Bit: 32).
    pipeline_slices: the two-level reduce-scatter quantizes its chunk in this many slices (each
        with its own rounding seeds) and exchanges each slice on its own, so that quantizing one
        overlaps the communication of the previous one (SDP4Bit: 8). ``"auto"``: the rounding of
        8 slices; where an engine is free to overlap the transfers (CUDA tensors on NCCL)
        consecutive slices share an exchange until each of its all-to-alls moves at least
        ``pipeline_min_bytes`` (one exchange for a small shard, up to 8 for a large one), and
        where the host moves the bytes (gloo, CPU tensors) all of them travel in one exchange
        per hop. The grouping changes the transport only: the same result either way.
    pipeline_min_slice: fewer slices are used where a slice would hold fewer elements per
        destination than this (small FSDP groups gain nothing from slicing but latency).
    pipeline_min_bytes: with ``pipeline_slices="auto"`` where exchanges are pipelined, the bytes
        each all-to-all of an exchange moves at least (this rank's send buffer of each hop):
        below it an all-to-all costs more in latency than its overlap saves.
    quantize: ``False`` sends exact fp32 values along the same route (an ablation and a test
        oracle: the route alone must not change the result).
    """

    mode: Literal["plain", "one_level", "two_level"] = "plain"
    bits: int = 8
    bits_intra: int = 8
    bits_inter: int = 4
    group_size: int = 128
    symmetric: bool = True
    rounding: str = "stochastic"
    hadamard_block: int = 0
    pipeline_slices: int | Literal["auto"] = 1
    pipeline_min_slice: int = 16384
    pipeline_min_bytes: int = 1 << 20
    quantize: bool = True

    @property
    def rounding_slices(self) -> int:
        """The slice count the two-level reduce-scatter rounds with (small chunks get fewer, see
        ``qsdp.comm.reduce_scatter.pipeline_slices_bounds``): ``pipeline_slices``, or
        :data:`AUTO_PIPELINE_SLICES` for ``"auto"``. The slices fix the numerics; how their
        exchanges are grouped does not."""
        return AUTO_PIPELINE_SLICES if self.pipeline_slices == "auto" else self.pipeline_slices


@dataclass(frozen=True)
class HsdpComm:
    """How the gradient all-reduce across replicas travels when ``quantize_comms`` is given a
    ``replicate_group`` (HSDP: FSDP2 shards inside the node, the nodes hold replicas).

    mode: ``plain`` (an fp32 all-reduce, what FSDP2's native HSDP sends in the reduce dtype) or
        ``quantized`` (a reduce-scatter of quantized chunks over all-to-all, the owner sums in
        fp32, an all-gather of the requantized sums: every replica applies the same values).
    bits, group_size, symmetric, rounding, hadamard_block: the quantizer of both phases; the sums
        are requantized in the Hadamard domain.
    """

    mode: Literal["plain", "quantized"] = "plain"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    rounding: str = "stochastic"
    hadamard_block: int = 0


@dataclass(frozen=True)
class QuantConfig:
    """The whole communication config of a run.

    min_shard_numel: FSDP groups whose per-rank shard has fewer elements than this travel
        unquantized (QSDP leaves small tensors alone). The decision uses sizes that are equal
        on every rank, so all ranks always take the same path. Default 0: everything quantized.
    local_world_size: ranks per node for the two-level reduce-scatter; ``None`` reads the
        ``LOCAL_WORLD_SIZE`` environment variable (set by torchrun), else one node.
    seed: base of every stochastic-rounding seed.
    verify_replicas_every: every this many replica updates of a weight-difference group (its
        gathers that send a difference), compare a checksum of the replicas across ranks and
        raise on every rank if they diverged (0: never).
    """

    name: str = "custom"
    weights: WeightComm = field(default_factory=WeightComm)
    grads: GradComm = field(default_factory=GradComm)
    hsdp: HsdpComm = field(default_factory=HsdpComm)
    min_shard_numel: int = 0
    local_world_size: int | None = None
    seed: int = 0
    verify_replicas_every: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def quantizes_shard(self, numel: int) -> bool:
        """Whether an FSDP group whose per-rank shard has ``numel`` elements travels quantized
        (``min_shard_numel``; an empty shard never does)."""
        return numel >= max(1, self.min_shard_numel)


PRESETS: dict[str, QuantConfig] = {
    "fsdp": QuantConfig(name="fsdp"),
    "qsdp": QuantConfig(
        name="qsdp",
        weights=WeightComm("direct", bits=8, group_size=1024, symmetric=False, rounding="shift"),
        grads=GradComm("one_level", bits=8, group_size=1024, symmetric=False, rounding="stochastic"),
        hsdp=HsdpComm("quantized", bits=8, group_size=1024, symmetric=False),
    ),
    "sdp4bit": QuantConfig(
        name="sdp4bit",
        weights=WeightComm("difference", bits=4, group_size=2048, symmetric=True, rounding="stochastic"),
        grads=GradComm(
            "two_level", bits_intra=8, bits_inter=4, group_size=128, symmetric=True,
            rounding="stochastic", hadamard_block=32, pipeline_slices="auto",
        ),
        hsdp=HsdpComm("quantized", bits=4, group_size=128, hadamard_block=32),
    ),
    "zeropp": QuantConfig(
        name="zeropp",
        weights=WeightComm("direct", bits=4, group_size=2048, symmetric=True, rounding="nearest"),
        grads=GradComm(
            "two_level", bits_intra=4, bits_inter=4, group_size=128, symmetric=True,
            rounding="stochastic", hadamard_block=0, pipeline_slices=1,
        ),
        hsdp=HsdpComm("quantized", bits=4, group_size=128),
    ),
}

# The SDP4Bit paper's ablations (Table 1) and QSDP's aggressive setting, as named variants of the
# presets: each one only overrides fields.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qw4": ("fsdp", {"weights": dataclasses.asdict(PRESETS["zeropp"].weights)}),
    "qwd4": ("fsdp", {"weights": dataclasses.asdict(PRESETS["sdp4bit"].weights)}),
    "tlq4": ("fsdp", {"grads": {**dataclasses.asdict(PRESETS["sdp4bit"].grads), "hadamard_block": 0}}),
    "tlq-hs": ("fsdp", {"grads": dataclasses.asdict(PRESETS["sdp4bit"].grads)}),
    "qsdp-w4g4": ("qsdp", {"weights.bits": 4, "grads.bits": 4}),
    # QSDP's two halves alone (its W8G8 weights with exact gradients, and the reverse), so a gap
    # of the full preset can be traced to the half that makes it.
    "qsdp-w8": ("fsdp", {"weights": dataclasses.asdict(PRESETS["qsdp"].weights)}),
    "qsdp-g8": ("fsdp", {"grads": dataclasses.asdict(PRESETS["qsdp"].grads)}),
    # HSDP with only the inter-node gradient all-reduce quantized (weights and the intra-node
    # reduce-scatter stay exact on the node's fast links).
    "hsdp4": ("fsdp", {"hsdp": dataclasses.asdict(PRESETS["sdp4bit"].hsdp)}),
    "hsdp8": ("fsdp", {"hsdp": {"mode": "quantized", "bits": 8, "group_size": 128, "hadamard_block": 32}}),
}


# The fields each mode reads; a mode ignores every other field of its section, which must keep
# its default (see :func:`validate`). ``mode`` itself is always read.
_QUANTIZER = ("bits", "group_size", "symmetric", "rounding")
USED_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "weights": {"plain": (), "direct": _QUANTIZER, "difference": (*_QUANTIZER, "replica")},
    "grads": {
        "plain": (),
        "one_level": (*_QUANTIZER, "hadamard_block", "quantize"),
        "two_level": ("bits_intra", "bits_inter", "group_size", "symmetric", "rounding", "hadamard_block",
                      "pipeline_slices", "pipeline_min_slice", "pipeline_min_bytes", "quantize"),
    },
    "hsdp": {"plain": (), "quantized": (*_QUANTIZER, "hadamard_block")},
}
# What a refused field's user most likely meant.
_UNUSED_HINTS = {
    ("grads", "bits", "two_level"): "two-level gradients use grads.bits_intra and grads.bits_inter",
    ("grads", "bits_intra", "one_level"): "one-level gradients use grads.bits",
    ("grads", "bits_inter", "one_level"): "one-level gradients use grads.bits",
}


def _unused(section: str, mode: Any, name: str) -> bool:
    """Whether ``section``'s ``mode`` ignores field ``name`` (False for an unknown mode: that
    mode is the error to report)."""
    used = USED_FIELDS[section].get(mode) if isinstance(mode, str) else None
    return used is not None and name != "mode" and name not in used


def _unused_error(section: str, mode: Any, name: str, value: Any, *, overridden: bool) -> ConfigError:
    hint = _UNUSED_HINTS.get((section, name, mode))
    if hint is None:
        readers = [m for m, used in USED_FIELDS[section].items() if name in used]
        hint = f"{section}.mode {' or '.join(map(repr, readers))} reads it"
    if overridden:
        return ConfigError(f"{section}.{name} is unused when {section}.mode = {mode!r} ({hint})")
    default = getattr(type(getattr(QuantConfig(), section))(), name)
    return ConfigError(f"{section}.{name}={value!r} is unused when {section}.mode = {mode!r} and must keep its "
                       f"default {default!r} ({hint})")


def preset_names() -> list[str]:
    """Every name :func:`resolve_config` accepts."""
    return [*PRESETS, *VARIANTS]


def _apply_overrides(cfg: QuantConfig, overrides: Mapping[str, Any]) -> QuantConfig:
    """Overrides are ``{"weights.bits": 4}`` (dotted) or ``{"weights": {"bits": 4}}``."""
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"overrides must be a dict such as {{'weights.bits': 8}}, got {type(overrides).__name__}")
    top: dict[str, Any] = {}
    sub: dict[str, dict[str, Any]] = {"weights": {}, "grads": {}, "hsdp": {}}
    # The fields the user named: a dotted key whatever its value, a key of a section dict when
    # its value is not the field's default (a whole section, e.g. dataclasses.asdict(...), carries
    # defaults for the fields its mode ignores).
    named: dict[str, set[str]] = {name: set() for name in sub}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if head in sub and rest:
            sub[head][rest] = value
            named[head].add(rest)
        elif head in sub and isinstance(value, Mapping):
            sub[head].update(value)
            defaults = type(getattr(cfg, head))()
            named[head].update(k for k, v in value.items() if getattr(defaults, k, object()) != v)
        elif head in sub and not isinstance(value, type(getattr(cfg, head))):
            raise ConfigError(f"{head}={value!r} must be a dict of its fields, e.g. {{'bits': 4}}, or "
                              f"given as dotted keys ({head}.bits=4)")
        else:
            top[key] = value
    for name, fields in sub.items():
        if fields:
            current = getattr(cfg, name)
            known = {f.name for f in dataclasses.fields(current)}
            for k in fields:
                if k not in known:
                    raise ConfigError(f"unknown config field {name}.{k}; allowed: {', '.join(sorted(known))}")
            updated = dataclasses.replace(current, **fields)
            for k in sorted(named[name]):
                if _unused(name, updated.mode, k):
                    raise _unused_error(name, updated.mode, k, fields[k], overridden=True)
            if updated.mode != current.mode:
                # Another mode: the fields it ignores return to their defaults (the preset's
                # values were for the mode it had).
                defaults = type(current)()
                updated = dataclasses.replace(updated, **{
                    k: getattr(defaults, k) for k in known if k not in fields and _unused(name, updated.mode, k)})
            top[name] = updated
    known_top = {f.name for f in dataclasses.fields(QuantConfig)}
    for k in top:
        if k not in known_top:
            raise ConfigError(f"unknown config field {k}; allowed: {', '.join(sorted(known_top))}")
    return dataclasses.replace(cfg, **top)


def resolve_config(config: str | QuantConfig, overrides: Mapping[str, Any] | None = None) -> QuantConfig:
    """A validated :class:`QuantConfig` from a preset name (or variant) or a config, plus
    optional field overrides. Raises :class:`ConfigError` naming the problem."""
    if isinstance(config, str):
        if config in PRESETS:
            cfg = PRESETS[config]
        elif config in VARIANTS:
            base, over = VARIANTS[config]
            cfg = dataclasses.replace(_apply_overrides(PRESETS[base], over), name=config)
        else:
            raise ConfigError(f"unknown preset {config!r}; allowed: {', '.join(preset_names())}")
    elif isinstance(config, QuantConfig):
        cfg = config
    else:
        raise ConfigError(f"config must be a preset name or a QuantConfig, got {type(config).__name__}")
    if overrides:
        cfg = _apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg


# A quantization group is at most this many elements: the hadamard alignment bound below, and far
# beyond any group that keeps quantization error useful (the presets use 128 to 2048).
MAX_GROUP_SIZE = 1 << 20
MAX_INT64 = 2**63 - 1  # counts and seeds travel between ranks as int64


def is_int(v: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(v, int) and not isinstance(v, bool)


def _check_quantizer(prefix: str, bits_fields: dict[str, Any], group_size: Any, rounding: Any) -> None:
    allowed = ", ".join(map(str, SUPPORTED_BITS))
    for name, bits in bits_fields.items():
        if not is_int(bits):
            raise ConfigError(f"{prefix}.{name}={bits!r} must be an integer, one of {allowed} "
                              f"(got {type(bits).__name__})")
        if bits not in SUPPORTED_BITS:
            raise ConfigError(f"{prefix}.{name}={bits!r} is not supported; allowed: {allowed}")
    # Collectives lay groups out on byte and word boundaries: a multiple of 8 keeps every bit
    # width's packed group a whole number of bytes.
    if not is_int(group_size) or group_size < 8 or group_size % 8:
        raise ConfigError(f"{prefix}.group_size={group_size!r} must be an integer, a positive multiple of 8")
    if group_size > MAX_GROUP_SIZE:
        raise ConfigError(f"{prefix}.group_size={group_size!r} must be at most {MAX_GROUP_SIZE} (2**20)")
    if rounding not in ROUNDINGS:
        raise ConfigError(f"{prefix}.rounding={rounding!r} is not supported; allowed: {', '.join(ROUNDINGS)}")


def validate(cfg: QuantConfig) -> None:
    """Raise :class:`ConfigError` for the first field that is not allowed."""
    w, g = cfg.weights, cfg.grads
    if w.mode not in WEIGHT_MODES:
        raise ConfigError(f"weights.mode={w.mode!r} is not supported; allowed: {', '.join(WEIGHT_MODES)}")
    if w.mode != "plain":
        _check_quantizer("weights", {"bits": w.bits}, w.group_size, w.rounding)
    if w.replica not in REPLICAS:
        raise ConfigError(f"weights.replica={w.replica!r} is not supported; allowed: {', '.join(REPLICAS)}")
    if g.mode not in GRAD_MODES:
        raise ConfigError(f"grads.mode={g.mode!r} is not supported; allowed: {', '.join(GRAD_MODES)}")
    if g.mode != "plain":
        bits = {"bits": g.bits} if g.mode == "one_level" else {"bits_intra": g.bits_intra, "bits_inter": g.bits_inter}
        _check_quantizer("grads", bits, g.group_size, g.rounding)
        hb = g.hadamard_block
        if not is_int(hb) or hb < 0 or (hb and (hb < 2 or hb & (hb - 1))):
            raise ConfigError(f"grads.hadamard_block={hb!r} must be 0 (off) or a power of two >= 2")
        if hb and math.lcm(hb, g.group_size) > 1 << 20:
            raise ConfigError(f"grads.hadamard_block={hb} and group_size={g.group_size} align only every {math.lcm(hb, g.group_size)} elements")
        if g.pipeline_slices != "auto" and (not is_int(g.pipeline_slices) or g.pipeline_slices < 1):
            raise ConfigError(f"grads.pipeline_slices={g.pipeline_slices!r} must be a positive integer or 'auto'")
        if g.pipeline_slices != "auto" and g.pipeline_slices > MAX_INT64:
            raise ConfigError(f"grads.pipeline_slices={g.pipeline_slices!r} must be at most 2**63 - 1")
        if not is_int(g.pipeline_min_slice) or not 1 <= g.pipeline_min_slice <= MAX_INT64:
            raise ConfigError(f"grads.pipeline_min_slice={g.pipeline_min_slice!r} must be a positive integer (at most 2**63 - 1)")
        if not is_int(g.pipeline_min_bytes) or not 1 <= g.pipeline_min_bytes <= MAX_INT64:
            raise ConfigError(f"grads.pipeline_min_bytes={g.pipeline_min_bytes!r} must be a positive integer (at most 2**63 - 1)")
        if not isinstance(g.quantize, bool):
            raise ConfigError(f"grads.quantize={g.quantize!r} must be a bool")
    _validate_hsdp(cfg.hsdp)
    _check_unused(cfg)
    for name, v in (("weights.symmetric", w.symmetric), ("grads.symmetric", g.symmetric)):
        if not isinstance(v, bool):
            raise ConfigError(f"{name}={v!r} must be a bool")
    if not is_int(cfg.min_shard_numel) or not 0 <= cfg.min_shard_numel <= MAX_INT64:
        raise ConfigError(f"min_shard_numel={cfg.min_shard_numel!r} must be a non-negative integer (at most 2**63 - 1)")
    lws = cfg.local_world_size
    if lws is not None and (not is_int(lws) or not 1 <= lws <= MAX_INT64):
        raise ConfigError(f"local_world_size={lws!r} must be a positive integer or None")
    if not is_int(cfg.verify_replicas_every) or not 0 <= cfg.verify_replicas_every <= MAX_INT64:
        raise ConfigError(f"verify_replicas_every={cfg.verify_replicas_every!r} must be a non-negative integer (at most 2**63 - 1)")
    if not is_int(cfg.seed) or abs(cfg.seed) > MAX_INT64:
        raise ConfigError(f"seed={cfg.seed!r} must be an integer of at most 64 bits")
    if not isinstance(cfg.name, str) or not cfg.name:
        raise ConfigError(f"name={cfg.name!r} must be a non-empty string")


def _check_unused(cfg: QuantConfig) -> None:
    """A field its section's mode ignores holds its default: a value there would be silently
    without effect (and yet recorded in a checkpoint's identity)."""
    for name in ("weights", "grads", "hsdp"):
        section = getattr(cfg, name)
        defaults = type(section)()
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if _unused(name, section.mode, f.name) and value != getattr(defaults, f.name):
                raise _unused_error(name, section.mode, f.name, value, overridden=False)


def _validate_hsdp(h: HsdpComm) -> None:
    if h.mode not in HSDP_MODES:
        raise ConfigError(f"hsdp.mode={h.mode!r} is not supported; allowed: {', '.join(HSDP_MODES)}")
    if h.mode == "plain":
        return
    _check_quantizer("hsdp", {"bits": h.bits}, h.group_size, h.rounding)
    hb = h.hadamard_block
    if not is_int(hb) or hb < 0 or (hb and (hb < 2 or hb & (hb - 1))):
        raise ConfigError(f"hsdp.hadamard_block={hb!r} must be 0 (off) or a power of two >= 2")
    if hb and math.lcm(hb, h.group_size) > 1 << 20:
        raise ConfigError(f"hsdp.hadamard_block={hb} and group_size={h.group_size} align only every {math.lcm(hb, h.group_size)} elements")
    if not isinstance(h.symmetric, bool):
        raise ConfigError(f"hsdp.symmetric={h.symmetric!r} must be a bool")


def config_diff(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """The dotted fields where two ``QuantConfig.to_dict()`` values differ, with both values."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            out += config_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append((f"{prefix}{k}", va, vb))
    return out
