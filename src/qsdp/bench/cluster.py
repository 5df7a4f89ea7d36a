"""``qsdp bench cluster``: real multi-node behaviour on one machine, over a shaped network.

Each emulated node is a named Linux network namespace ``qsdp-<pid>-n<i>`` (``/var/run/netns``,
where ``ip netns`` would put it), with ``lo`` up and one interface ``qsdp-eth`` holding the
private address ``10.213.0.<i+1>/24``. All of it is made over netlink by
:mod:`qsdp.bench.netns` (pyroute2): no ``ip`` or ``tc`` binary is run.

* 2 nodes: one veth pair joins the two namespaces directly.
* more nodes: a star. A hub namespace ``qsdp-<pid>-hub`` holds a bridge ``br0``; each node's
  ``qsdp-eth`` is a veth whose peer ``p<i>`` is a port of that bridge.

Every node's link is shaped in both directions by a root qdisc on the egress of both veth ends: a
node sends at most ``--rate`` Mbit/s and receives at most ``--rate`` Mbit/s (a full-duplex NIC).
``netem delay D rate R`` is used where the kernel has netem; without it, ``tbf rate R`` shapes
the rate and no delay can be added (the JSON's ``link.delay_ms`` is the delay actually applied,
``link.qdisc`` what was used; a requested delay that could not be applied is warned about). In
the star the delay is split over the two hops, so ``--delay-ms`` is node-to-node one way.
Ranks of one node talk over that namespace's local routes: traffic to the node's own address is
routed through ``lo``, never through the shaped veth (the kernel's local route; checked by the
veth's byte counters staying put), so intra-node traffic is unshaped.

Each preset runs as one multi-node ``torchrun`` job (``python -m torch.distributed.run``, i.e.
torchrun): one agent per namespace (the child enters it with ``setns(2)`` between fork and
exec, as ``ip netns exec`` does), ``--rdzv-backend c10d`` with the
rendezvous store on node 0's address, ``--local-addr`` set to the node's address,
``GLOO_SOCKET_IFNAME=qsdp-eth``, ``OMP_NUM_THREADS=1``, running ``python -m
qsdp.bench.workload`` (rank 0 writes the step times and its byte meter as JSON). Every launch
has a deadline after which every process in the namespaces is killed. Namespaces are removed
afterwards, also on error, SIGINT, SIGTERM or SIGHUP; stale ``qsdp-<pid>-*`` namespaces whose
creating process is gone (a run killed with SIGKILL) are removed at the start of a run. Needs
root and the ``pyroute2`` package (the ``bench`` extra).

``--device cuda``: the ranks of all emulated nodes share this machine's GPUs (rank on GPU
``LOCAL_RANK % count``; gloo carries the CUDA tensors through the host, as in the GPU smoke),
the Triton codec kernels on; the parameters in bf16 by default (``--param-dtype``). ``--model
gpt2-125m`` (GPT-2's vocabulary and an untied head, 162M parameters) is a size at which GPU compute matters.

``--rates R1 R2 ...`` (e.g. ``20mbit 100mbit 1gbit 10gbit unlimited``): a sweep. Every preset runs
at every rate on one set of namespaces, rate by rate; one table and JSON ``rows`` with a row per
(rate, preset): step time, bytes, speedup against ``fsdp`` at that rate, the ideal; a plot of
speedup against link rate beside the saved JSON. Before the sweep the performance model's inputs
are measured and every row gets what the model (``qsdp advise``'s) predicts for it, the error and
the advisor's pick against the fastest preset measured (:mod:`qsdp.bench.cluster_advice`;
``--no-advise`` skips it).

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
from qsdp.extras import require
from qsdp.text_table import aligned
from qsdp.train.metrics import read_metrics, read_summary
from qsdp.train.model import MODEL_SIZES

from . import netns
from .report import BENCH_PRESETS, bar_chart, emit, png_next_to
from qsdp.usage import UsageParser, save_path

NS_PREFIX = "qsdp-"
IFACE = "qsdp-eth"
SUBNET = "10.213.0"
RDZV_PORT = 29500
_STALE_RE = re.compile(r"^qsdp-(\d+)-(n\d+|hub)$")


class ClusterError(RuntimeError):
    """A setup step failed (message says which command and why)."""


# --------------------------------------------------------------------------- requirements


def missing_requirements(euid: int | None = None, package: str | None = "check") -> list[str]:
    """What this machine lacks to run the emulation (empty when all is there): root, and the
    netlink package of the ``bench`` extra. ``euid`` is the effective user id (default this
    process's); ``package`` what :func:`qsdp.bench.netns.missing_package` says (default: ask it)."""
    problems = []
    if (os.geteuid() if euid is None else euid) != 0:
        problems.append("root privileges (network namespaces and qdiscs need root; run with sudo)")
    if package == "check":
        package = netns.missing_package()
    if package:
        problems.append(package)
    return problems


def cuda_problem(device: str) -> str | None:
    """Why ``--device`` cannot be used here (``None``: it can)."""
    if device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: torch.cuda.is_available() is False on this machine (use --device cpu)"
    return None


# --------------------------------------------------------------------------- the network


def remove_stale_namespaces() -> list[str]:
    """Delete ``qsdp-<pid>-*`` namespaces whose creating process no longer exists (and any
    process still living in them)."""
    removed = []
    for ns in netns.list_namespaces():
        m = _STALE_RE.match(ns)
        if m and int(m.group(1)) != os.getpid() and not netns.process_alive(int(m.group(1))):
            netns.kill_namespace_processes(ns, grace=2.0)
            if netns.remove_namespace(ns):
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
    tag: str = field(default_factory=lambda: str(os.getpid()))
    namespaces: list[str] = field(default_factory=list)
    # (namespace, device) of every shaped egress: both ends of every inter-node veth.
    shaped: list[tuple[str, str]] = field(default_factory=list)
    qdisc: str = "none"
    delay_applied_ms: float = 0.0
    warnings: list[str] = field(default_factory=list)
    _netem: bool | None = field(default=None, repr=False)

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
        netns.create_namespace(ns)
        self.namespaces.append(ns)

    def up(self) -> None:
        if self.nodes < 2 or self.nodes > 250:
            raise ClusterError(f"nodes={self.nodes} must be between 2 and 250")
        for i in range(self.nodes):
            self._add_ns(self.node_ns(i))
        if self.nodes == 2:
            a, b = self.node_ns(0), self.node_ns(1)
            netns.add_veth(a, IFACE, b, IFACE)
            self.shaped = [(a, IFACE), (b, IFACE)]
        else:
            hub = self.hub_ns
            self._add_ns(hub)
            netns.add_bridge(hub, "br0")
            for i in range(self.nodes):
                ns, port = self.node_ns(i), f"p{i}"
                netns.add_veth(ns, IFACE, hub, port)
                netns.attach_to_bridge(hub, port, "br0")
                self.shaped += [(ns, IFACE), (hub, port)]
        for i in range(self.nodes):
            ns = self.node_ns(i)
            netns.add_address(ns, IFACE, self.addr(i), 24)
            netns.set_up(ns, IFACE)

    def has_netem(self) -> bool:
        """Whether this kernel offers the netem qdisc (probed once, on the first shaped egress)."""
        if self._netem is None:
            self._netem = netns.has_qdisc(*self.shaped[0], "netem")
        return self._netem

    def shape(self, link: Link) -> None:
        """Replace the qdisc of every inter-node egress (``rate 0`` and ``delay 0``: none)."""
        self.qdisc, self.delay_applied_ms = "none", 0.0
        use_netem = link.delay_ms > 0 and self.has_netem()
        if link.delay_ms > 0 and not use_netem:
            self.warnings.append(f"this kernel has no netem qdisc: the {link.delay_ms:g} ms delay is not "
                                 "applied" + (", only the rate (tbf)" if link.rate_mbit > 0 else ""))
        if not use_netem and link.rate_mbit <= 0:  # nothing to apply: back to no qdisc
            for ns, dev in self.shaped:
                netns.clear_root_qdisc(ns, dev)
            return
        # Two shaped hops per node-to-node path in the star, one with the veth pair.
        hop_delay = link.delay_ms / (1 if self.nodes == 2 else 2)
        rate_bytes = link.rate_mbit * 1e6 / 8
        for ns, dev in self.shaped:
            netns.set_root_qdisc(ns, dev, "netem" if use_netem else "tbf", rate_bytes_s=rate_bytes,
                                 delay_ms=hop_delay)
        self.qdisc = "netem" if use_netem else "tbf"
        self.delay_applied_ms = link.delay_ms if use_netem else 0.0

    def tx_bytes(self, i: int) -> int:
        """Bytes node ``i`` has sent on its inter-node interface (kernel counter)."""
        return netns.tx_bytes(self.node_ns(i), IFACE)

    def down(self) -> None:
        for ns in reversed(self.namespaces):
            try:
                netns.kill_namespace_processes(ns)
            finally:
                netns.remove_namespace(ns)
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


@dataclass(frozen=True)
class Job:
    """What every torchrun job of a run trains, whatever its row and link."""

    ranks_per_node: int = 2
    warmup: int = 1
    model: str = "tiny"
    seq_len: int = 64
    batch_size: int = 4
    timeout: float = 900.0
    device: str = "cpu"
    param_dtype: str = "float32"


def _job_args(row: str, job: Job, steps: int, out: str, workdir: str) -> list[str]:
    """What each node's torchrun runs for ``row``: the workload module, or the training job."""
    hsdp, preset = row_preset(row)
    shape = ["--preset", preset, "--model", job.model, "--seq-len", str(job.seq_len),
             "--batch-size", str(job.batch_size), "--device", job.device, "--param-dtype", job.param_dtype]
    if not hsdp:
        return ["-m", "qsdp.bench.workload", *shape, "--steps", str(steps), "--warmup", str(job.warmup),
                "--ranks-per-node", str(job.ranks_per_node), "--out", out]
    return ["-m", "qsdp.cli", "train", "--hsdp", *shape, "--local-world-size", str(job.ranks_per_node),
            "--steps", str(job.warmup + steps), "--out", out, "--eval-every", "0", "--ckpt-every", "0",
            "--keep-checkpoints", "1", "--no-progress", "--backend", "gloo",
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
            "step_time_s": statistics.median(times), "tokens_per_step": summary["tokens_per_step"],
            "n_params": summary.get("n_params"), "codec_kernels": summary.get("codec_kernels")}


# --------------------------------------------------------------------------- launching


def node_env(node: int, **extra: str) -> dict[str, str]:
    """The environment of node ``node``'s torchrun agent: gloo on the node's interface, one
    thread a rank, none of an enclosing job's torchrun variables. The namespaces share the host
    name, so the agent names its emulated node (``QSDP_NODE``) for qsdp to place its ranks."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=IFACE, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               QSDP_NODE=f"node{node}", **extra)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(var, None)
    return env


def torchrun_command(cluster: EmulatedCluster, node: int, nproc: int, run_id: str, args: Sequence[str], *,
                     join_timeout: float, max_restarts: int = 0, min_nodes: int | None = None,
                     last_call_s: float | None = None) -> list[str]:
    """Node ``node``'s torchrun agent (``python -m torch.distributed.run``) of a job of
    ``cluster.nodes`` nodes x ``nproc`` ranks running ``python ARGS``: c10d rendezvous on node
    0's address, the node's own address as ``--local-addr``. ``min_nodes``: an elastic job of
    ``min_nodes`` to ``cluster.nodes`` nodes (``--nnodes MIN:MAX``), whose rendezvous closes
    ``last_call_s`` after the minimum has joined."""
    nnodes = f"{min_nodes}:{cluster.nodes}" if min_nodes else str(cluster.nodes)
    conf = f"is_host={1 if node == 0 else 0},join_timeout={int(join_timeout)}"
    if last_call_s is not None:
        conf += f",last_call_timeout={int(last_call_s)}"
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--node-rank", str(node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addr(0)}:{RDZV_PORT}", "--rdzv-id", run_id,
            "--rdzv-conf", conf, "--local-addr", cluster.addr(node), "--max-restarts", str(max_restarts), *args]


def _launch_preset(cluster: EmulatedCluster, preset: str, job: Job, steps: int, workdir: str) -> dict[str, Any]:
    """One multi-node torchrun job (one agent per namespace) of the row ``preset``; rank 0's
    workload JSON (for an HSDP row: :func:`train_result` of the training job's run directory)."""
    run_id = f"qsdp-{uuid.uuid4().hex[:8]}"
    hsdp = row_preset(preset)[0]
    out_file = os.path.join(workdir, f"{preset.replace(':', '-')}-{run_id}" + ("" if hsdp else ".json"))
    done_file = os.path.join(out_file, "summary.json") if hsdp else out_file
    args = _job_args(preset, job, steps, out_file, workdir)
    timeout = job.timeout
    procs, logs = [], []
    try:
        for i in range(cluster.nodes):
            cmd = torchrun_command(cluster, i, job.ranks_per_node, run_id, args, join_timeout=max(30, timeout))
            log = open(os.path.join(workdir, f"{preset.replace(':', '-')}-{run_id}-node{i}.log"), "w+")
            logs.append(log)
            procs.append(netns.popen_in_namespace(cluster.node_ns(i), cmd, env=node_env(i), stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
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
            return train_result(out_file, job.warmup, steps)
        with open(out_file) as f:
            return json.load(f)
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                netns.kill_namespace_processes(cluster.node_ns(i), grace=3.0)
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
        "n_params": res.get("n_params"),
        "codec_kernels": res.get("codec_kernels"),
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


class _Emulation:
    """The namespaces of one run, brought up and torn down around it, and the rows run on them."""

    def __init__(self, nodes: int, job: Job, log: Callable[[str], None]):
        self.nodes, self.job, self.log = nodes, job, log
        self.cluster = EmulatedCluster(nodes)
        self.warned: set[str] = set()
        self.workdir = ""

    def __enter__(self) -> "_Emulation":
        stale = remove_stale_namespaces()
        if stale:
            self.log(f"removed stale namespaces of killed runs: {' '.join(stale)}")
        self._tmp = tempfile.TemporaryDirectory(prefix="qsdp-cluster-")
        self.workdir = self._tmp.name
        try:
            self.cluster.up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            _tear_down(self.cluster)
        finally:
            self._tmp.cleanup()

    def link_info(self, link: Link) -> dict[str, Any]:
        """The link as applied by the last :meth:`run` (the qdisc, the delay really added)."""
        return {"rate_mbit": link.rate_mbit, "delay_ms": self.cluster.delay_applied_ms,
                "delay_requested_ms": link.delay_ms, "qdisc": self.cluster.qdisc,
                "topology": self.cluster.topology}

    def run(self, row: str, link: Link, steps: int, label: str) -> dict[str, Any]:
        """One row on ``link``: :func:`_summarise` of its job and the veth's tx bytes."""
        self.cluster.shape(link)
        _log_new_warnings(self.cluster, self.warned, self.log)
        desc = f"{link.rate_mbit:g} Mbit/s" if link.limited else "unlimited"
        self.log(f"[{label}] {row}: {self.nodes} nodes x {self.job.ranks_per_node} ranks, link {desc}, "
                 f"{steps} steps ...")
        before = [self.cluster.tx_bytes(i) for i in range(self.nodes)]
        res = _launch_preset(self.cluster, row, self.job, steps, self.workdir)
        after = [self.cluster.tx_bytes(i) for i in range(self.nodes)]
        out = _summarise(res, steps, self.job.ranks_per_node)
        out["link_tx_bytes_per_run"] = statistics.mean(a - b for a, b in zip(after, before))
        self.log(f"[{label}] {row}: median step {out['step_time_s']:.3f} s")
        return out


def _check_can_run(job: Job) -> None:
    problems = missing_requirements()
    if problems:
        raise ClusterError("qsdp bench cluster needs " + "; ".join(problems))
    problem = cuda_problem(job.device)
    if problem:
        raise ClusterError(problem)


def _common(nodes: int, job: Job, rows: dict[str, dict[str, Any]], load_before: Sequence[float]) -> dict[str, Any]:
    """The fields every result has: the shape of the job and the machine's load."""
    n_params = next((r["n_params"] for r in rows.values() if r.get("n_params")), None)
    return {"nodes": nodes, "ranks_per_node": job.ranks_per_node, "model": job.model, "n_params": n_params,
            "device": job.device, "param_dtype": job.param_dtype, "seq_len": job.seq_len,
            "batch_size": job.batch_size, "warmup_steps": job.warmup,
            "tokens_per_step": job.batch_size * job.seq_len * nodes * job.ranks_per_node,
            "load_average": {"before": list(load_before), "after": list(os.getloadavg()), "cpus": os.cpu_count()}}


def measure(presets: Sequence[str] = BENCH_PRESETS, nodes: int = 2, ranks_per_node: int = 2,
            rate_mbit: float = 20.0, delay_ms: float = 1.0, unlimited: bool = True, steps: int = 10,
            unlimited_steps: int = 20,
            warmup: int = 1, model: str = "tiny", seq_len: int = 64, batch_size: int = 4,
            timeout: float = 900.0, log=None, hsdp: bool = False, device: str = "cpu",
            param_dtype: str = "float32") -> dict[str, Any]:
    """Set up the namespaces, run every row (shaped, then unlimited), tear everything down.
    ``steps`` timed steps with the link shaped, ``unlimited_steps`` (cheaper) without. Rows:
    :func:`select_rows` of ``presets`` and ``hsdp``."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    job = Job(ranks_per_node, warmup, model, seq_len, batch_size, timeout, device, param_dtype)
    _check_can_run(job)
    presets = select_rows(presets, hsdp)  # fail on a bad name before touching the network
    link = Link(rate_mbit, delay_ms)
    load_before = os.getloadavg()
    runs: list[tuple[str, Link, int]] = []
    if link.limited:
        runs.append(("limited", link, steps))
    if unlimited or not link.limited:
        runs.append(("unlimited", Link(0.0, 0.0), unlimited_steps if link.limited else steps))
    results: dict[str, dict[str, Any]] = {name: {} for name, _, _ in runs}
    link_info: dict[str, Any] = {}
    with _Emulation(nodes, job, log) as emu:
        # Preset by preset, both passes back to back: a preset's shaped and unlimited runs
        # see the same background load of the machine.
        for p in presets:
            for name, lk, n_steps in runs:
                results[name][p] = emu.run(p, lk, n_steps, name)
                if name == "limited":
                    link_info = emu.link_info(lk)
        topology = emu.cluster.topology
    if not link_info:
        link_info = {"rate_mbit": 0.0, "delay_ms": 0.0, "delay_requested_ms": 0.0, "qdisc": "none",
                     "topology": topology}
    main_name = runs[0][0]
    main = results[main_name]
    unl = results.get("unlimited") if main_name == "limited" else None
    _add_speedups(main, unl, link.rate_mbit if main_name == "limited" else 0.0)
    out: dict[str, Any] = {
        "link": link_info, **_common(nodes, job, main, load_before),
        "steps": steps, "unlimited_steps": unlimited_steps if unl is not None else None,
        "presets": main,
        "ideal_formula": "t_fsdp / max(8*inter_bytes_p/rate, t_unlimited_p)",
        "ideal_serial_formula": "t_fsdp / max(t_fsdp - 8*(inter_bytes_fsdp - inter_bytes_p)/rate, t_unlimited_p)",
        "bytes_note": BYTES_NOTE,
    }
    if unl is not None:
        for p, r in unl.items():
            ubase = unl.get(baseline_row(p))
            r["baseline"] = baseline_row(p)
            r["speedup_vs_fsdp"] = ubase["step_time_s"] / r["step_time_s"] if ubase else None
        out["unlimited"] = {"presets": unl}
    return out


BYTES_NOTE = ("inter/intra_bytes_per_step: byte meter, bytes one node sends per step (rank 0 x ranks per node); "
              "link_tx_bytes_per_run: kernel counter of one node's veth over the whole job")


# --------------------------------------------------------------------------- the sweep

_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """``"20mbit"``, ``"1gbit"``, ``"500kbit"``, ``"100"`` (Mbit/s) or ``"unlimited"`` -> Mbit/s
    (0: not limited). ValueError naming a bad one."""
    if text.strip().lower() in ("unlimited", "inf", "none"):
        return 0.0
    m = _RATE_RE.match(text)
    if not m:
        raise ValueError(f"rate {text!r}: expected e.g. 20mbit, 1gbit, 100 (Mbit/s) or unlimited")
    value = float(m.group(1)) * {"k": 1e-3, "m": 1.0, "g": 1e3, "": 1.0}[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"rate {text!r}: use `unlimited` for a link that is not limited")
    if value * 1e6 / 8 >= 2 ** 32:
        raise ValueError(f"rate {text!r}: the qdiscs shape at most 34 Gbit/s; use `unlimited` above that")
    return value


def rate_label(rate_mbit: float) -> str:
    """``20 -> "20 Mbit/s"``, ``1000 -> "1 Gbit/s"``, ``0 -> "unlimited"``."""
    if rate_mbit <= 0:
        return "unlimited"
    return f"{rate_mbit / 1e3:g} Gbit/s" if rate_mbit >= 1e3 else f"{rate_mbit:g} Mbit/s"


def measure_rates(rates_mbit: Sequence[float], presets: Sequence[str] = BENCH_PRESETS, nodes: int = 2,
                  delay_ms: float = 1.0, steps: int = 10, unlimited_steps: int = 20, job: Job = Job(),
                  log=None, advise: bool = True) -> dict[str, Any]:
    """Every preset at every link rate (0: unlimited) on one set of namespaces: ``rows``, one per
    (rate, preset), with the step time, the bytes and the speedup against ``fsdp`` at that rate
    (and the ideal speedup where the unlimited rate, its floor, is among them). ``advise``: first
    measure the performance model's inputs, then put its prediction, error and pick in every
    row (:mod:`qsdp.bench.cluster_advice`)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    _check_can_run(job)
    rows_names = select_rows(presets)
    if any(row_preset(r)[0] for r in rows_names):
        raise ConfigError("--rates runs the plain presets; HSDP rows are measured at one --rate")
    rates = list(dict.fromkeys(float(r) for r in rates_mbit))
    load_before = os.getloadavg()
    inputs = None
    if advise:
        from .cluster_advice import measure_inputs

        log(f"measuring the performance model's inputs ({nodes * job.ranks_per_node} local ranks) ...")
        inputs = measure_inputs(nodes, job.ranks_per_node, model=job.model, seq_len=job.seq_len,
                                batch_size=job.batch_size, device=job.device, param_dtype=job.param_dtype,
                                presets=rows_names)
        log(f"compute {inputs.compute_s:.3f} s, intra-node {inputs.intra_gbps:.2f} GB/s, "
            f"latency {inputs.latency_us:.0f} us per collective step")
    per_rate: dict[float, dict[str, dict[str, Any]]] = {}
    links: dict[float, dict[str, Any]] = {}
    with _Emulation(nodes, job, log) as emu:
        # Rate by rate, its presets back to back: the rows a speedup compares see the same load.
        for rate in rates:
            link = Link(rate, delay_ms if rate > 0 else 0.0)
            per_rate[rate] = {p: emu.run(p, link, steps if rate > 0 else unlimited_steps, rate_label(rate))
                              for p in rows_names}
            links[rate] = emu.link_info(link)
    floor = per_rate.get(0.0)
    rows = []
    for rate in rates:
        _add_speedups(per_rate[rate], floor, rate)
        for p, r in per_rate[rate].items():
            rows.append({"rate_mbit": rate, "preset": p, "qdisc": links[rate]["qdisc"],
                         "delay_ms": links[rate]["delay_ms"], **r})
    first = per_rate[rates[0]]
    result = {**_common(nodes, job, first, load_before), "rates_mbit": rates, "delay_requested_ms": delay_ms,
              "topology": emu.cluster.topology, "steps": steps, "unlimited_steps": unlimited_steps,
              "rows": rows, "bytes_note": BYTES_NOTE,
              "ideal_formula": "t_fsdp / max(8*inter_bytes_p/rate, t_unlimited_p) (with an unlimited rate measured)"}
    if inputs is not None:
        from .cluster_advice import predict_rows

        predict_rows(result, inputs)
    return result


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


def format_rates_table(result: dict[str, Any]) -> str:
    """The sweep: one line per (rate, preset)."""
    head = (f"{result['nodes']} emulated nodes x {result['ranks_per_node']} ranks, model {result['model']}"
            + (f" ({result['n_params'] / 1e6:.0f}M parameters, {result['param_dtype']})" if result.get("n_params") else "")
            + f" on {result['device']}, {result['topology']}; median of {result['steps']} steps "
            f"({result['unlimited_steps']} unlimited) after {result['warmup_steps']} warm-up")
    cols = ["rate", "preset", "step s", "tokens/s", "inter MB/step", "speedup", "ideal"]
    advised = any("predicted_speedup" in r for r in result["rows"])
    if advised:
        cols += ["predicted", "error", "advisor pick", "fastest measured"]
    lines = [tuple(cols)]

    def f(x, fmt, suffix=""):
        return "-" if x is None else format(x, fmt) + suffix

    for r in result["rows"]:
        line = [rate_label(r["rate_mbit"]), r["preset"], f"{r['step_time_s']:.3f}", f"{r['tokens_per_s']:.0f}",
                f"{r['inter_bytes_per_step'] / 1e6:.2f}", f(r.get("speedup_vs_fsdp"), ".2f", "x"),
                f(r.get("ideal_speedup"), ".2f", "x")]
        if advised:
            err = r.get("prediction_error")
            line += [f(r.get("predicted_speedup"), ".2f", "x"), f(None if err is None else 100 * err, "+.0f", "%"),
                     r.get("advisor_pick") or "-", r.get("fastest_measured") or "-"]
        lines.append(tuple(line))
    foot = "speedup: fsdp's step at the same rate / the preset's; ideal = t_fsdp / max(8*inter_p/rate, unlimited step of p)"
    if advised:
        foot += "; predicted: the performance model of qsdp advise; error = predicted / measured - 1"
    return "\n".join([head, *aligned(lines), foot])


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


def run_guarded(prog: str, run: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any] | None, int]:
    """``(run(), 0)``, the namespaces torn down whatever happens (SIGTERM and SIGHUP too); a
    failure of the emulation or Ctrl-C is one line on stderr and ``(None, exit code)``."""
    old = _install_signal_handlers()
    try:
        return run(), 0
    except (ClusterError, netns.NetlinkError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None, 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; the namespaces were removed", file=sys.stderr)
        return None, 130
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _parser() -> argparse.ArgumentParser:
    parser = UsageParser(prog="qsdp bench cluster", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Needs root and the pyroute2 package (pip install 'qsdp[bench]').")
    parser.add_argument("--presets", nargs="+", default=list(BENCH_PRESETS),
                        help="rows: presets, or hsdp:<preset> for `qsdp train --hsdp` with that preset")
    parser.add_argument("--hsdp", action="store_true",
                        help="also run hsdp:fsdp and hsdp:<preset> for every preset (qsdp train --hsdp)")
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (network namespaces)")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--rate", type=float, default=20.0,
                        help="inter-node link rate in Mbit/s per node and direction; 0: not limited")
    parser.add_argument("--rates", nargs="+", metavar="RATE",
                        help="a sweep instead of --rate: every preset at every rate (e.g. 20mbit 100mbit 1gbit "
                             "10gbit unlimited; a bare number is Mbit/s), one table, speedup plotted against rate")
    parser.add_argument("--no-advise", dest="advise", action="store_false",
                        help="with --rates: skip the performance model's prediction for every row (and the "
                             "measurement of its inputs before the sweep)")
    parser.add_argument("--delay-ms", type=float, default=1.0,
                        help="one-way node-to-node delay (needs the netem qdisc; 0: none)")
    parser.add_argument("--no-unlimited", dest="unlimited", action="store_false",
                        help="skip the second pass with the link not limited")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per preset on the shaped link")
    parser.add_argument("--unlimited-steps", type=int, default=20,
                        help="timed steps per preset on the unlimited link (cheap; more steps, less noise)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", default="tiny", choices=tuple(MODEL_SIZES),
                        help="GPT size (gpt2-*: GPT-2's vocabulary, e.g. gpt2-125m has 162M parameters with its untied head)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the ranks of all emulated nodes share this machine's GPUs (gloo carrying "
                             "CUDA tensors, the Triton codec kernels on)")
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=None,
                        help="FSDP2 mixed precision of the parameters (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline in seconds of each torchrun job")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result (and a PNG beside it) to FILE")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.unlimited_steps < 1:
        parser.error("--steps and --unlimited-steps must be at least 1")
    if args.rate < 0 or args.delay_ms < 0:
        parser.error("--rate and --delay-ms must not be negative")
    if args.nodes < 2:
        parser.error(f"--nodes={args.nodes} must be at least 2")
    try:
        rates = [parse_rate(r) for r in args.rates] if args.rates else None
        select_rows(args.presets, args.hsdp)
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    if rates is not None and (args.hsdp or any(row_preset(p)[0] for p in args.presets)):
        parser.error("--rates runs the plain presets; HSDP rows are measured at one --rate")
    problem = cuda_problem(args.device)
    if problem:
        parser.error(problem)
    problems = missing_requirements()
    if problems:
        print("qsdp bench cluster: cannot emulate nodes, this machine lacks:\n  - " + "\n  - ".join(problems),
              file=sys.stderr)
        return 2
    param_dtype = args.param_dtype or ("bfloat16" if args.device == "cuda" else "float32")
    job = Job(args.ranks_per_node, args.warmup, args.model, args.seq_len, args.batch_size, args.timeout,
              args.device, param_dtype)

    def run() -> dict[str, Any]:
        if rates is not None:
            return measure_rates(rates, args.presets, nodes=args.nodes, delay_ms=args.delay_ms, steps=args.steps,
                                 unlimited_steps=args.unlimited_steps, job=job,
                                 advise=args.advise and "fsdp" in args.presets and args.ranks_per_node >= 2)
        return measure(args.presets, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                       rate_mbit=args.rate, delay_ms=args.delay_ms, unlimited=args.unlimited,
                       steps=args.steps, unlimited_steps=args.unlimited_steps, warmup=args.warmup,
                       model=args.model, seq_len=args.seq_len, batch_size=args.batch_size,
                       timeout=args.timeout, hsdp=args.hsdp, device=args.device, param_dtype=param_dtype)

    result, rc = run_guarded("qsdp bench cluster", run)
    if result is None:
        return rc

    gpu = f", {torch.cuda.get_device_name(0)} shared by all ranks" if args.device == "cuda" else ""
    result["meta"] = {"command": "qsdp bench cluster " + " ".join(argv if argv is not None else sys.argv[1:]),
                      "torch": torch.__version__,
                      "device": f"{args.device} (gloo), {args.nodes} network namespaces x {args.ranks_per_node} "
                                f"ranks on one machine with {os.cpu_count()} CPUs{gpu}",
                      "date": time.strftime("%Y-%m-%d")}
    png = png_next_to(args.save)
    if png:
        (plot_rates if rates is not None else plot)(result, png)
    return emit(result, as_json=args.json, save=args.save,
                format_text=format_rates_table if rates is not None else format_table)


def plot(result: dict[str, Any], path: str) -> str:
    """Measured speedup over ``fsdp`` beside the ideal (volume- and compute-bound) one."""
    presets = [p for p, r in result["presets"].items() if r.get("speedup_vs_fsdp") is not None]
    rows = [result["presets"][p] for p in presets]
    rate = result["link"]["rate_mbit"]
    return bar_chart(path, presets, {"measured": [r["speedup_vs_fsdp"] for r in rows],
                                     "ideal": [r["ideal_speedup"] for r in rows]},
                     ylabel="speedup over fsdp",
                     title=f"{result['nodes']} emulated nodes x {result['ranks_per_node']} ranks, {rate:g} Mbit/s link")


def plot_rates(result: dict[str, Any], path: str) -> str:
    """Measured speedup over ``fsdp`` against the link rate (log axis), one line per preset; the
    unlimited link is drawn one decade right of the fastest limited rate."""
    require("matplotlib", "the sweep's chart")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    limited = sorted(r for r in result["rates_mbit"] if r > 0)
    unlimited_x = (limited[-1] if limited else 1.0) * 10
    fig = Figure(figsize=(7.0, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    presets = list(dict.fromkeys(r["preset"] for r in result["rows"]))
    for p in presets:
        pts = sorted((r["rate_mbit"] if r["rate_mbit"] > 0 else unlimited_x, r["speedup_vs_fsdp"])
                     for r in result["rows"] if r["preset"] == p and r.get("speedup_vs_fsdp") is not None)
        line, = ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        pred = sorted((r["rate_mbit"] if r["rate_mbit"] > 0 else unlimited_x, r["predicted_speedup"])
                      for r in result["rows"] if r["preset"] == p and r.get("predicted_speedup") is not None)
        if pred:
            ax.plot([x for x, _ in pred], [y for _, y in pred], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log")
    has_unlimited = 0.0 in result["rates_mbit"]
    ax.set_xticks(limited + ([unlimited_x] if has_unlimited else []),
                  [rate_label(t) for t in limited] + (["unlimited"] if has_unlimited else []), rotation=30, ha="right")
    ax.minorticks_off()
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("inter-node link rate per node and direction")
    ax.set_ylabel("speedup over fsdp" + (" (dashed: predicted)" if any("predicted_speedup" in r for r in result["rows"]) else ""))
    ax.set_title(f"{result['nodes']} emulated nodes x {result['ranks_per_node']} ranks, {result['model']} on {result['device']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
