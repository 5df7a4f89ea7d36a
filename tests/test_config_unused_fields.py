"""A field the chosen mode ignores is refused, naming the mode: an override the run would not
apply, or a hand-built config's value that would ride along unused (and into a checkpoint's
identity)."""

import pytest

import qsdp
from qsdp.config import PRESETS, ConfigError, resolve_config


@pytest.mark.parametrize("preset,overrides,message", [
    ("sdp4bit", {"grads.bits": 5}, "grads.bits is unused when grads.mode = 'two_level' (two-level gradients "
                                   "use grads.bits_intra and grads.bits_inter)"),
    ("sdp4bit", {"grads.bits": 4}, "grads.bits is unused when grads.mode = 'two_level'"),
    # Named explicitly: refused even at the default value, which the user expects to take effect.
    ("sdp4bit", {"grads.bits": 8}, "grads.bits is unused when grads.mode = 'two_level'"),
    ("fsdp", {"weights.bits": 3}, "weights.bits is unused when weights.mode = 'plain'"),
    ("fsdp", {"hsdp.bits": 8}, "hsdp.bits is unused when hsdp.mode = 'plain'"),
    ("qsdp", {"grads.bits_inter": 8}, "grads.bits_inter is unused when grads.mode = 'one_level' "
                                      "(one-level gradients use grads.bits)"),
    ("qsdp", {"grads.pipeline_slices": 2}, "grads.pipeline_slices is unused when grads.mode = 'one_level'"),
    ("qsdp", {"weights.replica": "full"}, "weights.replica is unused when weights.mode = 'direct'"),
    ("fsdp", {"grads": {"mode": "two_level", "bits": 4}}, "grads.bits is unused when grads.mode = 'two_level'"),
])
def test_an_override_of_a_field_the_mode_ignores_is_refused_naming_the_mode(preset, overrides, message):
    with pytest.raises(ConfigError) as e:
        resolve_config(preset, overrides)
    assert str(e.value).startswith(message)


def test_a_hand_built_config_may_not_carry_a_value_its_mode_ignores():
    cfg = qsdp.QuantConfig(weights=qsdp.WeightComm("plain", bits=3))
    with pytest.raises(ConfigError, match=r"^weights.bits=3 is unused when weights.mode = 'plain' and must keep "
                                          r"its default 8"):
        resolve_config(cfg)


def test_every_preset_and_variant_keeps_defaults_in_the_fields_its_modes_ignore():
    for name in qsdp.config.preset_names():
        resolve_config(name)  # raises on an unused non-default value


def test_overrides_the_mode_reads_and_a_change_of_mode_are_accepted():
    assert resolve_config("qsdp", {"grads.bits": 4}).grads.bits == 4
    assert resolve_config("sdp4bit", {"grads.bits_inter": 8}).grads.bits_inter == 8
    # A whole section carries defaults in the fields its mode ignores: only the others count as set.
    assert resolve_config("fsdp", {"grads": qsdp.config.dataclasses.asdict(PRESETS["sdp4bit"].grads)}).grads.mode == "two_level"
    # Turning a mode off returns the fields the new mode ignores to their defaults.
    plain = resolve_config("qsdp", {"weights.mode": "plain"}).weights
    assert plain == qsdp.WeightComm()


def test_the_used_fields_table_names_real_fields_of_every_mode():
    from qsdp.config import GRAD_MODES, HSDP_MODES, USED_FIELDS, WEIGHT_MODES

    sections = {"weights": (qsdp.WeightComm, WEIGHT_MODES), "grads": (qsdp.GradComm, GRAD_MODES),
                "hsdp": (qsdp.HsdpComm, HSDP_MODES)}
    for name, (cls, modes) in sections.items():
        assert set(USED_FIELDS[name]) == set(modes)
        fields = set(cls.__dataclass_fields__)
        assert all(set(used) <= fields for used in USED_FIELDS[name].values()), name
