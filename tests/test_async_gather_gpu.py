"""``unshard(async_op=True)`` on CUDA: a qsdp gather runs on a side stream, so compute enqueued
after it overlaps it (measured with CUDA events, both queued behind work already on the GPU so
that the host's speed does not decide it), and the copy-out waits for it through the
work handle FSDP2 receives. The side stream's ordering is checked on CPU too: there the call
stays synchronous and returns no handle."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import qsdp
from qsdp.comm import QuantizedAllGather, build_topology
from qsdp.comm.base import SideStreamWork, side_stream
from distributed import run_pooled

pytestmark = pytest.mark.timeout(180)


def _async_gather_on_cpu(rank, world_size):
    comm = QuantizedAllGather(qsdp.resolve_config("qsdp"), build_topology(), 0)
    out = torch.zeros(4096)
    out.normal_()
    before = out.clone()
    returned = comm(out, out[:4096], dist.group.WORLD, async_op=True)
    return returned is None, float((out - before).abs().max())


def test_an_async_gather_on_cpu_is_done_when_it_returns():
    # in a world of its own: a process group made in the test process would outlive it there
    ((no_handle, change),) = run_pooled(_async_gather_on_cpu, 1)
    assert no_handle and change < 0.2  # gathered (quantized) in place, synchronously


def _gather_then_compute(comm, out, shard, async_op: bool, compute_cycles: int,
                         hold_cycles: int) -> tuple[float, float, float]:
    """GPU milliseconds from the moment both streams are released until the gather's end, the
    compute's start and the compute's end, when the compute (a spinning kernel) is enqueued right
    after the gather, as a prefetch would be.

    Both wait behind a spinning kernel of ``hold_cycles`` already on the current stream (the
    gather's side stream first waits for that stream), long enough that the host has queued the
    gather and the compute before either starts: the timings are the GPU's, whatever the host's
    speed (checked: the hold must still be running when the host is done)."""
    current = torch.cuda.current_stream()
    released, gathered, started, computed = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    torch.cuda._sleep(hold_cycles)
    released.record(current)
    work = comm(out, shard, dist.group.WORLD, async_op=async_op)
    gathered.record(side_stream(out.device) if async_op else current)
    started.record(current)
    torch.cuda._sleep(compute_cycles)
    computed.record(current)
    queued_in_time = not released.query()
    if work is not None:
        assert isinstance(work, SideStreamWork)
        work.wait()
    torch.cuda.synchronize()
    assert queued_in_time, "the hold ended before the host had queued the gather and the compute"
    return released.elapsed_time(gathered), released.elapsed_time(started), released.elapsed_time(computed)


def _cycles_per_ms() -> float:
    """Cycles of ``torch.cuda._sleep`` per millisecond of this GPU."""
    cycles = 1_000_000
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    torch.cuda._sleep(cycles)
    t1.record()
    torch.cuda.synchronize()
    return cycles / t0.elapsed_time(t1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_an_async_gather_overlaps_the_compute_enqueued_after_it(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        comm = QuantizedAllGather(qsdp.resolve_config("qsdp"), build_topology(), 0)
        n = 1 << 26
        out = torch.randn(n, device="cuda")
        shard = out[:n]
        per_ms = _cycles_per_ms()
        hold = int(50 * per_ms)  # 50 ms: the host queues a gather in well under 1 ms
        for _ in range(3):  # warm up kernels and NCCL
            _gather_then_compute(comm, out, shard, True, 1000, hold)
        gather_alone, _, _ = _gather_then_compute(comm, out, shard, False, 1, hold)
        cycles = int(per_ms * gather_alone)  # compute about as long as the gather
        _, _, serial = _gather_then_compute(comm, out, shard, False, cycles, hold)
        gathered, started, computed = _gather_then_compute(comm, out, shard, True, cycles, hold)
        both = max(gathered, computed)
        print(f"gather {gather_alone:.2f} ms; gather then compute: serial {serial:.2f} ms, async {both:.2f} ms "
              f"(compute started at {started:.2f} ms, gather done at {gathered:.2f} ms)")
        assert started < gathered, "the compute waited for the gather"
        # serial is gather + compute; overlapped is about the longer of the two
        assert both < serial - 0.5 * gather_alone
    finally:
        dist.destroy_process_group()
