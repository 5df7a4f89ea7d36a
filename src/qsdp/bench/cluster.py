"""``qsdp bench cluster``: real multi-node behaviour on one machine, over a shaped network.

Each emulated node is a Linux network namespace (``ip netns``) named ``qsdp-<pid>-n<i>``, with
``lo`` up and one interface ``qsdp-eth`` holding the private address ``10.213.0.<i+1>/24``:

* 2 nodes: one veth pair joins the two namespaces directly.
* more nodes: a star. A hub namespace ``qsdp-<pid>-hub`` holds a bridge ``br0``; each node's
  ``qsdp-eth`` is a veth whose peer ``p<i>`` is a port of that bridge.

Every node's link is shaped in both directions with ``tc`` on the egress of both veth ends: a
node sends at most ``--rate`` Mbit/s and receives at most ``--rate`` Mbit/s (a full-duplex NIC).
``netem delay D rate R`` is used where the kernel has netem; without it, ``tbf rate R`` shapes
the rate and no delay can be added (the JSON's ``link.delay_ms`` is the delay actually applied,
``link.qdisc`` what was used; a requested delay that could not be applied is warned about). In
the star the delay is split over the two hops, so ``--delay-ms`` is node-to-node one way.
Ranks of one node talk over that namespace's local routes: traffic to the node's own address is
routed through ``lo``, never through the shaped veth (``ip route get`` says ``local ... dev
lo``; checked by the veth's byte counters staying put), so intra-node traffic is unshaped.

Each preset runs as one multi-node ``torchrun`` job (``python -m torch.distributed.run``, i.e.
torchrun): one agent per namespace via ``ip netns exec``, ``--rdzv-backend c10d`` with the
rendezvous store on node 0's address, ``--local-addr`` set to the node's address,
``GLOO_SOCKET_IFNAME=qsdp-eth``, ``OMP_NUM_THREADS=1``, running ``python -m
qsdp.bench.workload`` (rank 0 writes the step times and its byte meter as JSON). Every launch
has a deadline after which every process in the namespaces is killed. Namespaces are removed
afterwards, also on error, SIGINT, SIGTERM or SIGHUP; stale ``qsdp-<pid>-*`` namespaces whose
creating process is gone (a run killed with SIGKILL) are removed at the start of a run. Needs
root, ``ip`` and ``tc``.

Reported per preset: median step time, tokens/s, the meter's bytes per step that one node puts
on its inter-node link (``inter_bytes_per_step`` = rank 0's inter-node bytes x ranks per node,
weights + gradients + control; ranks are symmetric) and on intra-node routes, the speedup over
``fsdp``, and the volume-bound ideal speedup::

    t_ideal(p) = max(8 * B_p / R,  t_unlimited(p))
    ideal(p)   = t_fsdp / t_ideal(p)

the preset's own inter-node bytes at the nominal rate ``R`` or its own step on an unlimited
link (compute and quantization), whichever is longer: what a perfect overlap of communication
and computation would give. ``realised = speedup / ideal`` says how much of the possible gain is
realised; the rest is lost to serialization (collectives waiting for each other and for
compute), latency and protocol overhead. A looser, serial bar is also reported,
``ideal_speedup_serial = t_fsdp / max(t_fsdp - 8 * (B_fsdp - B_p) / R, t_unlimited(p))``
(``fsdp``'s step minus the link time the smaller volume saves); it keeps whatever ``fsdp``
spends beyond its metered bytes, so a preset can beat it. The meter counts logical
point-to-point bytes; the kernel's byte counter of each node's veth over the whole job
(set-up and warm-up included, headers included) is reported as ``link_tx_bytes_per_run`` as a
check of what really crossed the link (gloo's collective algorithms do not put exactly the
meter's logical count on the inter-node link). By default every preset also runs once with the link not limited (no qdisc at all) to show the
quantization overhead when the network is not the bottleneck (``--no-unlimited`` skips it;
``--rate 0`` runs only unlimited).

HSDP rows. A row named ``hsdp:<preset>`` (``--hsdp`` adds one per preset, and ``hsdp:fsdp``)
runs the training job instead, ``python -m qsdp.cli train --hsdp --local-world-size M`` (i.e.
``qsdp train --hsdp``: sharded inside each namespace, replicated across them, the inter-node
all-reduce as the preset's ``hsdp`` config says), on the job's own text data, for warm-up +
timed steps. Its step times are rank 0's ``step_time_s`` records of the timed steps, its bytes
the run's all-rank meter totals over them divided by the world size (ranks are symmetric), so
the rows have the columns of the others. Each HSDP row's speedup and ideal are against
``hsdp:fsdp`` (its exact fp32 all-reduce, the route native HSDP takes), measured in the same
run; the ``baseline`` field names the row a speedup is against.

Default link: 20 Mbit/s, 1 ms. At that rate ``fsdp``'s step with the default ``tiny`` model is
more than 90% communication on a small CPU host (about 10 MB per node and step cross the link),
i.e. the bandwidth-bound regime the quantized presets are for; at 200 Mbit/s the CPU compute of
the 4 ranks is of the same order as ``fsdp``'s link time on such a host.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from qsdp.comm.meter import KINDS, LEVELS
from qsdp.config import ConfigError, resolve_config
from qsdp.text_table import aligned
from qsdp.train.metrics import read_metrics, read_summary

from .report import BENCH_PRESETS, bar_chart, emit, png_next_to

NS_PREFIX = "qsdp-"
IFACE = "qsdp-eth"
SUBNET = "10.213.0"
RDZV_PORT = 29500
_STALE_RE = re.compile(r"^qsdp-(\d+)-(n\d+|hub)$")


class ClusterError(RuntimeError):
    """A setup step failed (message says which command and why)."""


# --------------------------------------------------------------------------- requirements


def missing_requirements(path: str | None = None, euid: int | None = None) -> list[str]:
    """What this machine lacks to run the emulation (empty when all is there). ``path`` is the
    search path for the tools (default ``$PATH``), ``euid`` the effective user id (default this
    process's)."""
    problems = []
    if (os.geteuid() if euid is None else euid) != 0:
        problems.append("root privileges (network namespaces and tc need root; run with sudo)")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool, path=path) is None:
            problems.append(f"the `{tool}` command (package {pkg}) on PATH")
    return problems


