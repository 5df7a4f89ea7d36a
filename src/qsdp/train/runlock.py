"""One run at a time in a run directory: ``OUT/.qsdp-run.lock``.

Rank 0 of ``qsdp train`` takes the lock before it writes anything into ``--out`` and gives it
back at the end. The lock is a small JSON file naming its holder: the host, its machine
identity, the process id, the torchrun job and the time it was taken. A second run given the
same ``--out`` while the first is running is refused in one line naming that holder, instead of
both writing the same metrics and rotating each other's checkpoints away.

A lock whose holder is gone is stale and taken over: its process no longer exists on this
machine (a crash, a worker killed and restarted), or it was taken by this very torchrun job (a
restarted job, whose rank 0 may now run on another host). A lock held on another machine by
another job cannot be checked from here: it is refused, and the message says which file to
remove once that run is known to be gone.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from qsdp.comm.topology import machine_id
from qsdp.train.files import atomic_write

__all__ = ["LOCK_FILE", "RunLockError", "acquire", "release", "holder_refusal"]

LOCK_FILE = ".qsdp-run.lock"


class RunLockError(ValueError):
    """The run directory is in use by another run; the message names its holder."""


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "machine": machine_id(), "pid": os.getpid(),
            "job": os.environ.get("TORCHELASTIC_RUN_ID") or None, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime())}


def _read(path: Path) -> dict[str, Any] | None:
    """The holder a lock file names; ``None`` where there is none. A file that is not a lock
    (empty, half written by a holder that died at once) names no live holder: ``{}``."""
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _stale(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether ``holder``'s lock may be taken over by ``me``."""
    if not holder:
        return True
    if holder.get("job") and holder.get("job") not in ("none",) and holder.get("job") == me["job"]:
        return True  # this torchrun job, restarted
    here = holder.get("host") == me["host"] and holder.get("machine") == me["machine"]
    return here and (holder.get("pid") == me["pid"] or not _alive(holder.get("pid")))


def holder_refusal(out: str | os.PathLike) -> str | None:
    """The one-line refusal for a run into ``out`` while another live run holds its lock, or
    ``None`` where the lock is free or stale. Reads only."""
    path = Path(out) / LOCK_FILE
    holder = _read(path)
    if holder is None or _stale(holder, _me()):
        return None
    where = f"pid {holder.get('pid')} on host {str(holder.get('host'))[:64]!r}"
    since = f" since {holder['since']}" if isinstance(holder.get("since"), str) else ""
    return (f"--out {str(out)!r} is in use by another qsdp train run ({where}{since}); wait for it to end or "
            f"choose another --out (if that run is gone, remove {LOCK_FILE} there)")


def acquire(out: str | os.PathLike) -> None:
    """Take the lock of run directory ``out`` for this process (taking over a stale one), or
    raise :class:`RunLockError` naming the live holder."""
    path = Path(out) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)  # a run started from Python may not have made it yet
    record = json.dumps(_me()).encode("utf-8")
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            refusal = holder_refusal(out)
            if refusal is not None:
                raise RunLockError(refusal) from None
            # Stale: replace it whole (rename), so no reader ever sees half a record.
            atomic_write(path, lambda f: f.write(record))
            if _read(path) == json.loads(record):
                return
            continue  # another run took it over at the same moment: look again
        with os.fdopen(fd, "wb") as f:
            f.write(record)
        return


def release(out: str | os.PathLike) -> None:
    """Give the lock of ``out`` back, if this process holds it."""
    path = Path(out) / LOCK_FILE
    holder = _read(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        try:
            path.unlink()
        except FileNotFoundError:
            pass
