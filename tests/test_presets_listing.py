"""``qsdp presets``: every preset with its fields, and bits per element on each link that agree
with the byte meter of a real 2 nodes x 2 ranks step."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import qsdp
from distributed import run_world
from qsdp.cli import main as cli_main
from qsdp.preset_table import link_bits

pytestmark = pytest.mark.timeout(180)

# One Linear(1024 -> 32): its weight shards are whole quantization groups, Hadamard blocks and
# HSDP chunks for every preset, so the meter's rates carry no model-specific padding.
IN, OUT = 1024, 32


def _metered_rates(rank, world):
    groups = qsdp.hsdp_groups(nodes=2, device_type="cpu")
    out = {}
    for preset in qsdp.preset_names():
        out[preset] = {}
        for mode in ("fsdp", "hsdp"):
            torch.manual_seed(0)
            model = nn.Linear(IN, OUT, bias=False)
            if mode == "fsdp":
                try:
                    fully_shard(model)
                    handle = qsdp.quantize_comms(model, preset)
                except qsdp.ConfigError:
                    out[preset][mode] = None
                    continue
            else:
                fully_shard(model, mesh=groups.shard_mesh)
                handle = qsdp.quantize_comms(model, preset, replicate_group=groups.replicate_group)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(2):  # the first step establishes the weight-difference replicas
                handle.comm_stats(reset=True)
                x = torch.randn(4, IN, generator=torch.Generator().manual_seed(10 * step + rank))
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            stats = handle.comm_stats()
            handle.close()
            out[preset][mode] = {k: {lv: stats[k][lv]["bits_per_element"] if stats[k][lv]["elements"] else None
                                     for lv in ("intra", "inter")} for k in ("weights", "grads")}
    return out


@pytest.fixture(scope="module")
def metered():
    return run_world(_metered_rates, 4, local_world_size=2)


def test_link_bits_are_the_bits_the_meter_counts_in_a_real_step(metered):
    shards = {"fsdp": IN * OUT // 4, "hsdp": IN * OUT // 2}  # sharded over 4 ranks, or inside a node of 2
    for rates in metered:
        for preset, by_mode in rates.items():
            for mode, measured in by_mode.items():
                predicted = link_bits(preset, shard=shards[mode], nodes=2, ranks_per_node=2,
                                      param_bytes=4, grad_bytes=4)[mode]
                assert predicted == measured, (preset, mode)
    assert metered[0]["hsdp4"]["fsdp"] is None  # refused without replicate_group, shown as n/a


def test_the_listing_shows_every_preset_with_its_bits(capsys):
    assert cli_main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split() and line.split()[0] in qsdp.preset_names()}
    assert set(rows) == set(qsdp.preset_names())
    bits = link_bits("sdp4bit")
    assert rows["sdp4bit"][:4] == [f"{bits['fsdp'][k][lv]:.2f}" for k in ("weights", "grads") for lv in ("intra", "inter")]
    assert rows["sdp4bit"][1] == "4.02" and rows["hsdp4"][:4] == ["n/a"] * 4
    fields = {line.split(":")[0].strip() for line in lines if line.startswith("  ") and ":" in line}
    assert set(qsdp.preset_names()) <= fields


def test_the_legend_explains_only_the_marks_the_table_shows(capsys):
    assert cli_main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "(n/a: the config needs replicate_group=)" in out and "-: nothing travels" not in out
    assert cli_main(["presets", "sdp4bit"]) == 0
    out = capsys.readouterr().out
    assert "n/a" not in out and "nothing travels" not in out


def test_the_json_listing_holds_each_presets_whole_config(capsys):
    assert cli_main(["presets", "--json", "qsdp", "hsdp8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["presets"]) == ["qsdp", "hsdp8"]
    for name, entry in data["presets"].items():
        assert entry["fields"] == qsdp.resolve_config(name).to_dict()
        assert entry["bits_per_element"] == link_bits(name)
    assert data["presets"]["hsdp8"]["differs_from_defaults"] == {
        "hsdp.bits": 8, "hsdp.hadamard_block": 32, "hsdp.mode": "quantized"}


def test_an_unknown_preset_is_refused(capsys):
    assert cli_main(["presets", "sdp3bit"]) == 2
    assert "unknown preset 'sdp3bit'" in capsys.readouterr().err
