"""Specification of the GPT model: shapes, initial loss, learning, determinism, named sizes."""

import math

import pytest
import torch

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

SMALL = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _model(seed: int = 0, config: GPTConfig = SMALL) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def _batch(seed: int = 1, B: int = 4, T: int = 16, V: int = 97):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (B, T + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def test_forward_shapes_and_dtypes():
    model = _model()
    x, y = _batch()
    logits, loss = model(x, y)
    assert logits.shape == (4, 16, 97) and logits.dtype == torch.float32
    assert loss.dim() == 0
    logits2, no_loss = model(x[:, :5])
    assert logits2.shape == (4, 5, 97) and no_loss is None


def test_sequence_longer_than_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size"):
        _model()(torch.zeros(1, 17, dtype=torch.long))


def test_loss_at_init_is_about_log_vocab():
    model = _model()
    _, loss = model(*_batch())
    assert abs(loss.item() - math.log(97)) < 0.15


def test_causal_future_tokens_do_not_change_past_logits():
    model = _model().eval()
    x, _ = _batch()
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 97
    torch.testing.assert_close(model(x)[0][:, :10], model(x2)[0][:, :10])


def test_a_few_optimizer_steps_lower_the_loss_on_a_fixed_batch():
    model = _model()
    x, y = _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(10):
        _, loss = model(x, y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model(x, y)[1].item() < first - 0.5


def test_same_seed_same_weights_different_seed_different_weights():
    a, b, c = _model(7).state_dict(), _model(7).state_dict(), _model(8).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_embedding_and_head_are_separate_parameters():
    model = _model()
    assert model.wte.weight.data_ptr() != model.lm_head.weight.data_ptr()
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert transformer_blocks(model) == list(model.blocks)


def test_param_count_matches_the_analytic_formula():
    for bias in (True, False):
        cfg = GPTConfig(vocab_size=50, block_size=8, n_layer=3, n_head=2, n_embd=16, bias=bias)
        assert count_params(_model(config=cfg)) == n_params(cfg)


def test_flops_per_token_is_6n_plus_attention():
    cfg = GPTConfig(vocab_size=50304, block_size=1024, **MODEL_SIZES["gpt2-125m"])
    n_matmul = n_params(cfg) - 50304 * 768 - 1024 * 768
    assert flops_per_token(cfg) == 6 * n_matmul + 12 * 12 * 768 * 1024
    assert flops_per_token(cfg, seq_len=512) < flops_per_token(cfg)


def test_named_sizes():
    assert {"tiny", "gpt2-125m", "gpt2-350m", "gpt2-1.3b"} <= set(MODEL_SIZES)
    assert MODEL_SIZES["gpt2-350m"] == dict(n_layer=24, n_head=16, n_embd=1024)
    tiny = make_gpt("tiny", vocab_size=256, block_size=64)
    assert tiny.config.n_layer == len(tiny.blocks) and count_params(tiny) < 2_000_000
    cfg_13b = GPTConfig(vocab_size=50304, block_size=2048, **MODEL_SIZES["gpt2-1.3b"])
    assert 1.2e9 < n_params(cfg_13b) < 1.6e9


def test_unknown_size_raises_naming_value_and_choices():
    with pytest.raises(ValueError, match=r"'gpt5'.*gpt2-125m.*tiny"):
        make_gpt("gpt5", vocab_size=256, block_size=64)


def test_invalid_config_raises():
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=3, n_embd=16)


def test_transformer_blocks_rejects_unknown_models():
    with pytest.raises(TypeError, match="Linear"):
        transformer_blocks(torch.nn.Linear(2, 2))


def test_hf_gpt2_needs_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"qsdp\[hf\]"):
            make_hf_gpt2(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    else:
        model = make_hf_gpt2(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        assert len(transformer_blocks(model)) == 2