# --------------------------------------------------------------------------- the network


def _run(cmd: Sequence[str], timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _list_netns(ip: str) -> list[str]:
    out = _run([ip, "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(ip: str, ns: str, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, every process living in namespace ``ns`` (all started by us)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _run([ip, "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.1)


def remove_stale_namespaces(ip: str) -> list[str]:
    """Delete ``qsdp-<pid>-*`` namespaces whose creating process no longer exists."""
    removed = []
    for ns in _list_netns(ip):
        m = _STALE_RE.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _kill_namespace_processes(ip, ns, grace=2.0)
            if _run([ip, "netns", "del", ns], check=False).returncode == 0:
                removed.append(ns)
    return removed


@dataclass
class Link:
    rate_mbit: float
    delay_ms: float

    @property
    def limited(self) -> bool:
        return self.rate_mbit > 0 or self.delay_ms > 0


@dataclass
class EmulatedCluster:
    """The namespaces, their veths and the shaping of the inter-node links."""

    nodes: int
    ip: str
    tc: str
    tag: str = field(default_factory=lambda: str(os.getpid()))
    namespaces: list[str] = field(default_factory=list)
    # (namespace, device) of every shaped egress: both ends of every inter-node veth.
    shaped: list[tuple[str, str]] = field(default_factory=list)
    qdisc: str = "none"
    delay_applied_ms: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def node_ns(self, i: int) -> str:
        return f"{NS_PREFIX}{self.tag}-n{i}"

    @property
    def hub_ns(self) -> str:
        return f"{NS_PREFIX}{self.tag}-hub"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def topology(self) -> str:
        return "veth pair" if self.nodes == 2 else "star (bridge in a hub namespace)"

    def _add_ns(self, ns: str) -> None:
        _run([self.ip, "netns", "add", ns])
        self.namespaces.append(ns)
        _run([self.ip, "-n", ns, "link", "set", "lo", "up"])

    def up(self) -> None:
        if self.nodes < 2 or self.nodes > 250:
            raise ClusterError(f"nodes={self.nodes} must be between 2 and 250")
        for i in range(self.nodes):
            self._add_ns(self.node_ns(i))
        if self.nodes == 2:
            a, b = self.node_ns(0), self.node_ns(1)
            _run([self.ip, "link", "add", IFACE, "netns", a, "type", "veth", "peer", "name", IFACE, "netns", b])
            self.shaped = [(a, IFACE), (b, IFACE)]
        else:
            hub = self.hub_ns
            self._add_ns(hub)
            _run([self.ip, "-n", hub, "link", "add", "br0", "type", "bridge"])
            _run([self.ip, "-n", hub, "link", "set", "br0", "up"])
            for i in range(self.nodes):
                ns, port = self.node_ns(i), f"p{i}"
                _run([self.ip, "link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", hub])
                _run([self.ip, "-n", hub, "link", "set", port, "master", "br0"])
                _run([self.ip, "-n", hub, "link", "set", port, "up"])
                self.shaped += [(ns, IFACE), (hub, port)]
        for i in range(self.nodes):
            ns = self.node_ns(i)
            _run([self.ip, "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFACE])
            _run([self.ip, "-n", ns, "link", "set", IFACE, "up"])

    def _has_netem(self) -> bool:
        ns, dev = self.shaped[0]
        proc = _run([self.tc, "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"], check=False)
        _run([self.tc, "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        return proc.returncode == 0

    def shape(self, link: Link) -> None:
        """Replace the qdisc of every inter-node egress (``rate 0`` and ``delay 0``: none)."""
        for ns, dev in self.shaped:
            _run([self.tc, "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        self.qdisc, self.delay_applied_ms = "none", 0.0
        if not link.limited:
            return
        use_netem = link.delay_ms > 0 and self._has_netem()
        if link.delay_ms > 0 and not use_netem:
            self.warnings.append(f"this kernel has no netem qdisc: the {link.delay_ms:g} ms delay is not "
                                 "applied" + (", only the rate (tbf)" if link.rate_mbit > 0 else ""))
        # Two shaped hops per node-to-node path in the star, one with the veth pair.
        hop_delay = link.delay_ms / (1 if self.nodes == 2 else 2)
        rate_bytes = link.rate_mbit * 1e6 / 8
        burst = max(64 * 1024, int(rate_bytes * 0.005))  # >= one GSO super-packet, 5 ms of tokens
        for ns, dev in self.shaped:
            cmd = [self.tc, "-n", ns, "qdisc", "add", "dev", dev, "root"]
            if use_netem:
                cmd += ["netem", "delay", f"{hop_delay:g}ms", "limit", "100000"]
                if link.rate_mbit > 0:
                    cmd += ["rate", f"{link.rate_mbit:g}mbit"]
            elif link.rate_mbit > 0:
                cmd += ["tbf", "rate", f"{link.rate_mbit:g}mbit", "burst", str(burst), "latency", "100ms"]
            else:
                return
            _run(cmd)
        self.qdisc = "netem" if use_netem else "tbf"
        self.delay_applied_ms = link.delay_ms if use_netem else 0.0

    def tx_bytes(self, i: int) -> int:
        """Bytes node ``i`` has sent on its inter-node interface (kernel counter)."""
        out = _run([self.ip, "-n", self.node_ns(i), "-s", "-j", "link", "show", "dev", IFACE]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def down(self) -> None:
        for ns in reversed(self.namespaces):
            try:
                _kill_namespace_processes(self.ip, ns)
            finally:
                _run([self.ip, "netns", "del", ns], check=False)
        self.namespaces.clear()


# --------------------------------------------------------------------------- rows

HSDP_PREFIX = "hsdp:"


def row_preset(row: str) -> tuple[bool, str]:
    """``(hsdp, preset)`` of a row name: ``hsdp:<preset>`` is ``qsdp train --hsdp`` with it."""
    if row.startswith(HSDP_PREFIX):
        return True, row[len(HSDP_PREFIX):]
    return False, row


def baseline_row(row: str) -> str:
    """The row a row's speedups are against: ``hsdp:fsdp`` for HSDP rows, else ``fsdp``."""
    return HSDP_PREFIX + "fsdp" if row_preset(row)[0] else "fsdp"


def select_rows(presets: Sequence[str], hsdp: bool = False) -> list[str]:
    """The rows to run, in order: ``presets`` (duplicates dropped) and, with ``hsdp``, the HSDP
    row of ``fsdp`` and of each plain preset after them. ConfigError naming a bad preset."""
    rows = list(dict.fromkeys(presets))
    if hsdp:
        plain = [p for p in rows if not row_preset(p)[0]]
        rows += [r for r in dict.fromkeys(HSDP_PREFIX + p for p in ["fsdp", *plain]) if r not in rows]
    for row in rows:
        resolve_config(row_preset(row)[1])
    return rows


def _job_args(row: str, ranks_per_node: int, steps: int, warmup: int, model: str, seq_len: int,
              batch_size: int, out: str, workdir: str) -> list[str]:
    """What each node's torchrun runs for ``row``: the workload module, or the training job."""
    hsdp, preset = row_preset(row)
    shape = ["--preset", preset, "--model", model, "--seq-len", str(seq_len), "--batch-size", str(batch_size)]
    if not hsdp:
        return ["-m", "qsdp.bench.workload", *shape, "--steps", str(steps), "--warmup", str(warmup),
                "--ranks-per-node", str(ranks_per_node), "--out", out]
    return ["-m", "qsdp.cli", "train", "--hsdp", *shape, "--local-world-size", str(ranks_per_node),
            "--steps", str(warmup + steps), "--out", out, "--eval-every", "0", "--ckpt-every", "0",
            "--keep-checkpoints", "1", "--no-progress", "--device", "cpu", "--backend", "gloo",
            "--cache-dir", os.path.join(workdir, "cache")]


def train_result(run_dir: str, warmup: int, steps: int) -> dict[str, Any]:
    """The timed steps (after ``warmup``) of a ``qsdp train`` run in the workload's result
    format: rank 0's step times and the meter's bytes per rank (all-rank totals / world)."""
    summary = read_summary(run_dir)
    records = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    last = records[warmup + steps]
    first = records.get(warmup, {})  # the counters are cumulative; before step 1 they are 0
    world = summary["world_size"]
    stats = {kind: {level: {"bytes": (last[f"wire_bytes_{kind}_{level}"]
                                      - first.get(f"wire_bytes_{kind}_{level}", 0)) / world}
                    for level in LEVELS} for kind in KINDS}
    times = [records[s]["step_time_s"] for s in range(warmup + 1, warmup + steps + 1)]
    return {"preset": summary["preset"], "hsdp": summary["hsdp"], "stats": stats, "step_times_s": times,
            "step_time_s": statistics.median(times), "tokens_per_step": summary["tokens_per_step"]}


# --------------------------------------------------------------------------- launching


def _launch_preset(cluster: EmulatedCluster, preset: str, ranks_per_node: int, steps: int, warmup: int,
                   model: str, seq_len: int, batch_size: int, timeout: float, workdir: str) -> dict[str, Any]:
    """One multi-node torchrun job (one agent per namespace) of the row ``preset``; rank 0's
    workload JSON (for an HSDP row: :func:`train_result` of the training job's run directory)."""
    run_id = f"qsdp-{uuid.uuid4().hex[:8]}"
    hsdp = row_preset(preset)[0]
    out_file = os.path.join(workdir, f"{preset.replace(':', '-')}-{run_id}" + ("" if hsdp else ".json"))
    done_file = os.path.join(out_file, "summary.json") if hsdp else out_file
    job = _job_args(preset, ranks_per_node, steps, warmup, model, seq_len, batch_size, out_file, workdir)
    env = dict(os.environ, GLOO_SOCKET_IFNAME=IFACE, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        env.pop(var, None)
    procs, logs = [], []
    try:
        for i in range(cluster.nodes):
            cmd = [cluster.ip, "netns", "exec", cluster.node_ns(i),
                   sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", str(cluster.nodes), "--nproc-per-node", str(ranks_per_node),
                   "--node-rank", str(i), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{cluster.addr(0)}:{RDZV_PORT}", "--rdzv-id", run_id,
                   "--rdzv-conf", f"is_host={1 if i == 0 else 0},join_timeout={int(max(30, timeout))}",
                   "--local-addr", cluster.addr(i), "--max-restarts", "0", *job]
            log = open(os.path.join(workdir, f"{preset.replace(':', '-')}-{run_id}-node{i}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise ClusterError(f"preset {preset}: the torchrun job ran past its {timeout:.0f} s deadline")
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one node failed: do not wait for the others' rendezvous timeouts
            time.sleep(0.2)
        if any(p.returncode != 0 for p in procs) or not os.path.exists(done_file):
            tails = []
            for i, log in enumerate(logs):
                log.flush()
                log.seek(0)
                tails.append(f"--- node {i} (exit {procs[i].returncode}) ---\n" + log.read()[-3000:])
            raise ClusterError(f"preset {preset}: the torchrun job failed\n" + "\n".join(tails))
        if hsdp:
            return train_result(out_file, warmup, steps)
        with open(out_file) as f:
            return json.load(f)
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                _kill_namespace_processes(cluster.ip, cluster.node_ns(i), grace=3.0)
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
        for log in logs:
            log.close()


def _summarise(res: dict[str, Any], steps: int, ranks_per_node: int) -> dict[str, Any]:
    st = res["stats"]
    inter = sum(st[k]["inter"]["bytes"] for k in st) / steps * ranks_per_node
    intra = sum(st[k]["intra"]["bytes"] for k in st) / steps * ranks_per_node
    t = float(res["step_time_s"])
    return {
        "step_time_s": t,
        "step_times_s": res["step_times_s"],
        "tokens_per_s": res["tokens_per_step"] / t if t > 0 else 0.0,
        "inter_bytes_per_step": inter,
        "intra_bytes_per_step": intra,
    }


def ideal_speedup(t_fsdp: float, inter_fsdp: float, inter_p: float, rate_mbit: float,
                  t_floor: float | None = None) -> float:
    """``t_fsdp / max(t_fsdp - 8 (B_fsdp - B_p) / R, t_floor)`` (see the module docstring)."""
    saved = 8.0 * (inter_fsdp - inter_p) / (rate_mbit * 1e6) if rate_mbit > 0 else 0.0
    t = t_fsdp - saved
    if t_floor is not None:
        t = max(t, t_floor)
    return t_fsdp / t if t > 0 else float("inf")


def _log_new_warnings(cluster: EmulatedCluster, warned: set[str], log: Callable[[str], None]) -> None:
    for warning in cluster.warnings:
        if warning not in warned:
            log(f"warning: {warning}")
            warned.add(warning)
    cluster.warnings.clear()


def _tear_down(cluster: EmulatedCluster) -> None:
    # A second Ctrl-C must not cut the teardown short.
    try:
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        old_int = None
    try:
        cluster.down()
    finally:
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)


def _add_speedups(main: dict[str, dict[str, Any]], unlimited: dict[str, dict[str, Any]] | None,
                  rate_mbit: float) -> None:
    """Each row's measured and ideal speedups against its :func:`baseline_row`'s step (``None``
    without it); ``unlimited``: the same rows' runs on the unlimited link (the floors of the ideal)."""
    for preset, row in main.items():
        row["baseline"] = baseline_row(preset)
        base = main.get(row["baseline"])
        if not base:
            row["speedup_vs_fsdp"] = row["ideal_speedup"] = row["realised_fraction_of_ideal"] = None
            continue
        row["speedup_vs_fsdp"] = base["step_time_s"] / row["step_time_s"]
        floor = unlimited[preset]["step_time_s"] if unlimited and preset in unlimited else None
        row["ideal_speedup_serial"] = ideal_speedup(base["step_time_s"], base["inter_bytes_per_step"],
                                                    row["inter_bytes_per_step"], rate_mbit, floor)
        wire_s = 8.0 * row["inter_bytes_per_step"] / (rate_mbit * 1e6) if rate_mbit > 0 else 0.0
        bound = max(floor or 0.0, wire_s)
        row["ideal_speedup"] = base["step_time_s"] / bound if bound > 0 else row["ideal_speedup_serial"]
        row["realised_fraction_of_ideal"] = row["speedup_vs_fsdp"] / row["ideal_speedup"]


def measure(presets: Sequence[str] = BENCH_PRESETS, nodes: int = 2, ranks_per_node: int = 2,
            rate_mbit: float = 20.0, delay_ms: float = 1.0, unlimited: bool = True, steps: int = 10,
            unlimited_steps: int = 20,
            warmup: int = 1, model: str = "tiny", seq_len: int = 64, batch_size: int = 4,
            timeout: float = 900.0, log=None, hsdp: bool = False) -> dict[str, Any]:
    """Set up the namespaces, run every row (shaped, then unlimited), tear everything down.
    ``steps`` timed steps with the link shaped, ``unlimited_steps`` (cheaper) without. Rows:
    :func:`select_rows` of ``presets`` and ``hsdp``."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    problems = missing_requirements()
    if problems:
        raise ClusterError("qsdp bench cluster needs " + "; ".join(problems))
    presets = select_rows(presets, hsdp)  # fail on a bad name before touching the network
    ip, tc = shutil.which("ip"), shutil.which("tc")
    stale = remove_stale_namespaces(ip)
    if stale:
        log(f"removed stale namespaces of killed runs: {' '.join(stale)}")
    link = Link(rate_mbit, delay_ms)
    cluster = EmulatedCluster(nodes, ip, tc)
    load_before = os.getloadavg()
    runs: list[tuple[str, Link, int]] = []
    if link.limited:
        runs.append(("limited", link, steps))
    if unlimited or not link.limited:
        runs.append(("unlimited", Link(0.0, 0.0), unlimited_steps if link.limited else steps))
    results: dict[str, dict[str, Any]] = {name: {} for name, _, _ in runs}
    link_info: dict[str, Any] = {}
    warned: set[str] = set()
    try:
        cluster.up()
        with tempfile.TemporaryDirectory(prefix="qsdp-cluster-") as workdir:
            # Preset by preset, both passes back to back: a preset's shaped and unlimited runs
            # see the same background load of the machine.
            for p in presets:
                for name, lk, n_steps in runs:
                    cluster.shape(lk)
                    _log_new_warnings(cluster, warned, log)
                    if name == "limited":
                        link_info = {"rate_mbit": lk.rate_mbit, "delay_ms": cluster.delay_applied_ms,
                                     "delay_requested_ms": lk.delay_ms, "qdisc": cluster.qdisc,
                                     "topology": cluster.topology}
                    desc = f"{lk.rate_mbit:g} Mbit/s" if lk.limited else "unlimited"
                    log(f"[{name}] {p}: {nodes} nodes x {ranks_per_node} ranks, link {desc}, {n_steps} steps ...")
                    before = [cluster.tx_bytes(i) for i in range(nodes)]
                    res = _launch_preset(cluster, p, ranks_per_node, n_steps, warmup, model, seq_len, batch_size,
                                         timeout, workdir)
                    after = [cluster.tx_bytes(i) for i in range(nodes)]
                    results[name][p] = _summarise(res, n_steps, ranks_per_node)
                    results[name][p]["link_tx_bytes_per_run"] = statistics.mean(a - b for a, b in zip(after, before))
                    log(f"[{name}] {p}: median step {results[name][p]['step_time_s']:.3f} s")
    finally:
        _tear_down(cluster)
    if not link_info:
        link_info = {"rate_mbit": 0.0, "delay_ms": 0.0, "delay_requested_ms": 0.0, "qdisc": "none",
                     "topology": cluster.topology}
    main_name = runs[0][0]
    main = results[main_name]
    unl = results.get("unlimited") if main_name == "limited" else None
    _add_speedups(main, unl, link.rate_mbit if main_name == "limited" else 0.0)
    out: dict[str, Any] = {
        "link": link_info, "nodes": nodes, "ranks_per_node": ranks_per_node, "model": model,
        "steps": steps, "unlimited_steps": unlimited_steps if unl is not None else None,
        "warmup_steps": warmup, "tokens_per_step": batch_size * seq_len * nodes * ranks_per_node,
        "presets": main,
        "ideal_formula": "t_fsdp / max(8*inter_bytes_p/rate, t_unlimited_p)",
        "ideal_serial_formula": "t_fsdp / max(t_fsdp - 8*(inter_bytes_fsdp - inter_bytes_p)/rate, t_unlimited_p)",
        "bytes_note": "inter/intra_bytes_per_step: byte meter, bytes one node sends per step (rank 0 x ranks "
                      "per node); link_tx_bytes_per_run: kernel counter of one node's veth over the whole job",
        "load_average": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
    }
    if unl is not None:
        for p, r in unl.items():
            ubase = unl.get(baseline_row(p))
            r["baseline"] = baseline_row(p)
            r["speedup_vs_fsdp"] = ubase["step_time_s"] / r["step_time_s"] if ubase else None
        out["unlimited"] = {"presets": unl}
    return out


# --------------------------------------------------------------------------- report


def format_table(result: dict[str, Any]) -> str:
    lk = result["link"]
    unl = result.get("unlimited", {}).get("presets", {})
    if lk["rate_mbit"] > 0 or lk["delay_ms"] > 0:
        desc = (f"link {lk['rate_mbit']:g} Mbit/s per node and direction, delay {lk['delay_ms']:g} ms "
                f"({lk['qdisc']}, {lk['topology']})")
    else:
        desc = "link not limited"
    head = (f"{result['nodes']} emulated nodes x {result['ranks_per_node']} ranks, model {result['model']}, "
            f"{desc}; median of {result['steps']} steps after {result['warmup_steps']} warm-up"
            + (f" ({result['unlimited_steps']} unlimited)" if unl else ""))
    cols = ["preset", "step s", "tokens/s", "inter MB/step", "intra MB/step", "speedup", "ideal", "realised"]
    if unl:
        cols += ["unlimited step s", "vs fsdp"]
    rows = [tuple(cols)]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for p, r in result["presets"].items():
        row = [p, f"{r['step_time_s']:.3f}", f"{r['tokens_per_s']:.0f}", f"{r['inter_bytes_per_step'] / 1e6:.2f}",
               f"{r['intra_bytes_per_step'] / 1e6:.2f}", f(r.get("speedup_vs_fsdp"), ".2f") + "x",
               f(r.get("ideal_speedup"), ".2f") + "x",
               (f(100 * r["realised_fraction_of_ideal"], ".0f") + "%") if r.get("realised_fraction_of_ideal") is not None else "-"]
        if unl:
            u = unl.get(p)
            row += [f"{u['step_time_s']:.3f}" if u else "-", (f(u.get("speedup_vs_fsdp"), ".2f") + "x") if u else "-"]
        rows.append(tuple(row))
    lines = aligned(rows)
    ideal = ("t_fsdp / max(8*inter_p/rate, unlimited step of p)" if unl
             else "t_fsdp / (8*inter_p/rate)")
    foot = (f"inter/intra MB: bytes one node sends per step (byte meter); ideal = {ideal}; "
            "realised = speedup / ideal")
    return "\n".join([head, *lines, foot])


def _install_signal_handlers() -> dict[int, Any]:
    """SIGTERM and SIGHUP raise SystemExit (SIGINT already raises KeyboardInterrupt), so the
    ``finally`` that removes the namespaces runs."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):  # not the main thread
            pass
    return old


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qsdp bench cluster", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Needs root and iproute2 (ip, tc).")
    parser.add_argument("--presets", nargs="+", default=list(BENCH_PRESETS),
                        help="rows: presets, or hsdp:<preset> for `qsdp train --hsdp` with that preset")
    parser.add_argument("--hsdp", action="store_true",
                        help="also run hsdp:fsdp and hsdp:<preset> for every preset (qsdp train --hsdp)")
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (network namespaces)")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--rate", type=float, default=20.0,
                        help="inter-node link rate in Mbit/s per node and direction; 0: not limited")
    parser.add_argument("--delay-ms", type=float, default=1.0,
                        help="one-way node-to-node delay (needs the netem qdisc; 0: none)")
    parser.add_argument("--no-unlimited", dest="unlimited", action="store_false",
                        help="skip the second pass with the link not limited")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per preset on the shaped link")
    parser.add_argument("--unlimited-steps", type=int, default=20,
                        help="timed steps per preset on the unlimited link (cheap; more steps, less noise)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline in seconds of each torchrun job")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", help="also write the JSON result to FILE")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.unlimited_steps < 1:
        parser.error("--steps and --unlimited-steps must be at least 1")
    if args.rate < 0 or args.delay_ms < 0:
        parser.error("--rate and --delay-ms must not be negative")
    if args.nodes < 2:
        parser.error(f"--nodes={args.nodes} must be at least 2")
    try:
        select_rows(args.presets, args.hsdp)
    except ConfigError as e:
        parser.error(str(e))
    problems = missing_requirements()
    if problems:
        print("qsdp bench cluster: cannot emulate nodes, this machine lacks:\n  - " + "\n  - ".join(problems),
              file=sys.stderr)
        return 2
    old = _install_signal_handlers()
    try:
        result = measure(args.presets, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                         rate_mbit=args.rate, delay_ms=args.delay_ms, unlimited=args.unlimited, steps=args.steps,
                         unlimited_steps=args.unlimited_steps,
                         warmup=args.warmup, model=args.model, seq_len=args.seq_len, batch_size=args.batch_size,
                         timeout=args.timeout, hsdp=args.hsdp)
    except ClusterError as e:
        print(f"qsdp bench cluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("qsdp bench cluster: interrupted; the namespaces were removed", file=sys.stderr)
        return 130
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)

    result["meta"] = {"command": "qsdp bench cluster " + " ".join(argv if argv is not None else sys.argv[1:]),
                      "torch": torch.__version__,
                      "device": f"cpu (gloo), {args.nodes} network namespaces x {args.ranks_per_node} ranks "
                                f"on one machine with {os.cpu_count()} CPUs",
                      "date": time.strftime("%Y-%m-%d")}
    png = png_next_to(args.save)
    if png:
        plot(result, png)
    return emit(result, as_json=args.json, save=args.save, format_text=format_table)


def plot(result: dict[str, Any], path: str) -> str:
    """Measured speedup over ``fsdp`` beside the ideal (volume- and compute-bound) one."""
    presets = [p for p, r in result["presets"].items() if r.get("speedup_vs_fsdp") is not None]
    rows = [result["presets"][p] for p in presets]
    rate = result["link"]["rate_mbit"]
    return bar_chart(path, presets, {"measured": [r["speedup_vs_fsdp"] for r in rows],
                                     "ideal": [r["ideal_speedup"] for r in rows]},
                     ylabel="speedup over fsdp",
                     title=f"{result['nodes']} emulated nodes x {result['ranks_per_node']} ranks, {rate:g} Mbit/s link")


if __name__ == "__main__":
    raise SystemExit(main())
