"""Test-only fault injection for the training loop (environment variables; never set them in
real runs).

``STEP`` is 1-based, ``RANK`` the global rank; each fault fires once, on the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted group runs clean:

- ``QSDP_TEST_NAN_AT=STEP:RANK``: that rank back-propagates ``loss * NaN`` at that step (its
  gradients become NaN; the logged loss stays the forward's).
- ``QSDP_TEST_KILL_AT=STEP:RANK``: that rank sends itself SIGKILL after that step's backward.
- ``QSDP_TEST_STALL_AT=STEP:RANK:SECONDS``: that rank sleeps before that step (a peer that stops
  answering).
- ``QSDP_TEST_HOLD_AT=STEP:RANK``: that rank blocks for good before that step, on a lock that
  nothing releases (a rank stuck outside any collective, as in a deadlock).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from qsdp.train.preflight import restart_count

__all__ = ["Faults"]

_FIELDS = ("STEP", "RANK", "SECONDS")


def _parse(var: str, n_fields: int) -> tuple | None:
    text = os.environ.get(var)
    if not text:
        return None
    parts = text.split(":")
    try:
        if len(parts) != n_fields:
            raise ValueError
        return (int(parts[0]), int(parts[1]), *(float(x) for x in parts[2:]))
    except ValueError:
        raise ValueError(f"{var}={text!r}: expected {':'.join(_FIELDS[:n_fields])}") from None


@dataclass(frozen=True)
class Faults:
    """The faults to inject in this attempt (none by default)."""

    nan_at: tuple[int, int] | None = None
    kill_at: tuple[int, int] | None = None
    stall_at: tuple[int, int, float] | None = None
    hold_at: tuple[int, int] | None = None

    @classmethod
    def from_env(cls) -> Faults:
        """The faults the environment asks for; none on a restarted attempt."""
        if restart_count() > 0:
            return cls()
        return cls(_parse("QSDP_TEST_NAN_AT", 2), _parse("QSDP_TEST_KILL_AT", 2),
                   _parse("QSDP_TEST_STALL_AT", 3), _parse("QSDP_TEST_HOLD_AT", 2))

    def hold(self, step: int, rank: int) -> None:
        if self.hold_at == (step, rank):
            held = threading.Lock()
            held.acquire()
            held.acquire()  # never returns: the lock's holder is this thread, waiting on it

    def stall(self, step: int, rank: int) -> None:
        if self.stall_at is not None and self.stall_at[:2] == (step, rank):
            time.sleep(self.stall_at[2])

    def nan(self, step: int, rank: int) -> bool:
        return self.nan_at == (step, rank)

    def kill(self, step: int, rank: int) -> None:
        if self.kill_at == (step, rank):
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
