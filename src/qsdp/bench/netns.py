"""Network namespaces, veth links, addresses and qdiscs over netlink (pyroute2), no iproute2.

Everything the cluster benchmark does to the network goes through this module: named namespaces
(the files under ``/var/run/netns`` that ``ip netns`` also uses, so ``ip netns list`` shows them
where iproute2 exists), veth pairs and bridges, IPv4 addresses, the root qdisc of an interface
(``tbf`` or ``netem``), an interface's kernel tx byte counter, the processes living in a
namespace, and starting a command inside one (the child joins the namespace with ``setns(2)``
between fork and exec, which is what ``ip netns exec`` does). Needs root and the ``pyroute2``
package (the ``bench`` extra); :func:`missing_package` says when the package is absent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from qsdp.extras import missing

__all__ = [
    "NetlinkError", "missing_package", "create_namespace", "remove_namespace", "list_namespaces",
    "namespace_pids", "process_alive", "kill_namespace_processes", "add_veth", "add_bridge", "attach_to_bridge",
    "add_address", "set_up", "set_down", "tbf_burst_bytes", "set_root_qdisc", "clear_root_qdisc", "root_qdisc", "has_qdisc", "tx_bytes",
    "popen_in_namespace",
]

PACKAGE = "pyroute2"
NETNS_DIR = "/var/run/netns"


class NetlinkError(RuntimeError):
    """A netlink request failed (the message names the namespace, device and request)."""


def missing_package() -> str | None:
    """``None`` where pyroute2 is installed, else the line naming it and its extra."""
    return missing(PACKAGE, "emulating nodes")


@contextmanager
def _route(ns: str, what: str) -> Iterator[Any]:
    """An ``IPRoute`` socket inside namespace ``ns``; errors become :class:`NetlinkError`."""
    from pyroute2 import IPRoute
    from pyroute2.netns import popns, pushns

    try:
        # A netlink socket belongs to the namespace it was opened in: open it there from this
        # thread and come back (IPRoute(netns=...) would fork this process, torch and all,
        # for every socket, under a 2 s deadline a loaded machine misses).
        pushns(ns)
        try:
            ipr = IPRoute()
        finally:
            popns()
        with ipr:
            yield ipr
    except NetlinkError:
        raise
    except Exception as e:  # pyroute2 raises NetlinkError(errno), OSError, KeyError...
        raise NetlinkError(f"{what} in namespace {ns}: {e}") from e


def _index(ipr: Any, dev: str) -> int:
    found = ipr.link_lookup(ifname=dev)
    if not found:
        raise KeyError(f"no interface {dev!r}")
    return found[0]


# --------------------------------------------------------------------------- namespaces


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (``/var/run/netns``)."""
    from pyroute2 import netns

    return sorted(netns.listnetns())


def create_namespace(ns: str) -> None:
    """A new named namespace with its ``lo`` up."""
    from pyroute2 import netns

    if ns in list_namespaces():
        raise NetlinkError(f"namespace {ns} already exists")
    try:
        netns.create(ns)
    except Exception as e:
        raise NetlinkError(f"creating namespace {ns}: {e}") from e
    set_up(ns, "lo")


def remove_namespace(ns: str) -> bool:
    """Unmount and delete ``ns`` (its interfaces go with it once no process lives in it);
    False where it did not exist or could not be removed."""
    from pyroute2 import netns

    try:
        netns.remove(ns)
    except OSError:
        return False
    return True


def namespace_pids(ns: str) -> list[int]:
    """The processes whose network namespace is ``ns`` (this process excluded)."""
    path = os.path.join(NETNS_DIR, ns)
    try:
        target = os.stat(path)
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:  # exited meanwhile, or a kernel thread
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            pids.append(int(entry))
    return pids


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited: a zombie, which has exited but waits for
    its parent to collect its status, counts as gone (it holds no socket, runs nothing, and
    cannot be killed)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    # The state follows the command name, which is in parentheses and may itself hold any byte.
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] != b"Z"


def kill_namespace_processes(ns: str, grace: float = 5.0, *, hard: bool = False) -> None:
    """SIGTERM, then after ``grace`` seconds SIGKILL, every process living in ``ns``; ``hard``:
    SIGKILL at once (a machine that loses power gives its processes no chance to clean up)."""
    for sig in ((signal.SIGKILL,) if hard else (signal.SIGTERM, signal.SIGKILL)):
        pids = namespace_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(process_alive(p) for p in pids):
            time.sleep(0.1)


