"""Presets and config validation: every bad value is named before anything runs."""

import dataclasses

import pytest

import qsdp
from qsdp.config import PRESETS, resolve_config


def test_presets_match_the_design_table():
    q, s, z = PRESETS["qsdp"], PRESETS["sdp4bit"], PRESETS["zeropp"]
    assert (q.weights.mode, q.weights.bits, q.weights.symmetric, q.weights.rounding, q.weights.group_size) == ("direct", 8, False, "shift", 1024)
    assert (q.grads.mode, q.grads.bits, q.grads.rounding, q.grads.group_size) == ("one_level", 8, "stochastic", 1024)
    assert (s.weights.mode, s.weights.bits, s.weights.group_size) == ("difference", 4, 2048)
    assert (s.grads.bits_intra, s.grads.bits_inter, s.grads.group_size, s.grads.hadamard_block, s.grads.pipeline_slices) == (8, 4, 128, 32, "auto")
    assert (z.weights.mode, z.weights.bits, z.grads.bits_intra, z.grads.bits_inter, z.grads.hadamard_block) == ("direct", 4, 4, 4, 0)
    assert PRESETS["fsdp"].weights.mode == "plain" and PRESETS["fsdp"].grads.mode == "plain"


def test_a_shard_travels_quantized_from_min_shard_numel_elements_and_never_empty():
    cfg = resolve_config("sdp4bit", {"min_shard_numel": 1000})
    assert [cfg.quantizes_shard(n) for n in (0, 999, 1000, 5000)] == [False, False, True, True]
    default = resolve_config("sdp4bit")
    assert [default.quantizes_shard(n) for n in (0, 1)] == [False, True]


def test_ablations_are_overrides_of_the_presets():
    assert resolve_config("qw4").weights.mode == "direct" and resolve_config("qw4").grads.mode == "plain"
    assert resolve_config("qwd4").weights.mode == "difference"
    assert resolve_config("tlq4").grads.hadamard_block == 0
    assert resolve_config("tlq-hs").grads.hadamard_block == 32
    assert resolve_config("qsdp-w4g4").weights.bits == 4


def test_qsdp_halves_each_quantize_one_direction_as_the_full_preset_does():
    full, w, g = PRESETS["qsdp"], resolve_config("qsdp-w8"), resolve_config("qsdp-g8")
    assert (w.weights, w.grads) == (full.weights, PRESETS["fsdp"].grads)
    assert (g.weights, g.grads) == (PRESETS["fsdp"].weights, full.grads)


def test_dotted_and_nested_overrides():
    cfg = resolve_config("sdp4bit", {"weights.bits": 8, "grads": {"hadamard_block": 0}})
    assert cfg.weights.bits == 8 and cfg.grads.hadamard_block == 0 and cfg.grads.bits_inter == 4


def test_sdp4bits_pipeline_slices_are_auto_rounding_as_eight_slices():
    for name in ("sdp4bit", "tlq4", "tlq-hs"):
        g = resolve_config(name).grads
        assert (g.pipeline_slices, g.rounding_slices) == ("auto", 8)
    assert resolve_config("sdp4bit", {"grads.pipeline_slices": 3}).grads.rounding_slices == 3
    assert resolve_config("zeropp").grads.pipeline_slices == 1


def test_pipeline_slices_auto_parses_from_the_command_line():
    from qsdp.overrides import parse_override

    key, value = parse_override("grads.pipeline_slices=auto")
    assert resolve_config("zeropp", {key: value}).grads.pipeline_slices == "auto"
    key, value = parse_override("grads.pipeline_slices=8")
    assert resolve_config("sdp4bit", {key: value}).grads.pipeline_slices == 8


@pytest.mark.parametrize("bad", [0, -1, 2.5, "AUTO", "eight", True, None])
def test_pipeline_slices_other_than_a_positive_integer_or_auto_are_refused(bad):
    with pytest.raises(qsdp.ConfigError) as info:
        resolve_config("sdp4bit", {"grads.pipeline_slices": bad})
    assert str(info.value) == f"grads.pipeline_slices={bad!r} must be a positive integer or 'auto'"


def test_presets_are_frozen_data():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["qsdp"].weights.bits = 4


@pytest.mark.parametrize("config,overrides,needle", [
    ("nope", None, "unknown preset 'nope'"),
    ("qsdp", {"weights.bits": 3}, "weights.bits=3"),
    ("sdp4bit", {"grads.bits_inter": 16}, "grads.bits_inter=16"),
    ("qsdp", {"grads.group_size": 0}, "grads.group_size=0"),
    ("qsdp", {"weights.group_size": 12}, "multiple of 8"),
    ("qsdp", {"weights.rounding": "up"}, "weights.rounding='up'"),
    ("qsdp", {"weights.mode": "magic"}, "weights.mode='magic'"),
    ("sdp4bit", {"grads.hadamard_block": 24}, "grads.hadamard_block=24"),
    ("sdp4bit", {"grads.pipeline_slices": 0}, "grads.pipeline_slices=0"),
    ("sdp4bit", {"grads.pipeline_min_bytes": 0}, "grads.pipeline_min_bytes=0 must be a positive integer"),
    ("qsdp", {"local_world_size": 0}, "local_world_size=0"),
    ("qsdp", {"weights.colour": 1}, "unknown config field weights.colour"),
    ("qsdp", {"speed": 1}, "unknown config field speed"),
])
def test_bad_values_raise_config_errors_naming_field_and_value(config, overrides, needle):
    with pytest.raises(qsdp.ConfigError) as info:
        resolve_config(config, overrides)
    assert needle in str(info.value)


@pytest.mark.parametrize("overrides,message", [
    ({"grads.bits_inter": "4"}, "grads.bits_inter='4' must be an integer, one of 2, 4, 8 (got str)"),
    ({"weights.bits": 4.0}, "weights.bits=4.0 must be an integer, one of 2, 4, 8 (got float)"),
    ({"hsdp.bits": True}, "hsdp.bits=True must be an integer, one of 2, 4, 8 (got bool)"),
    ({"grads.group_size": "128"}, "grads.group_size='128' must be an integer, a positive multiple of 8"),
    ({"weights": 4}, "weights=4 must be a dict of its fields, e.g. {'bits': 4}, or given as dotted keys (weights.bits=4)"),
    (["weights.bits", 4], "overrides must be a dict such as {'weights.bits': 8}, got list"),
])
def test_a_wrong_typed_override_is_one_line_naming_the_type_it_must_have(overrides, message):
    with pytest.raises(qsdp.ConfigError) as info:
        resolve_config("sdp4bit", overrides)
    assert str(info.value) == message


def test_unknown_preset_lists_the_allowed_names():
    with pytest.raises(qsdp.ConfigError, match="allowed: fsdp, qsdp, sdp4bit, zeropp"):
        resolve_config("fsdp2")
