"""run_pooled (tests/distributed.py): one world serves many tests, and what one test does to it
(a hang, an error, the environment, qsdp's per-world state) never reaches the next."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from distributed import run_pooled, run_world


def _pid(rank, world):
    return os.getpid()


def _hang_on_rank_0(rank, world):
    if rank == 0:
        time.sleep(600)
    dist.barrier()


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("planted on rank 1")
    dist.barrier()


def _fail_on_rank_1_and_echo_on_rank_0(rank, world):
    if rank == 1:
        time.sleep(0.5)  # rank 0's echo of the lost peer arrives first
        raise ValueError("planted on rank 1")
    raise RuntimeError("Connection reset by peer")


def _sum_of_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _time_out_on_rank_0(rank, world):
    if rank == 1:
        time.sleep(4)  # silent for longer than the group's 2 s timeout
        return "slept"
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError:
        return "timed out"
    return "answered"


def _set_env(rank, world):
    previous = os.environ.get("QSDP_POOL_PROBE")
    os.environ["QSDP_POOL_PROBE"] = "set by an earlier test"
    return previous, os.environ["QSDP_NODE"]


def _probe(rank, world):
    return os.environ.get("QSDP_POOL_PROBE"), os.getcwd()


def _setup_bytes(rank, world):
    from qsdp.comm.topology import build_topologies, setup_bytes_sent

    before = setup_bytes_sent()
    build_topologies([None], local_world_size=1)
    return before, setup_bytes_sent()


def test_consecutive_tests_share_one_world():
    assert run_pooled(_pid, 2, pg_timeout=61) == run_pooled(_pid, 2, pg_timeout=61)


def test_a_hang_fails_its_test_at_the_deadline_and_the_next_test_gets_a_new_world():
    before = run_pooled(_pid, 2, pg_timeout=62)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish in 3s"):
        run_pooled(_hang_on_rank_0, 2, timeout=3, pg_timeout=62)
    assert time.monotonic() - start < 10
    after = run_pooled(_pid, 2, pg_timeout=62)
    assert set(after).isdisjoint(before)
    assert run_pooled(_sum_of_ranks, 2, pg_timeout=62) == [1.0, 1.0]


def test_a_rank_error_is_raised_with_its_traceback_and_the_world_replaced():
    before = run_pooled(_pid, 2, pg_timeout=63)
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*ValueError: planted on rank 1"):
        run_pooled(_fail_on_rank_1, 2, pg_timeout=63)
    assert set(run_pooled(_pid, 2, pg_timeout=63)).isdisjoint(before)


def test_a_collective_that_timed_out_inside_a_passing_test_leaves_the_next_a_working_world():
    assert run_pooled(_time_out_on_rank_0, 2, pg_timeout=2) == ["timed out", "slept"]
    assert run_pooled(_sum_of_ranks, 2, pg_timeout=2) == [1.0, 1.0]


def test_the_environment_a_test_sets_is_gone_for_the_next():
    assert run_pooled(_set_env, 4, local_world_size=2) == [(None, "node0"), (None, "node0"),
                                                           (None, "node1"), (None, "node1")]
    assert run_pooled(_set_env, 4, local_world_size=2)[0][0] is None


def test_the_ranks_see_the_environment_and_directory_the_caller_set(monkeypatch, tmp_path):
    run_pooled(_probe, 2)  # the world exists before the caller's changes
    monkeypatch.setenv("QSDP_POOL_PROBE", "set by the caller")
    monkeypatch.chdir(tmp_path)
    assert run_pooled(_probe, 2) == [("set by the caller", str(tmp_path))] * 2


def test_each_test_starts_from_a_fresh_world_state_in_qsdp():
    first = run_pooled(_setup_bytes, 2, pg_timeout=64)
    assert run_pooled(_setup_bytes, 2, pg_timeout=64) == first
    assert all(before == 0 < after for before, after in first)


@pytest.mark.parametrize("run", [run_pooled, run_world], ids=["pooled", "fresh"])
def test_a_rank_error_is_reported_before_the_lost_connections_of_its_peers(run):
    with pytest.raises(RuntimeError) as failed:
        run(_fail_on_rank_1_and_echo_on_rank_0, 2)
    report = str(failed.value)
    assert report.index("planted on rank 1") < report.index("Connection reset by peer")
