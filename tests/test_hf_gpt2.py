"""qsdp on a model it did not write: a Hugging Face GPT-2 built from a config (no download)."""

import pytest
import torch

import qsdp
from distributed import run_world

transformers = pytest.importorskip("transformers", reason="needs the optional 'hf' extra (transformers)")

pytestmark = pytest.mark.timeout(180)


def _train_hf(rank, world, preset):
    from torch.distributed.fsdp import fully_shard

    from qsdp.train.model import make_hf_gpt2, transformer_blocks

    torch.manual_seed(0)
    model = make_hf_gpt2(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    for block in transformer_blocks(model):
        fully_shard(block)
    fully_shard(model)
    qsdp.quantize_comms(model, preset)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (4, 33), generator=g)  # a small fixed batch to memorise
    losses = []
    for _ in range(15):
        loss = model(ids[:, :-1], labels=ids[:, :-1]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("preset", ["qsdp", "sdp4bit"])
def test_hugging_face_gpt2_trains_with_quantized_comms(preset):
    for losses in run_world(_train_hf, 4, preset, local_world_size=2):
        assert losses[-1] < 0.8 * losses[0]
