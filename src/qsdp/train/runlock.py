"""One run at a time in a run directory: ``OUT/.qsdp-run.lock``.

Rank 0 of ``qsdp train`` takes the lock before it writes anything into ``--out`` and gives it
back at the end. The lock is a small JSON file naming its holder: the host, its machine
identity, its PID namespace, the process id and start time, the torchrun job, the time it was
taken, a token of its own and the holder's lease. A second run given the same ``--out`` while
the first is running is refused in one line naming that holder, instead of both writing the
same metrics and rotating each other's checkpoints away.

Taking it is atomic on any file system that has hard links (NFS and Lustre included):

- the record is written whole into a file of the taker's own and linked to the lock's name
  (``link`` fails where the name exists), so a lock is never visible empty or half written;
- a stale lock is taken over through a claim named after its token, created the same way:
  only one contender wins it, and the winner replaces the lock only while it still holds the
  stale token.

Whether a holder is gone is proven, not guessed. On the holder's own machine and PID namespace,
its process is checked (the id and its start time, so a reused id is no holder). From anywhere
else (another host, a requeued job on another node, a container with its own PID namespace) the
holder's lease decides: the holder touches the lock every sixth of its lease, and a lock seen
unchanged for a whole lease by the contender's own clock is stale (no clocks are compared across
hosts). A holder stopped for longer than its lease loses the lock; it says so when it wakes.
The torchrun job named in the lock is for the message only: two runs of one job id (a fixed
``--rdzv-id`` in one allocation) are two runs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from qsdp.comm.topology import machine_id

__all__ = ["LOCK_FILE", "LEASE_S", "RunLockError", "acquire", "release", "holder_refusal"]

LOCK_FILE = ".qsdp-run.lock"
# Long enough that a busy holder (a checkpoint, a slow file system) renews in time, every
# LEASE_S / 6; short enough that a requeued job waits at most this long for a dead holder's lock.
LEASE_S = 30.0
_held: dict[str, tuple[str, threading.Event]] = {}  # lock path -> (token, stop renewing)


class RunLockError(ValueError):
    """The run directory is in use by another run; the message names its holder."""


def _proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc``), or ``None``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _me(lease: float) -> dict[str, Any]:
    return {"host": socket.gethostname(), "machine": machine_id(), "pidns": _pid_namespace(), "pid": os.getpid(),
            "start": _proc_start(os.getpid()), "job": os.environ.get("TORCHELASTIC_RUN_ID") or None,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "token": uuid.uuid4().hex, "lease_s": lease}


def _read(path: Path) -> tuple[dict[str, Any], str, int] | None:
    """``(holder, key, mtime_ns)`` of the lock file, or ``None`` where there is none. The key
    tells one lock from the next: its token, or for a file with none (not a record, or written
    by an older qsdp) its inode and time. The file is opened, so a network file system
    revalidates what it caches."""
    try:
        with open(path, "rb") as f:
            st, data = os.fstat(f.fileno()), f.read(1 << 16)
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(data.decode("utf-8"))
    except ValueError:
        holder = {}
    holder = holder if isinstance(holder, dict) else {}
    token = holder.get("token")
    key = token if isinstance(token, str) and token.isalnum() else f"i{st.st_ino}t{st.st_mtime_ns}"
    return holder, key, st.st_mtime_ns


def _alive_here(holder: dict[str, Any]) -> bool | None:
    """Whether the holder's process runs, where that can be checked: on this machine, in this
    PID namespace (elsewhere its id means nothing here); ``None`` where it cannot."""
    if not holder or (holder.get("host"), holder.get("machine"), holder.get("pidns")) != (
            socket.gethostname(), machine_id(), _pid_namespace()):
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    if pid == os.getpid():
        return False  # this very process: a lock it took before and did not give back
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    start = holder.get("start")
    return start is None or _proc_start(pid) in (None, start)  # a reused id is another process


def _lease(holder: dict[str, Any], default: float) -> float:
    lease = holder.get("lease_s")
    return float(lease) if isinstance(lease, (int, float)) and 0.05 <= lease <= 3600 else default


def _lapsed(path: Path, key: str, mtime: int, lease: float) -> bool | None:
    """Watch the lock for one lease: ``False`` when its holder renews it (alive), ``True`` when
    it stays unchanged the whole lease (stale), ``None`` when it is replaced or removed meanwhile."""
    deadline, poll = time.monotonic() + lease, max(0.02, min(0.5, lease / 20))
    while time.monotonic() < deadline:
        time.sleep(poll)
        now = _read(path)
        if now is None or now[1] != key:
            return None
        if now[2] != mtime:
            return False
    return True


def _stale(path: Path, found: tuple[dict[str, Any], str, int], lease: float) -> bool | None:
    """Whether the lock ``found`` may be taken over (``None``: it changed hands meanwhile)."""
    holder, key, mtime = found
    alive = _alive_here(holder)
    if alive is not None:
        return not alive
    return _lapsed(path, key, mtime, _lease(holder, lease))


def _refusal(out: str | os.PathLike, holder: dict[str, Any], lease: float) -> str:
    where = f"pid {holder.get('pid')} on host {str(holder.get('host'))[:64]!r}"
    since = f" since {holder['since']}" if isinstance(holder.get("since"), str) else ""
    return (f"--out {str(out)!r} is in use by another qsdp train run ({where}{since}); wait for it to end or "
            f"choose another --out (a run that is gone gives it up when its lease of {_lease(holder, lease):g} s lapses)")


def holder_refusal(out: str | os.PathLike, lease: float = LEASE_S) -> str | None:
    """The one-line refusal for a run into ``out`` while a run that is alive on this machine
    holds its lock, or ``None``. Reads only and never waits: a holder elsewhere is left to
    :func:`acquire`, which watches its lease."""
    found = _read(Path(out) / LOCK_FILE)
    if found is None or _alive_here(found[0]) is not True:
        return None
    return _refusal(out, found[0], lease)


def _link_whole(path: Path, record: bytes, token: str) -> bool:
    """Create ``path`` holding ``record`` whole, or return ``False`` where it exists."""
    tmp = path.with_name(f"{LOCK_FILE}.{token}.new")
    with open(tmp, "wb") as f:
        f.write(record)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def _take_over(path: Path, key: str, record: bytes, token: str) -> bool:
    """Replace the stale lock ``key`` by ``record``; ``False`` where another contender won."""
    claim = path.with_name(f"{LOCK_FILE}.{key}.claim")
    if not _link_whole(claim, record, token):
        return False
    try:
        now = _read(path)
        if now is None or now[1] != key:  # taken over or given back already: look again
            return False
        tmp = path.with_name(f"{LOCK_FILE}.{token}.new")
        tmp.write_bytes(record)
        os.replace(tmp, path)  # only the claim's winner replaces the lock of this key
        return True
    finally:
        claim.unlink()


def _renew(path: Path, token: str, every: float, stop: threading.Event) -> None:
    """The holder's lease: touch the lock while it still names this holder."""
    while not stop.wait(every):
        found = _read(path)
        if found is None or found[0].get("token") != token:
            print(f"qsdp: warning: lost the run lock {path} (this process was stopped for longer than its lease); "
                  "another run may now write into its directory", file=sys.stderr)
            return
        t = time.time_ns()
        try:
            os.utime(path, ns=(t, t))
        except OSError:
            pass  # a passing failure: the next renewal comes within the lease


