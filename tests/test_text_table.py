"""The command line's tables: columns aligned, the first to the left, the rest to the right."""

import pytest

from qsdp.text_table import aligned


def test_columns_are_padded_to_their_widest_cell():
    lines = aligned([("preset", "ms"), ("fsdp", "221.9"), ("sdp4bit", "7.5")])
    assert lines == ["preset      ms", "fsdp     221.9", "sdp4bit    7.5"]


def test_rule_goes_under_the_header():
    lines = aligned([("a", "bb"), ("ccc", "d")], rule=True)
    assert lines == ["a    bb", "---  --", "ccc   d"]


def test_a_row_with_a_missing_cell_is_refused():
    with pytest.raises(ValueError, match="2 cells"):
        aligned([("a", "b"), ("c",)])


def test_no_rows_no_lines():
    assert aligned([]) == []
