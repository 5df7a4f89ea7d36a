"""Atomic writes leave no partial file and normal permissions."""

import os
import stat

import pytest

from qsdp.train.files import atomic_write


def test_atomic_write_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write(tmp_path / "a.json", lambda f: f.write(b"{}"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.read_bytes() == b"{}"


def test_a_failed_write_leaves_the_previous_file_and_no_temp(tmp_path):
    target = tmp_path / "s.json"
    target.write_bytes(b"good")

    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(target, boom)
    assert target.read_bytes() == b"good"
    assert os.listdir(tmp_path) == ["s.json"]
