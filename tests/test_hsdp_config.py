"""The ``hsdp`` config field: what each preset sends between replicas, overrides, validation."""

import pytest

from qsdp import ConfigError, resolve_config


def test_presets_choose_what_hsdp_sends_between_nodes():
    s, z, q, f = (resolve_config(p).hsdp for p in ("sdp4bit", "zeropp", "qsdp", "fsdp"))
    assert (s.mode, s.bits, s.group_size, s.hadamard_block) == ("quantized", 4, 128, 32)
    assert (z.mode, z.bits, z.hadamard_block) == ("quantized", 4, 0)
    assert (q.mode, q.bits, q.symmetric, q.group_size) == ("quantized", 8, False, 1024)
    assert f.mode == "plain"


def test_hsdp_variants_quantize_only_the_all_reduce_between_nodes():
    for name, bits in (("hsdp4", 4), ("hsdp8", 8)):
        cfg = resolve_config(name)
        assert cfg.weights.mode == "plain" and cfg.grads.mode == "plain"
        assert (cfg.hsdp.mode, cfg.hsdp.bits, cfg.hsdp.hadamard_block) == ("quantized", bits, 32)


def test_hsdp_fields_can_be_overridden_dotted_or_nested():
    assert resolve_config("sdp4bit", {"hsdp.bits": 8}).hsdp.bits == 8
    assert resolve_config("fsdp", {"hsdp": {"mode": "quantized", "bits": 2}}).hsdp.bits == 2


@pytest.mark.parametrize("overrides,words", [
    ({"hsdp.mode": "fast"}, "hsdp.mode='fast'"),
    ({"hsdp.bits": 5}, "hsdp.bits=5"),
    ({"hsdp.group_size": 100}, "hsdp.group_size=100"),
    ({"hsdp.hadamard_block": 24}, "hsdp.hadamard_block=24"),
    ({"hsdp.rounding": "up"}, "hsdp.rounding='up'"),
    ({"hsdp.symmetric": 1}, "hsdp.symmetric=1"),
    ({"hsdp.width": 3}, "unknown config field hsdp.width"),
])
def test_a_bad_hsdp_field_is_named(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(".", r"\.")):
        resolve_config("sdp4bit", overrides)
