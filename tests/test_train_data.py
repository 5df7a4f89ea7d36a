"""Specification of corpora, tokenizers and deterministic batches."""

import numpy as np
import pytest
import torch

import qsdp.train.data as data
from qsdp.train.data import (
    ByteTokenizer,
    DataError,
    TokenDataset,
    get_tokenizer,
    load_corpus,
    train_bpe_tokenizer,
)

SAMPLE = (
    "Hello there, how are you doing today?\nI'm fine, thanks. And you?\n\n"
    "Not bad: working on quantized all-gathers. Ça va? 4-bit is plenty. \U0001F600\n"
) * 40


def test_default_corpus_is_the_embedded_chitchat_text():
    text = load_corpus(None)
    assert len(text) > 5_000_000
    assert text.startswith("Hello\nHow are you doing today?\n")
    assert "\n\n" in text  # conversations separated by a blank line
    assert load_corpus() is text  # loaded once per process


def test_text_file_loads(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("\ufeffsome text\nmore", encoding="utf-8")
    assert load_corpus(str(p)) == "some text\nmore"


@pytest.mark.parametrize(
    "content, problem",
    [(None, "does not exist"), (b"", "is empty"), (b"  \n\t", "is empty"),
     (b"abc\xffdef", "not valid UTF-8 at byte offset 3")],
)
def test_bad_corpus_files_raise_data_error_naming_path(tmp_path, content, problem):
    p = tmp_path / "corpus.txt"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(DataError, match=problem) as e:
        load_corpus(str(p))
    assert str(p) in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_directory_is_not_a_corpus(tmp_path):
    with pytest.raises(DataError, match="not a regular file"):
        load_corpus(tmp_path)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert tok.vocab_size == 256 and max(ids) < 256
    assert tok.decode(ids) == SAMPLE
    assert tok.decode(torch.tensor(ids)) == SAMPLE
    assert tok.encode_corpus(SAMPLE).tolist() == ids


def test_bpe_tokenizer_trains_round_trips_and_caches(tmp_path, monkeypatch):
    tok = train_bpe_tokenizer(SAMPLE, 300, tmp_path)
    assert 256 < tok.vocab_size <= 300
    ids = tok.encode(SAMPLE)
    assert len(ids) < len(SAMPLE.encode())  # merges were learnt
    assert tok.decode(ids) == SAMPLE
    unseen = "Zebras \u00e9\u00e8 \u4e2d\u6587\n\t x"
    assert tok.decode(tok.encode(unseen)) == unseen  # byte level: nothing is out of vocabulary
    assert tok.decode(tok.encode_corpus(SAMPLE)) == SAMPLE
    assert len(list(tmp_path.glob("bpe-*.json"))) == 1

    def no_training(*args):
        raise AssertionError("retrained instead of loading the cache")

    monkeypatch.setattr(data, "_train_bpe", no_training)
    again = train_bpe_tokenizer(SAMPLE, 300, tmp_path)
    assert again.fingerprint == tok.fingerprint and again.encode(SAMPLE) == ids


def test_get_tokenizer_kinds(tmp_path):
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    bpe = get_tokenizer("bpe", SAMPLE, tmp_path, vocab_size=280)
    assert bpe.decode(bpe.encode(SAMPLE)) == SAMPLE
    with pytest.raises(ValueError, match=r"'wordpiece'.*byte, bpe"):
        get_tokenizer("wordpiece", SAMPLE)


def _dataset(n: int = 10_000, seed: int = 0) -> TokenDataset:
    return TokenDataset(np.arange(n) % 251, vocab_size=256, seed=seed)


def test_split_is_last_ten_percent():
    ds = _dataset(10_000)
    assert ds.n_train == 9_000 and ds.n_val == 1_000


def test_batches_are_shifted_by_one_and_int64():
    x, y = _dataset().batch(step=3, rank=1, world_size=4, batch_size=5, seq_len=32)
    assert x.shape == y.shape == (5, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, (x + 1) % 251)  # consecutive tokens of the arange corpus


def test_batches_are_deterministic_and_differ_across_ranks_steps_and_seeds():
    ds = _dataset()
    x, y = ds.batch(5, 0, 2, 8, 16)
    x2, y2 = _dataset().batch(5, 0, 2, 8, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, ds.batch(5, 1, 2, 8, 16)[0])
    assert not torch.equal(x, ds.batch(6, 0, 2, 8, 16)[0])
    assert not torch.equal(x, _dataset(seed=1).batch(5, 0, 2, 8, 16)[0])


def test_the_stream_is_whole_windows_of_the_train_split_in_a_new_order_each_epoch():
    ds = _dataset(10_000)  # 9 000 train tokens: 562 windows of 16 + 1
    n = ds.samples_per_epoch(16)
    assert n == 562
    order = ds.sample_indices(0, 2 * n, 16)
    assert sorted(order[:n]) == sorted(order[n:]) == list(range(n)) and list(order[:n]) != list(order[n:])
    x, y = ds.samples(n + 3, 2, 16)
    assert torch.equal(x[:, 0], torch.from_numpy(order[n + 3:n + 5] * 16 % 251))  # window i starts at 16 i
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_a_global_batch_is_the_same_samples_however_many_ranks_split_it():
    ds = _dataset()
    whole = ds.samples(40, 8, 16)[0]
    for world in (1, 2, 4, 8):
        parts = [ds.stream_batch(40, rank, 8 // world, 16)[0] for rank in range(world)]
        assert torch.equal(torch.cat(parts), whole)


def test_the_stream_never_reads_validation_tokens():
    marked = np.zeros(1000, dtype=np.int64)
    marked[900:] = 255
    ds = TokenDataset(marked, vocab_size=256)
    x, y = ds.samples(0, 2 * ds.samples_per_epoch(99), 99)
    assert int(x.max()) == 0 and int(y.max()) == 0


def test_train_batches_never_read_validation_tokens():
    marked = np.zeros(1000, dtype=np.int64)
    marked[900:] = 255  # validation tokens only
    ds = TokenDataset(marked, vocab_size=256)
    for step in range(50):
        x, y = ds.batch(step, 0, 1, 4, 99)
        assert int(x.max()) == 0 and int(y.max()) == 0


def test_val_batches_are_fixed_and_from_the_validation_split():
    ds = _dataset()
    first = list(ds.val_batches(3, 4, 32))
    second = list(_dataset(seed=9).val_batches(3, 4, 32))  # independent of seed and rank
    assert len(first) == 3
    for (x, y), (x2, y2) in zip(first, second):
        assert x.shape == (4, 32) and torch.equal(x, x2) and torch.equal(y, y2)
    val = torch.from_numpy(ds.tokens[ds.n_train:].astype(np.int64))
    assert set(first[0][0].flatten().tolist()) <= set(val.tolist())


def test_too_short_corpus_raises_clearly():
    ds = _dataset(100)
    with pytest.raises(DataError, match="corpus too short.*train split has 90 tokens"):
        ds.batch(0, 0, 1, 2, 90)
    with pytest.raises(DataError, match="val split has 10 tokens"):
        next(ds.val_batches(1, 1, 16))


def test_bad_rank_and_out_of_vocab_ids_raise():
    with pytest.raises(ValueError, match="rank"):
        _dataset().batch(0, 4, 4, 1, 8)
    with pytest.raises(DataError, match=r"\[0, 10\)"):
        TokenDataset(np.array([1, 2, 30]), vocab_size=10)


def test_from_text_caches_token_ids(tmp_path):
    ds = TokenDataset.from_text(SAMPLE, ByteTokenizer(), cache_dir=tmp_path)
    cached = list(tmp_path.glob("tokens-*.npy"))
    assert len(cached) == 1
    again = TokenDataset.from_text(SAMPLE, ByteTokenizer(), cache_dir=tmp_path)
    assert np.array_equal(ds.tokens, again.tokens)
    assert ByteTokenizer().decode(again.tokens) == SAMPLE
    assert torch.equal(ds.batch(2, 1, 2, 3, 20)[0], again.batch(2, 1, 2, 3, 20)[0])
