"""The process-wide optimizer hooks of quantize_comms do not keep a dropped model alive."""

from __future__ import annotations

import gc
import weakref

import pytest

import qsdp
from distributed import run_pooled
import fsdp_models as fm

pytestmark = pytest.mark.timeout(120)


def _dropped_model_is_freed(rank, world, keep_handle):
    from torch.optim.optimizer import _global_optimizer_post_hooks

    qsdp.quantize_comms(fm.build(), "sdp4bit")  # the process's one pair of optimizer hooks is there
    gc.collect()
    before = len(_global_optimizer_post_hooks)
    model = fm.build()
    handle = qsdp.quantize_comms(model, "sdp4bit")
    fm.train(model, 2, rank)
    alive = weakref.ref(model)
    del model
    if not keep_handle:
        del handle
    gc.collect()
    return alive() is None, len(_global_optimizer_post_hooks) - before


def test_a_dropped_model_and_handle_are_freed_and_their_hooks_removed():
    for freed, extra_hooks in run_pooled(_dropped_model_is_freed, 2, False):
        assert freed and extra_hooks == 0


def _steps_seen_without_the_handle(rank, world):
    model = fm.build()
    tracker = qsdp.quantize_comms(model, "sdp4bit").tracker  # the handle itself is not kept
    gc.collect()
    fm.train(model, 3, rank)
    return tracker.steps


def test_the_hooks_live_as_long_as_the_model_even_when_the_handle_is_dropped():
    # The two-line use keeps no handle: the replicas still follow every optimizer step.
    assert run_pooled(_steps_seen_without_the_handle, 2) == [3, 3]
