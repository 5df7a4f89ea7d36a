"""What the loss weighting on uneven shares relies on: every target the training stream yields
counts. The GPT's loss ignores the target -1 (``ignore_index``); the stream never yields it and
never pads, so a micro-batch's sequences are its counted tokens, and weighting by sequences
(:meth:`qsdp.train.elastic.BatchSplit.weight`) is weighting by tokens."""

from __future__ import annotations

import numpy as np
import pytest

from qsdp.train.data import DataError, TokenDataset

IGNORE_INDEX = -1  # the GPT's cross-entropy ignore_index (qsdp.train.model)


def test_the_ignored_target_id_cannot_enter_a_dataset():
    with pytest.raises(DataError, match=r"token ids must be in \[0, 10\), got \[-1, 3\]"):
        TokenDataset(np.array([1, 2, IGNORE_INDEX, 3] * 50), vocab_size=10)


def test_every_target_of_the_training_stream_counts_and_no_sample_is_padded():
    dataset = TokenDataset(np.arange(1000) % 7, vocab_size=7)
    n = dataset.samples_per_epoch(16)
    inputs, targets = dataset.samples(n - 3, 7, 16)  # across an epoch's end
    assert inputs.shape == targets.shape == (7, 16)
    assert int((targets == IGNORE_INDEX).sum()) == 0 and int(targets.min()) >= 0
