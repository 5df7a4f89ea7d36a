"""The process group and the device of a training worker.

The device (where tensors live) and the backend (how ranks talk) are chosen separately: NCCL
needs one GPU a rank, gloo moves CUDA tensors through the host, so several gloo ranks can share
one GPU (rank r on GPU ``LOCAL_RANK % device_count``), e.g. 4 ranks as 2 x 2 on a single card.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from qsdp import progress
from qsdp.train.args import PeerError, TrainArgs, TrainError

__all__ = ["init_process_group", "run_device", "device_name", "rank0_first", "first_to_report"]

T = TypeVar("T")

# The job's key-value store, kept past the process group's end: a rank's error reaches the
# command line after the group is destroyed, and the store decides which rank reports first.
_joined, _job_store = False, None
_FIRST_ERROR_KEY = "qsdp/first_error"
_CLAIM_TIMEOUT = datetime.timedelta(seconds=5)


def _keep_store(store: dist.Store | None) -> None:
    global _joined, _job_store
    _joined, _job_store = True, store


def first_to_report() -> bool | None:
    """Whether this rank is the first of its job to report an error (one counter in the job's
    store, so one line reaches the user's terminal whichever rank failed); ``None`` when this
    process never joined a job's process group (every rank then checks the same inputs), and
    ``True`` when the store cannot be reached (the error is printed rather than lost)."""
    if not _joined:
        return None
    if _job_store is None:
        return True
    try:
        _job_store.set_timeout(_CLAIM_TIMEOUT)
        return _job_store.add(_FIRST_ERROR_KEY, 1) == 1
    except Exception:  # noqa: BLE001 - the store's host is gone: say it here
        return True


def _local_gpu() -> int:
    return int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())


def init_process_group(args: TrainArgs) -> None:
    """Create the default process group from the torchrun environment (TrainError if it is
    missing); on CUDA, select this rank's GPU first."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise TrainError(
                f"train_worker needs an initialized process group or the torchrun environment "
                f"({var} is not set); launch with `qsdp train --nproc N` or torchrun"
            )
    # In a local launch the progress guard names a stuck rank at --timeout; the collectives wait
    # a little longer, so that a rank waiting on it does not time out first and take the blame.
    timeout = datetime.timedelta(seconds=progress.collective_timeout(args.timeout_s))
    backend = args.process_backend()
    if args.use_cuda():
        torch.cuda.set_device(_local_gpu())
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The elastic agent keeps one TCPStore across restarts and init_process_group does not
        # separate the attempts' keys, so a restarted group would read the dead group's gloo
        # addresses / NCCL ids (pytorch/pytorch#135712): give each attempt its own key prefix.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"qsdp/attempt_{attempt}", store)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
        _keep_store(prefixed)
    else:
        dist.init_process_group(backend, timeout=timeout)
        # torch keeps no public handle on the store it made for the group: its private getter,
        # read once here (without it, errors are printed by every rank instead).
        try:
            _keep_store(dist.distributed_c10d._get_default_store())
        except (AttributeError, RuntimeError, ValueError):
            _keep_store(None)


def run_device(args: TrainArgs, created_group: bool) -> torch.device:
    """Where this rank's tensors live. ``device=None`` follows the group: CUDA when this job
    created it for CUDA, or when a given group is NCCL (a given gloo group stays on the CPU)."""
    if args.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    on_cuda = args.device == "cuda" or (
        args.use_cuda() if created_group else "nccl" in str(dist.get_backend()).lower())
    return torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")


def device_name(device: torch.device) -> str:
    """The device in words, for the summary."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads/rank)"


def choose_cpu_param_dtype(fp32_s: float, bf16_s: float) -> str:
    """``bfloat16`` when a bf16 matmul takes at most 1.5x the fp32 one (the CPU computes bf16
    natively: AVX512-BF16, AMX), else ``float32`` (emulated bf16 is several times slower)."""
    return "bfloat16" if bf16_s <= 1.5 * fp32_s else "float32"


def cpu_param_dtype(size: int = 256, repeats: int = 5) -> tuple[str, float]:
    """The parameter dtype for CPU training on this machine, measured: a few ``size``-square
    matmuls in fp32 and in bf16 on one thread (a few milliseconds). Returns the dtype and the
    measured bf16/fp32 time ratio."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
            a @ b  # warm-up: kernels chosen, pages touched
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - t0)
            best[dtype] = min(times)
    finally:
        torch.set_num_threads(threads)
    fp32_s, bf16_s = best[torch.float32], best[torch.bfloat16]
    return choose_cpu_param_dtype(fp32_s, bf16_s), bf16_s / fp32_s


def rank0_first(fn: Callable[[], T], rank: int, others: Callable[[], T] | None = None) -> T:
    """``fn()`` on rank 0, then ``others()`` (default ``fn()``) on the other ranks (rank 0
    builds shared caches). If rank 0 fails, the others raise PeerError instead of waiting."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the others
            error = e
    status = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(status, src=0)
    if error is not None:
        raise error
    if status[0] is not None:
        raise PeerError(f"rank 0 failed: {status[0]}")
    if rank == 0:
        return result  # type: ignore[return-value]
    return (others or fn)()
