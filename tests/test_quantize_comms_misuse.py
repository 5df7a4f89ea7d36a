"""Uses of ``quantize_comms`` that would go wrong without a word are refused in one line, before
any collective: a second call on a model whose comms are already qsdp's, and a root that
``fully_shard`` left out while its blocks are sharded. What is fine stays accepted: a second call
after ``close()``, and a wrapper around a sharded root."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.fsdp import fully_shard

import qsdp
from distributed import run_pooled
import fsdp_models as fm

pytestmark = pytest.mark.timeout(120)


def _error(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


def _twice(rank, world):
    model = fm.build()
    qsdp.quantize_comms(model, "sdp4bit")
    return _error(lambda: qsdp.quantize_comms(model, "qsdp"))


def test_a_second_quantize_comms_on_the_same_model_names_close():
    assert run_pooled(_twice, 2, timeout=100) == [(
        "RuntimeError", "quantize_comms was already called on this model (its 'sdp4bit' comms are attached): "
                        "call close() on the handle it returned before quantizing again")] * 2


def _after_close(rank, world):
    replaced = fm.build()
    qsdp.quantize_comms(replaced, "sdp4bit").close()
    second = qsdp.quantize_comms(replaced, "qsdp")
    fm.train(replaced, 2, rank)
    fresh = fm.build()
    once = qsdp.quantize_comms(fresh, "qsdp")
    fm.train(fresh, 2, rank)
    return second.comm_stats(), once.comm_stats()


def test_after_close_the_model_takes_new_comms_and_they_carry_all_its_traffic():
    for second, once in run_pooled(_after_close, 2, timeout=100):
        assert second == once and second["weights"]["total"]["bytes"] > 0


def _blocks_only(rank, world):
    model = fm.TinyNet()
    for block in model.blocks:
        fully_shard(block)
    return _error(lambda: qsdp.quantize_comms(model, "sdp4bit"))


def test_a_root_left_out_of_fully_shard_while_its_blocks_are_sharded_is_refused():
    assert run_pooled(_blocks_only, 2, timeout=100) == [(
        "ValueError", "the root TinyNet was not passed to fully_shard while 2 of its submodules were "
                      "(blocks.0, blocks.1); its parameters outside them (inp.weight, ...) would be neither "
                      "sharded nor reduced: call fully_shard(model) after fully_shard on its blocks")] * 2


class _Wrapper(nn.Module):
    """A training harness's module around a model sharded as a whole (Lightning's, say)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


def _wrapped(rank, world):
    wrapper = _Wrapper(fm.build())
    handle = qsdp.quantize_comms(wrapper, "sdp4bit")
    fm.train(wrapper, 1, rank)
    return repr(handle)


def test_a_wrapper_around_a_sharded_root_is_accepted():
    assert run_pooled(_wrapped, 2, timeout=100) == ["QuantizedComms('sdp4bit', 3 FSDP groups, 2 ranks = 1 node x 2)"] * 2
