"""Training on top of qsdp: a GPT model, text data and batches, run metrics and loss plots."""

from qsdp.train.data import (
    BPETokenizer,
    ByteTokenizer,
    DataError,
    TokenDataset,
    get_tokenizer,
    load_corpus,
    train_bpe_tokenizer,
)
from qsdp.train.metrics import MetricsWriter, read_metrics, read_summary, write_summary
from qsdp.train.model import (
    GPT,
    MODEL_SIZES,
    GPTConfig,
    count_params,
    flops_per_token,
    make_gpt,
    make_hf_gpt2,
    n_params,
    transformer_blocks,
)
from qsdp.train.plots import plot_runs

__all__ = [
    "GPT",
    "GPTConfig",
    "MODEL_SIZES",
    "make_gpt",
    "count_params",
    "n_params",
    "flops_per_token",
    "make_hf_gpt2",
    "transformer_blocks",
    "DataError",
    "load_corpus",
    "ByteTokenizer",
    "BPETokenizer",
    "train_bpe_tokenizer",
    "get_tokenizer",
    "TokenDataset",
    "MetricsWriter",
    "write_summary",
    "read_metrics",
    "read_summary",
    "plot_runs",
]