def acquire(out: str | os.PathLike, lease: float = LEASE_S) -> None:
    """Take the lock of run directory ``out`` for this process and hold it (renewing its
    ``lease`` in a thread) until :func:`release`; a stale lock is taken over. Raises
    :class:`RunLockError` naming a live holder."""
    path = Path(out) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)  # a run started from Python may not have made it yet
    me = _me(lease)
    record, token = json.dumps(me).encode("utf-8"), me["token"]
    give_up = time.monotonic() + 4 * lease  # a claim whose winner died before it finished
    while True:
        if _link_whole(path, record, token):
            break
        found = _read(path)
        if found is None:
            continue
        stale = _stale(path, found, lease)
        if stale is False:
            raise RunLockError(_refusal(out, found[0], lease))
        if stale and _take_over(path, found[1], record, token):
            break
        if time.monotonic() > give_up:
            raise RunLockError(f"cannot take over the stale lock {path}: another run's claim "
                               f"{LOCK_FILE}.{found[1]}.claim stays; remove it once no other run is starting there")
        time.sleep(0.01)
    stop = threading.Event()
    _held[str(path)] = (token, stop)
    threading.Thread(target=_renew, args=(path, token, lease / 6, stop), daemon=True, name="qsdp-run-lock").start()


def release(out: str | os.PathLike) -> None:
    """Give the lock of ``out`` back, if this process holds it."""
    path = Path(out) / LOCK_FILE
    token, stop = _held.pop(str(path), (None, None))
    if stop is not None:
        stop.set()
    found = _read(path)
    if token is not None and found is not None and found[0].get("token") == token:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
