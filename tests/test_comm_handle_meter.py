"""One meter per ``quantize_comms`` handle: two models in one process keep separate counts,
and the process-wide ``qsdp.comm_stats()`` sees both."""

from __future__ import annotations

import pytest

import qsdp
from distributed import run_world
import fsdp_models as fm

pytestmark = pytest.mark.timeout(180)


def _two_models(rank, world):
    quantized, plain = fm.build(seed=0), fm.build(seed=1)
    handle_q = qsdp.quantize_comms(quantized, "sdp4bit")
    handle_p = qsdp.quantize_comms(plain, "fsdp")
    qsdp.comm_stats(reset=True)
    fm.train(quantized, 2, rank)
    after_quantized = (handle_q.comm_stats(reset=False), handle_p.comm_stats(reset=False))
    fm.train(plain, 2, rank)
    quantized_stats, plain_stats = handle_q.comm_stats(), handle_p.comm_stats()
    everything, q_again = qsdp.comm_stats(), handle_q.comm_stats()
    fm.train(plain, 1, rank)
    qsdp.comm_stats(reset=True)
    return after_quantized, quantized_stats, plain_stats, everything, q_again, handle_p.comm_stats()


@pytest.fixture(scope="module")
def results():
    return run_world(_two_models, 2, local_world_size=1)


def _total(stats, kind="weights"):
    return stats[kind]["total"]["bytes"]


def test_a_handle_counts_only_its_own_models_traffic(results):
    for (q_first, p_first), q_stats, p_stats, *_ in results:
        assert _total(q_first) > 0 and _total(q_first, "grads") > 0
        assert _total(p_first) == 0 and _total(p_first, "grads") == 0
        assert _total(q_stats) == _total(q_first)  # the plain model's steps did not add to it


def test_each_handle_reports_its_own_presets_bits(results):
    for _, q_stats, p_stats, *_ in results:
        # sdp4bit's first gathers are exact, then 4-bit differences: below fp32 on average
        assert q_stats["weights"]["total"]["bits_per_element"] < 32.0
        assert q_stats["grads"]["total"]["bits_per_element"] < 10.0
        assert p_stats["weights"]["total"]["bits_per_element"] == 32.0
        assert p_stats["grads"]["total"]["bits_per_element"] == 32.0


def test_the_process_wide_view_is_the_sum_of_the_handles(results):
    for _, q_stats, p_stats, everything, *_ in results:
        for kind in ("weights", "grads", "control"):
            for level in ("intra", "inter", "total"):
                assert everything[kind][level]["bytes"] == q_stats[kind][level]["bytes"] + p_stats[kind][level]["bytes"]


def test_reading_a_handle_with_reset_zeroes_that_handle(results):
    for *_, q_again, _ in results:
        assert _total(q_again) == 0 and _total(q_again, "grads") == 0


def test_resetting_the_process_wide_view_leaves_the_handles_counts(results):
    for *_, p_after in results:
        assert _total(p_after) > 0 and _total(p_after, "grads") > 0
