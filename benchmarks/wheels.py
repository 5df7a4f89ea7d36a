"""Pure-Python packages carried to a host that cannot reach a package registry, as wheels.

A GPU host at hand for a short while often has torch, Triton and pytest but not the packages of
qsdp's extras (``pyroute2`` for ``qsdp bench cluster``). :func:`pack_installed` writes the wheel
of a pure-Python distribution installed here, from its installed files (a wheel is a zip of the
package and its ``.dist-info``, plus a ``RECORD`` of their hashes); :func:`install_target`
installs such a wheel there into a folder of its own with pip, offline, for ``PYTHONPATH``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

__all__ = ["pack_installed", "find_wheel", "install_target"]

# Files an installer adds to a .dist-info; not part of the wheel it installed.
_INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def pack_installed(distribution: str, out_dir: str | Path) -> Path:
    """Write ``<name>-<version>-<tag>.whl`` of the installed pure-Python ``distribution`` into
    ``out_dir``; its path. ValueError naming the problem when it is not installed or not pure
    Python (such a wheel would only fit this machine)."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"{distribution} is not installed here: nothing to pack") from None
    wheel_meta = dist.read_text("WHEEL") or ""
    fields = dict(line.split(": ", 1) for line in wheel_meta.splitlines() if ": " in line)
    tag = fields.get("Tag", "")
    if fields.get("Root-Is-Purelib") != "true" or not tag.endswith("-none-any"):
        raise ValueError(f"{distribution} is not a pure-Python wheel (WHEEL says {tag or 'no tag'}): "
                         "build its wheel for the target machine instead")
    name, version = dist.metadata["Name"].replace("-", "_"), dist.version
    info = f"{name}-{version}.dist-info"
    out = Path(out_dir) / f"{name}-{version}-{tag}.whl"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in dist.files or []:
            path = f.as_posix()
            # scripts live outside site-packages (pip makes them again from entry_points.txt)
            if path.startswith("..") or "__pycache__" in path or path.endswith(".pyc"):
                continue
            top, _, rest = path.partition("/")
            if top.endswith(".dist-info") and rest in _INSTALLER_FILES:
                continue
            arcname = f"{info}/{rest}" if top.endswith(".dist-info") else path
            data = Path(f.locate()).read_bytes()
            zf.writestr(arcname, data)
            record.append(f"{arcname},{_record_hash(data)},{len(data)}")
        record.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return out


def find_wheel(wheels: str | Path, distribution: str) -> Path | None:
    """The newest-named wheel of ``distribution`` in the folder ``wheels`` (``None``: none)."""
    name = distribution.replace("-", "_")
    found = sorted(Path(wheels).glob(f"{name}-*.whl"))
    return found[-1] if found else None


def install_target(wheel: str | Path, target: str | Path, python: str = sys.executable) -> Path:
    """Install ``wheel`` (no dependencies, no index) into the folder ``target`` with ``python``'s
    pip; ``target``, for ``PYTHONPATH``. CalledProcessError when pip fails."""
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    return Path(target)