def popen_in_namespace(ns: str, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` with the child inside namespace ``ns``: it calls
    ``setns(2)`` after the fork, before the exec (one thread there, so the whole process moves)."""
    from pyroute2.netns import setns

    fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
    try:
        return subprocess.Popen(list(cmd), preexec_fn=lambda: setns(fd, flags=0), **kwargs)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- links


def set_up(ns: str, dev: str) -> None:
    """Bring interface ``dev`` of ``ns`` up."""
    with _route(ns, f"setting {dev} up") as ipr:
        ipr.link("set", index=_index(ipr, dev), state="up")


def set_down(ns: str, dev: str) -> None:
    """Take interface ``dev`` of ``ns`` down (its carrier and its routes go with it)."""
    with _route(ns, f"setting {dev} down") as ipr:
        ipr.link("set", index=_index(ipr, dev), state="down")


def add_veth(ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
    """A veth pair: end ``dev_a`` in ``ns_a``, its peer ``dev_b`` in ``ns_b``."""
    with _route(ns_a, f"adding veth {dev_a} (peer {dev_b} in {ns_b})") as ipr:
        ipr.link("add", ifname=dev_a, kind="veth", peer={"ifname": dev_b, "net_ns_fd": ns_b})


def add_bridge(ns: str, dev: str) -> None:
    """A bridge ``dev`` in ``ns``, up."""
    with _route(ns, f"adding bridge {dev}") as ipr:
        ipr.link("add", ifname=dev, kind="bridge")
        ipr.link("set", index=_index(ipr, dev), state="up")


def attach_to_bridge(ns: str, port: str, bridge: str) -> None:
    """Make ``port`` a port of ``bridge`` (both in ``ns``) and bring it up."""
    with _route(ns, f"attaching {port} to {bridge}") as ipr:
        ipr.link("set", index=_index(ipr, port), master=_index(ipr, bridge))
        ipr.link("set", index=_index(ipr, port), state="up")


def add_address(ns: str, dev: str, address: str, prefixlen: int) -> None:
    """Add ``address/prefixlen`` (IPv4) to ``dev`` in ``ns``."""
    with _route(ns, f"adding {address}/{prefixlen} to {dev}") as ipr:
        ipr.addr("add", index=_index(ipr, dev), address=address, prefixlen=prefixlen)


def tx_bytes(ns: str, dev: str) -> int:
    """The kernel's count of bytes ``dev`` in ``ns`` has sent (headers included)."""
    with _route(ns, f"reading the counters of {dev}") as ipr:
        link = ipr.get_links(_index(ipr, dev))[0]
        return int(link.get_attr("IFLA_STATS64")["tx_bytes"])


# --------------------------------------------------------------------------- qdiscs


def clear_root_qdisc(ns: str, dev: str) -> None:
    """Remove the root qdisc of ``dev`` (back to the default); no error where there is none."""
    try:
        with _route(ns, f"removing the qdisc of {dev}") as ipr:
            ipr.tc("del", index=_index(ipr, dev), root=True)
    except NetlinkError:
        pass


def tbf_burst_bytes(rate_bytes_s: float) -> int:
    """The bucket :func:`set_root_qdisc` gives a ``tbf`` of ``rate_bytes_s``: 5 ms of tokens, and
    at least one 64 KiB GSO super-packet (a smaller bucket could never pass one)."""
    return max(64 * 1024, int(rate_bytes_s * 0.005))


def set_root_qdisc(ns: str, dev: str, kind: str, *, rate_bytes_s: float = 0.0, delay_ms: float = 0.0,
                   latency_ms: float = 100.0, limit_packets: int = 100000, loss_pct: float = 0.0) -> None:
    """Replace the root qdisc of ``dev`` by ``tbf`` (``rate_bytes_s`` in bytes/s, a bucket of
    :func:`tbf_burst_bytes`, queueing at most ``latency_ms``) or ``netem`` (``delay_ms``, a rate
    where ``rate_bytes_s`` > 0, ``loss_pct`` percent of packets dropped)."""
    if kind not in ("tbf", "netem"):
        raise ValueError(f"qdisc {kind!r}: tbf or netem")
    if kind == "tbf" and rate_bytes_s <= 0:
        raise ValueError("tbf needs a positive rate")
    if rate_bytes_s >= 2 ** 32:
        raise ValueError(f"rate {rate_bytes_s:g} B/s is beyond the 32-bit rate of the qdisc (34 Gbit/s)")
    clear_root_qdisc(ns, dev)
    with _route(ns, f"adding a {kind} qdisc to {dev}") as ipr:
        index = _index(ipr, dev)
        if kind == "tbf":
            ipr.tc("add", "tbf", index=index, handle="1:", rate=int(rate_bytes_s), burst=tbf_burst_bytes(rate_bytes_s),
                   latency=f"{int(latency_ms)}ms")
        else:
            opts: dict[str, Any] = {"delay": int(delay_ms * 1000), "limit": limit_packets}
            if rate_bytes_s > 0:
                opts["rate"] = int(rate_bytes_s)
            if loss_pct > 0:
                opts["loss"] = loss_pct
            ipr.tc("add", "netem", index=index, handle="1:", **opts)


def root_qdisc(ns: str, dev: str) -> str | None:
    """The kind of ``dev``'s root qdisc (``None``: the interface has none, e.g. a bare veth)."""
    with _route(ns, f"reading the qdisc of {dev}") as ipr:
        index = _index(ipr, dev)
        for msg in ipr.get_qdiscs(index=index):
            if msg["parent"] == 0xFFFFFFFF:
                return msg.get_attr("TCA_KIND")
    return None


def has_qdisc(ns: str, dev: str, kind: str) -> bool:
    """Whether this kernel offers qdisc ``kind`` (tried on ``dev``, which is left without one)."""
    try:
        set_root_qdisc(ns, dev, kind, delay_ms=1.0, rate_bytes_s=1e6)
    except NetlinkError:
        return False
    finally:
        clear_root_qdisc(ns, dev)
    return True
