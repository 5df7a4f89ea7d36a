"""The codec's row of an FSDP group's shard: TP-replicated parameters first, TP shards after,
each part whole codec units, and nothing else changed (qsdp.comm.row_layout)."""

from __future__ import annotations

import pytest
import torch

from qsdp.comm.row_layout import RowLayout, RowMismatch
from qsdp.comm.wire import RowCodec

# A block beside TP: a norm (replicated), a column-parallel weight and bias (this rank's TP
# shards), a row-parallel weight (TP shard) and its bias (replicated).
SPANS = [(8, True), (24, False), (6, False), (20, False), (5, True)]
LENGTH = sum(n for n, _ in SPANS)


def test_a_row_of_one_kind_keeps_fsdp2s_order_at_no_cost():
    x = torch.randn(3, LENGTH)
    for spans in (None, [(LENGTH, True)], [(30, False), (LENGTH - 30, False)], [(5, False), (LENGTH - 5, False)]):
        layout = RowLayout.of(spans, LENGTH, unit=16)
        assert layout.identity and layout.wire_length == LENGTH
        assert layout.expand(x) is x
        assert torch.equal(layout.contract(torch.cat([x, x[:, :7]], dim=1)), x)


def test_a_mixed_row_its_spans_do_not_describe_is_an_error_not_the_identity():
    # The identity would quantize TP-replicated and TP-sharded values in one group.
    with pytest.raises(RowMismatch, match="row of 63 elements.*hold 80.*set_reduce_scatter_unused_params"):
        RowLayout.of([(40, True), (40, False)], LENGTH, unit=16)
    with pytest.raises(RowMismatch, match="row of 63 elements.*hold 10.*does not list"):
        RowLayout.of([(5, True), (5, False)], LENGTH, unit=16)


def test_spans_of_one_kind_that_hold_less_than_the_row_are_an_error_not_the_identity():
    """The row holds a parameter the spans leave out (unfrozen since they were read): its kind is unknown."""
    with pytest.raises(RowMismatch, match="FSDP2 passed a shard row of 1088 elements, but the group's parameters "
                                          "that require a gradient hold 64"):
        RowLayout.of([(64, True)], 64 + 1024, 128)


def test_spans_of_one_kind_from_a_mixed_group_must_add_up_to_the_row():
    with pytest.raises(RowMismatch, match="got none this backward"):
        RowLayout.of([(64, True), (1024, True)], 64, 128, mixed=True)
    assert RowLayout.of([(64, True), (1024, True)], 64, 128).identity  # no TP in the group: any order is one kind


def test_replicated_parameters_come_first_and_each_part_is_whole_units():
    layout = RowLayout.of(SPANS, LENGTH, unit=16)
    assert layout.parts == ((0, 13, 16), (16, 50, 64))
    assert layout.wire_length == 80
    x = torch.arange(LENGTH, dtype=torch.float32).view(1, -1)
    wire = layout.expand(x)[0]
    assert wire[:13].tolist() == [*range(8), *range(58, 63)]
    assert wire[13:16].tolist() == [62.0] * 3  # padding repeats the part's last element
    assert wire[16:66].tolist() == list(range(8, 58))
    assert wire[66:].tolist() == [57.0] * 14


def test_contract_inverts_expand_exactly():
    layout = RowLayout.of(SPANS, LENGTH, unit=16)
    x = torch.randn(4, LENGTH)
    assert torch.equal(layout.contract(layout.expand(x)), x)
    assert torch.equal(layout.contract(layout.expand(x)[2]), x[2])


def test_real_elements_count_the_shard_not_the_padding():
    layout = RowLayout.of(SPANS, LENGTH, unit=16)
    assert layout.real_elements(0, layout.wire_length) == LENGTH
    assert layout.real_elements(0, 16) == 13
    assert layout.real_elements(16, 32) == 16
    assert layout.real_elements(64, 80) == 2


def test_replicated_values_sit_at_the_same_places_whatever_the_size_of_the_tp_shards():
    norm, bias = torch.randn(1, 8), torch.randn(1, 5)
    rows = {n: torch.cat([norm, torch.randn(1, n), bias], dim=1) for n in (10, 40)}
    wire = {n: RowLayout.of([(8, True), (n, False), (5, True)], 13 + n, unit=16).expand(x) for n, x in rows.items()}
    assert torch.equal(wire[10][:, :16], wire[40][:, :16])


def test_tp_peers_round_their_replicated_values_identically():
    """Two TP peers: the same replicated values, different TP shards (one much larger). In the
    codec's row their replicated values decode to the same bits; in FSDP2's order they do not
    (the groups mix them with the shards)."""
    peer_a = torch.randn(2, LENGTH)
    peer_b = peer_a.clone()
    sharded = torch.cat([torch.arange(s, s + n) for s, (n, rep) in zip([0, 8, 32, 38, 58], SPANS) if not rep])
    peer_b[:, sharded] *= 50
    replicated = torch.tensor([*range(8), *range(58, 63)])
    codec = RowCodec(bits=4, group_size=16, rounding="stochastic", hadamard_block=16)

    def round_trip(x, layout):
        buf = codec.encode(layout.expand(x), seed=7)
        return layout.contract(codec.finish(codec.decode(buf, layout.wire_length), layout.wire_length))

    laid_out = RowLayout.of(SPANS, LENGTH, unit=codec.unit)
    a, b = round_trip(peer_a, laid_out), round_trip(peer_b, laid_out)
    assert torch.equal(a[:, replicated], b[:, replicated])
    flat = RowLayout.of(None, LENGTH, unit=codec.unit)
    a, b = round_trip(peer_a, flat), round_trip(peer_b, flat)
    assert not torch.equal(a[:, replicated], b[:, replicated])


def test_a_plan_is_keyed_by_a_mixed_reduce_scatters_spans_as_they_are_at_each_reduction():
    """A reduce-scatter reads its spans again at each reduction (a part unfrozen later changes its
    row): a plan built for one set of spans is never used for another of the same size."""
    from qsdp.comm.row_layout import RowLayouts

    now = [[(8, True), (24, False)]]
    layouts = RowLayouts()
    layouts.mixed = True
    layouts.use(lambda: now[0])
    first = layouts.plan_key()
    now[0] = [(24, False), (8, True)]  # the same size, other kinds at other places
    assert layouts.plan_key() != first
    then = RowLayout.of([(8, True), (24, False)], 32, 16)
    assert not torch.equal(layouts.get(32, 16, torch.device("cpu")).source, then.source)
    fixed = RowLayouts()
    fixed.use(SPANS)  # a gather's spans, fixed when it is attached
    assert fixed.plan_key() == ()
