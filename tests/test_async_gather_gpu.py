"""``unshard(async_op=True)`` on CUDA: a qsdp gather runs on a side stream, so compute enqueued
after it overlaps it (measured with CUDA events), and the copy-out waits for it through the
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
from distributed import run_world

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
    ((no_handle, change),) = run_world(_async_gather_on_cpu, 1)
    assert no_handle and change < 0.2  # gathered (quantized) in place, synchronously


def _gather_then_compute(comm, out, shard, async_op: bool, sleep_cycles: int) -> tuple[float, float]:
    """Milliseconds from the start until the gather's end and until the compute's end, when the
    compute (a spinning kernel) is enqueued right after the gather, as a prefetch would be."""
    current = torch.cuda.current_stream()
    start, gathered, computed = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record(current)
    work = comm(out, shard, dist.group.WORLD, async_op=async_op)
    gathered.record(side_stream(out.device) if async_op else current)
    torch.cuda._sleep(sleep_cycles)
    computed.record(current)
    if work is not None:
        assert isinstance(work, SideStreamWork)
        work.wait()
    torch.cuda.synchronize()
    return start.elapsed_time(gathered), start.elapsed_time(computed)


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
        for _ in range(3):  # warm up kernels and NCCL
            _gather_then_compute(comm, out, shard, True, 1000)
        gather_alone, _ = _gather_then_compute(comm, out, shard, False, 1)
        cycles = 1_000_000
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        torch.cuda._sleep(cycles)
        t1.record()
        torch.cuda.synchronize()
        sleep_alone = t0.elapsed_time(t1)
        cycles = int(cycles * max(1.0, gather_alone / sleep_alone))  # compute about as long as the gather
        _, serial = _gather_then_compute(comm, out, shard, False, cycles)
        gathered, overlapped = _gather_then_compute(comm, out, shard, True, cycles)
        print(f"gather {gather_alone:.2f} ms; gather then compute: serial {serial:.2f} ms, "
              f"async {overlapped:.2f} ms (gather done at {gathered:.2f} ms)")
        # serial is gather + compute; overlapped is about the longer of the two
        assert overlapped < serial - 0.5 * gather_alone
    finally:
        dist.destroy_process_group()
