"""``qsdp bench faults``: faults between nodes, injected into a real multi-node training job on
the emulated cluster, and whether the job survives them on the same trajectory.

``qsdp train`` runs as ``--nodes`` emulated nodes (2 by default) x ``--ranks-per-node`` ranks
(2): the network namespaces and links of :mod:`qsdp.bench.cluster`, one torchrun agent per node
with ``--max-restarts``, c10d rendezvous on node 0, checkpoints every ``--ckpt-every`` steps.
Once the job has logged ``--fault-step``, one fault is injected per case:

``link-down``
    The inter-node link goes down (both veth ends) for ``--outage`` seconds. Every collective
    across it ends with an error after the collective timeout qsdp sets (``qsdp train
    --timeout``, passed down to the node subgroups); the workers exit, both agents restart
    them, the new group meets once the link is back and resumes from the last checkpoint.
``node-kill``
    Every process of node 1, its agent and its workers, is killed with SIGKILL. After
    ``--replace-after`` seconds a new agent is started there with the same command (the node
    replaced, as a scheduler would). Node 0's workers see their peers' connections reset and
    exit, node 0's agent restarts them, the new node joins the rendezvous, and all resume from
    the last checkpoint. The replacement's agent has restarted nothing; its workers resume
    because the run directory names this torchrun job
    (:func:`qsdp.train.preflight.rejoins_job`).
``node-lost``
    Every process of node 1 is killed and no node replaces it. The agents were started as an
    elastic job of 1 to N nodes (torchrun ``--nnodes 1:N``): the other agents restart their
    workers, the rendezvous closes with the N - 1 nodes left, and their ranks resume from the
    last checkpoint on the new layout, to the end. The global batch is kept
    (:mod:`qsdp.train.elastic`): shares that may differ by one sequence, drawn in micro-batches
    no larger than each rank's batch before (3 nodes x 1 rank at 3 a rank: 9 a step, then 5 and
    4 in 2 micro-batches each). Not bit for bit: the final loss is compared with the reference's.
``node-returns``
    As ``node-lost``; once the one-node group has logged ``--return-after`` steps, node 1's
    agent starts again. Node 0's agent sees a node waiting, stops its workers (a membership
    change, not a failure), and the job resumes on all N nodes from the last checkpoint.
``slow-link``
    The link is shaped to ``--slow-rate`` for ``--slow-for`` seconds: netem with
    ``--slow-delay-ms`` of delay and ``--slow-loss`` percent of loss where the kernel has
    netem, else tbf at that rate alone (the result names what was applied). Expected: the
    steps slow down, no restart, and the run finishes.

A reference run, the same job with no fault, runs first on the same namespaces. Per case:

* ``detection_s``: from the fault until every worker the surviving nodes ran before it has
  exited; ``detection_bound_s`` = the collective timeout + :data:`EXIT_GRACE_S`;
* ``restart_s``: from detection until the restarted group has logged its first step (process
  start, rendezvous, waiting for the link, loading the checkpoint, one step);
* ``steps_lost``: the last step logged before detection minus the checkpoint step resumed from;
* ``matched``: the per-step losses, the final train and validation losses and the SHA-256 of
  the final weights and optimizer state (``summary.json``) equal the reference's, bit for bit
  (an uninterrupted run passes through the same checkpoint, so this also holds against a run
  resumed from it);
* ``left_behind``: processes still alive in the namespaces once the case's agents have
  exited; and at the end, namespaces of the run not removed;
* ``node-lost`` and ``node-returns`` run on another layout after the fault, so ``matched`` is
  not expected: ``val_loss_diff`` is the final validation loss minus the reference's, and
  ``final_nodes`` the nodes of the group that finished. ``node-returns`` adds ``regrow_s``
  (from node 1's new agent until the 2-node group logs its first step) and
  ``steps_lost_on_regrow``.

The agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch's shared rendezvous
store, a node that joins after a restart never learns the workers' store address (its agent
waits for it until the store timeout and the job dies), so replacing a node needs each
rendezvous round's own store. Needs root and the ``pyroute2`` package (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from qsdp.config import ConfigError, resolve_config
from qsdp.text_table import aligned
from qsdp.train.data import sample_corpus_path
from qsdp.train.metrics import read_metrics, read_summary

from . import netns
from .cluster import (ClusterError, EmulatedCluster, Job, Link, _Emulation,
                      missing_requirements, node_env, run_guarded, torchrun_command)
from .report import description, emit
from qsdp.usage import UsageParser, save_path

CASES = ("link-down", "node-kill", "node-lost", "node-returns", "slow-link")
ELASTIC_CASES = ("node-lost", "node-returns")  # the job goes on with fewer nodes: an elastic node range
# Measured (benchmarks/results/faults.json): the one-node curve ends within 0.01 of the reference;
# a case fails beyond this.
VAL_LOSS_TOLERANCE = 0.1
EXIT_GRACE_S = 5.0  # a worker's collective has raised; the process still has to exit
POLL_S = 0.1
REPLACED_NODE = 1  # never node 0: it hosts the rendezvous store, whose loss ends any torchrun job


@dataclass(frozen=True)
class FaultJob:
    """The training job every case runs, and the faults' timing."""

    preset: str = "sdp4bit"
    model: str = "tiny"
    steps: int = 40
    ckpt_every: int = 5
    fault_step: int = 12
    timeout_s: float = 15.0  # qsdp train --timeout: the collective timeout
    outage_s: float = 30.0
    replace_after_s: float = 2.0
    slow_for_s: float = 15.0
    slow_rate_mbit: float = 10.0
    slow_delay_ms: float = 50.0
    slow_loss_pct: float = 1.0
    max_restarts: int = 3
    # node-returns: steps the one-node group logs before node 1 is back; the rest must outlast
    # the new agent's start and the rendezvous (about 6 s here), or the job ends on one node.
    return_after_steps: int = 2
    last_call_s: float = 10.0  # elastic cases: the rendezvous waits this long for more nodes
    nodes: int = 2
    ranks_per_node: int = 2
    seq_len: int = 64
    batch_size: int = 4
    deadline_s: float = 600.0

    def problems(self) -> list[str]:
        """What is wrong with these settings (empty: nothing)."""
        out = []
        if self.nodes < 2 or self.ranks_per_node < 1 or self.batch_size < 1:
            out.append(f"--nodes {self.nodes} must be at least 2, --ranks-per-node {self.ranks_per_node} and "
                       f"--batch-size {self.batch_size} at least 1")
        if not 1 <= self.fault_step < self.steps:
            out.append(f"--fault-step {self.fault_step} must be between 1 and --steps - 1 ({self.steps - 1})")
        if self.ckpt_every < 1 or self.ckpt_every > self.fault_step:
            out.append(f"--ckpt-every {self.ckpt_every} must be between 1 and --fault-step {self.fault_step} "
                       "(a checkpoint before the fault to resume from)")
        if self.timeout_s <= 0:
            out.append(f"--timeout {self.timeout_s:g} must be positive")
        if self.outage_s <= self.timeout_s:
            out.append(f"--outage {self.outage_s:g} s must be longer than the collective --timeout "
                       f"{self.timeout_s:g} s (a shorter outage only stalls the job, nothing fails)")
        if self.return_after_steps < 1 or self.fault_step + self.return_after_steps >= self.steps:
            out.append(f"--return-after {self.return_after_steps} must be at least 1 and leave steps after "
                       f"--fault-step {self.fault_step} + it (--steps {self.steps})")
        if self.max_restarts < 1:
            out.append(f"--max-restarts {self.max_restarts} must be at least 1 to survive a fault")
        if self.slow_rate_mbit <= 0 or self.slow_for_s <= 0:
            out.append("--slow-rate and --slow-for must be positive")
        if not 0 <= self.slow_loss_pct < 100:
            out.append(f"--slow-loss {self.slow_loss_pct:g} must be a percentage below 100")
        return out

    def train_args(self, out: str, cache: str) -> list[str]:
        """What every node's agent runs: ``python -m qsdp.cli train ...`` into ``out``."""
        return ["-m", "qsdp.cli", "train", "--preset", self.preset, "--model", self.model,
                "--steps", str(self.steps), "--ckpt-every", str(self.ckpt_every), "--keep-checkpoints", "0",
                "--eval-every", "0", "--no-progress", "--backend", "gloo", "--device", "cpu",
                "--param-dtype", "float32", "--data", sample_corpus_path(), "--tokenizer", "byte",
                "--batch-size", str(self.batch_size), "--seq-len", str(self.seq_len),
                "--timeout", f"{self.timeout_s:g}", "--local-world-size", str(self.ranks_per_node),
                "--out", out, "--cache-dir", cache]


# --------------------------------------------------------------------------- one job


@dataclass
class TrainingJob:
    """One ``qsdp train`` job of ``cluster.nodes`` nodes, one torchrun agent per namespace."""

    cluster: EmulatedCluster
    job: FaultJob
    workdir: str
    name: str
    run_id: str = field(default_factory=lambda: f"qsdp-faults-{uuid.uuid4().hex[:8]}")
    elastic: bool = False  # agents of an elastic job of 1 to cluster.nodes nodes
    logs_dir: str | None = None  # where the agents' logs go (default: the work directory)
    agents: dict[int, subprocess.Popen] = field(default_factory=dict)
    logs: list[Any] = field(default_factory=list)

    @property
    def out(self) -> str:
        return os.path.join(self.workdir, self.name)

    def start_node(self, node: int) -> None:
        """Start (or, after a kill, replace) node ``node``'s agent."""
        args = self.job.train_args(self.out, os.path.join(self.workdir, "cache"))
        elastic = dict(min_nodes=1, last_call_s=self.job.last_call_s) if self.elastic else {}
        cmd = torchrun_command(self.cluster, node, self.job.ranks_per_node, self.run_id, args,
                               join_timeout=self.job.deadline_s, max_restarts=self.job.max_restarts, **elastic)
        log = open(os.path.join(self.logs_dir or self.workdir, f"{self.name}-node{node}-{len(self.logs)}.log"), "w+")
        self.logs.append(log)
        env = node_env(node, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        self.agents[node] = netns.popen_in_namespace(self.cluster.node_ns(node), cmd, env=env, stdout=log,
                                                     stderr=subprocess.STDOUT, start_new_session=True)

    def workers(self, node: int) -> set[int]:
        """The processes of node ``node`` other than its agent: its workers."""
        agent = self.agents.get(node)
        return set(netns.namespace_pids(self.cluster.node_ns(node))) - ({agent.pid} if agent else set())

    def kill_node(self, node: int) -> None:
        """SIGKILL every process of node ``node``, its agent included."""
        netns.kill_namespace_processes(self.cluster.node_ns(node), grace=2.0, hard=True)
        agent = self.agents.pop(node, None)
        if agent is not None:
            agent.wait()

    def step_records(self) -> list[dict[str, Any]]:
        """The training records logged so far (none before the first)."""
        try:
            return [r for r in read_metrics(self.out) if "loss" in r]
        except (FileNotFoundError, ValueError):  # not yet written, or being rewritten by a resume
            return []

    def running(self) -> bool:
        return any(a.poll() is None for a in self.agents.values())

    def failure(self) -> str | None:
        """Why the job failed (``None``: every agent exited 0), with the tail of each log."""
        if all(a.returncode == 0 for a in self.agents.values()):
            return None
        codes = {n: a.returncode for n, a in self.agents.items()}
        return f"{self.name}: the torchrun agents exited with {codes}\n" + self.log_tails()

    def log_tails(self) -> str:
        """The last lines of every agent's log, for an error that must say where the job was."""
        tails = []
        for log in self.logs:
            log.flush()
            log.seek(0)
            tails.append(f"--- {os.path.basename(log.name)} ---\n" + log.read()[-2500:])
        return "\n".join(tails)

    def stop(self) -> None:
        """Kill whatever still runs (a failed or overdue case) and close the logs."""
        for node in range(self.cluster.nodes):
            netns.kill_namespace_processes(self.cluster.node_ns(node), grace=3.0)
        for agent in self.agents.values():
            try:
                agent.wait(timeout=5)
            except subprocess.TimeoutExpired:
                agent.kill()
        for log in self.logs:
            log.close()


def left_behind(cluster: EmulatedCluster) -> int:
    """Processes still alive in the node namespaces."""
    return sum(len(netns.namespace_pids(cluster.node_ns(i))) for i in range(cluster.nodes))


# --------------------------------------------------------------------------- the faults


def _set_link(cluster: EmulatedCluster, up: bool) -> None:
    for ns, dev in cluster.shaped:
        (netns.set_up if up else netns.set_down)(ns, dev)


def _slow_link(cluster: EmulatedCluster, job: FaultJob) -> dict[str, Any]:
    """Shape every inter-node egress for the slow-link case; what was applied."""
    rate = job.slow_rate_mbit * 1e6 / 8
    if cluster.has_netem():
        for ns, dev in cluster.shaped:
            netns.set_root_qdisc(ns, dev, "netem", rate_bytes_s=rate, delay_ms=job.slow_delay_ms,
                                 loss_pct=job.slow_loss_pct)
        return {"qdisc": "netem", "rate_mbit": job.slow_rate_mbit, "delay_ms": job.slow_delay_ms,
                "loss_pct": job.slow_loss_pct}
    for ns, dev in cluster.shaped:
        netns.set_root_qdisc(ns, dev, "tbf", rate_bytes_s=rate)
    return {"qdisc": "tbf", "rate_mbit": job.slow_rate_mbit, "delay_ms": 0.0, "loss_pct": 0.0,
            "note": "this kernel has no netem qdisc: the rate alone is limited, no delay or loss"}


def _fault_plan(case: str, cluster: EmulatedCluster, run: TrainingJob,
                job: FaultJob) -> tuple[list[int], list[tuple[Any, str, Callable[[], Any]]]]:
    """``(surviving nodes, [(when, what, action)])`` of ``case``; ``when``: seconds after the
    fault, or a condition on (seconds after the fault, the timeline so far)."""
    if case == "link-down":
        return list(range(cluster.nodes)), [
            (0.0, f"link down for {job.outage_s:g} s", lambda: _set_link(cluster, up=False)),
            (job.outage_s, "link up", lambda: _set_link(cluster, up=True))]
    if case == "node-kill":
        return [n for n in range(cluster.nodes) if n != REPLACED_NODE], [
            (0.0, f"every process of node {REPLACED_NODE} killed (SIGKILL)", lambda: run.kill_node(REPLACED_NODE)),
            (job.replace_after_s, f"node {REPLACED_NODE} replaced: a new agent started",
             lambda: run.start_node(REPLACED_NODE))]
    if case in ELASTIC_CASES:
        actions: list[tuple[Any, str, Callable[[], Any]]] = [
            (0.0, f"every process of node {REPLACED_NODE} killed (SIGKILL), not replaced",
             lambda: run.kill_node(REPLACED_NODE))]
        if case == "node-returns":
            actions.append((lambda now, tl: tl.steps_after_restart >= job.return_after_steps,
                            f"node {REPLACED_NODE} back after {job.return_after_steps} steps on node 0 alone",
                            lambda: run.start_node(REPLACED_NODE) or {"node_back": REPLACED_NODE}))
        return [n for n in range(cluster.nodes) if n != REPLACED_NODE], actions
    if case == "slow-link":
        return [], [
            (0.0, f"link slowed for {job.slow_for_s:g} s", lambda: _slow_link(cluster, job)),
            (job.slow_for_s, "link restored", lambda: cluster.shape(Link(0.0, 0.0)))]
    raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")


@dataclass
class _Timeline:
    """What the polling loop saw, in seconds since the fault."""

    fault_at: float = 0.0
    step_at_fault: int = 0
    detected_s: float | None = None
    last_step_before_detection: int | None = None
    first_step_after_restart_s: float | None = None
    first_step_after_restart: int | None = None
    steps_after_restart: int = 0  # steps the restarted group has logged
    returned_s: float | None = None  # node-returns: the node's new agent started
    regrouped_s: float | None = None  # ... and its workers started: the whole group formed
    last_step_before_regrow: int | None = None
    regrown_s: float | None = None  # ... and it logged its first step
    worker_exits: dict[int, float] = field(default_factory=dict)  # pid -> seconds after the fault
    events: list[dict[str, Any]] = field(default_factory=list)


def _due(when: Any, now: float, tl: _Timeline) -> bool:
    return when(now, tl) if callable(when) else when <= now


def _follow_regrow(run: TrainingJob, tl: _Timeline, records: list[dict[str, Any]], new: list[dict[str, Any]],
                   now: float, case: str, log: Callable[[str], None]) -> None:
    """node-returns: when the returned node's workers start (the whole group has formed; the
    smaller group was stopped before) and when that group logs its first step."""
    if tl.returned_s is None or tl.regrown_s is not None:
        return
    if tl.regrouped_s is None:
        if run.workers(REPLACED_NODE):
            tl.regrouped_s = now
            tl.last_step_before_regrow = max((r["step"] for r in records), default=0)
            log(f"[{case}] +{now:.1f} s: node {REPLACED_NODE}'s workers started "
                f"(the group of {run.cluster.nodes} nodes)")
    elif new:
        tl.regrown_s = now
        log(f"[{case}] +{now:.1f} s: the group of {run.cluster.nodes} nodes logged step {new[0]['step']}")


def _wait_for_step(run: TrainingJob, step: int, deadline: float) -> int:
    while True:
        records = run.step_records()
        if records and records[-1]["step"] >= step:
            return records[-1]["step"]
        if not run.running():
            raise ClusterError(run.failure() or f"{run.name}: the job ended before step {step}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{run.name}: step {step} not reached before the deadline\n" + run.log_tails())
        time.sleep(POLL_S)


def _record_key(r: dict[str, Any]) -> tuple:
    # A step logged again after a restart has its own timing: (step, step time) tells them apart.
    return r["step"], r.get("step_time_s")


def _watch(run: TrainingJob, case: str, job: FaultJob, deadline: float, log: Callable[[str], None]) -> _Timeline:
    """Inject ``case``'s fault at the fault step and follow the job to its end."""
    tl = _Timeline()
    tl.step_at_fault = _wait_for_step(run, job.fault_step, deadline)
    survivors, actions = _fault_plan(case, run.cluster, run, job)
    watched = {pid for n in survivors for pid in run.workers(n)}
    seen = {_record_key(r) for r in run.step_records()}
    tl.fault_at = time.monotonic()
    pending = list(actions)
    while run.running() or pending:
        now = time.monotonic() - tl.fault_at
        while pending and _due(pending[0][0], now, tl):
            _, what, action = pending.pop(0)
            applied = action() or {}
            last = run.step_records()
            tl.events.append({"t_s": round(now, 3), "event": what, "unix_time": round(time.time(), 3),
                              "last_step_logged": last[-1]["step"] if last else 0, **applied})
            if "node_back" in applied:
                tl.returned_s = now
            log(f"[{case}] +{now:.1f} s: {what}")
        records = run.step_records()
        for pid in watched - set(tl.worker_exits):
            if not netns.process_alive(pid):
                tl.worker_exits[pid] = round(now, 2)
        if tl.detected_s is None and watched and len(tl.worker_exits) == len(watched):
            tl.detected_s = now
            tl.last_step_before_detection = max((r["step"] for r in records), default=0)
            log(f"[{case}] +{now:.1f} s: every surviving worker has exited (failure detected)")
        new = [r for r in records if _record_key(r) not in seen]
        if tl.detected_s is not None and tl.first_step_after_restart_s is None and new:
            tl.first_step_after_restart_s = now
            tl.first_step_after_restart = new[0]["step"]
            log(f"[{case}] +{now:.1f} s: the restarted group logged step {new[0]['step']}")
        if tl.first_step_after_restart_s is not None:
            tl.steps_after_restart += len(new)
        _follow_regrow(run, tl, records, new, now, case, log)
        seen.update(_record_key(r) for r in new)
        if time.monotonic() > deadline:
            raise ClusterError(f"{case}: the job ran past its {job.deadline_s:g} s deadline; events "
                               f"{[e['event'] for e in tl.events]}\n" + run.log_tails())
        time.sleep(POLL_S)
    return tl


# --------------------------------------------------------------------------- cases


def _final_state(run: TrainingJob) -> dict[str, Any]:
    summary = read_summary(run.out)
    records = run.step_records()
    return {"losses": [r["loss"] for r in records], "step_times_s": [r["step_time_s"] for r in records],
            **{k: summary.get(k) for k in ("final_train_loss", "final_val_loss", "final_weights_sha256",
                                           "final_optimizer_sha256", "start_step", "restarts", "steps",
                                           "nodes", "world_size", "global_batch", "rank_batches",
                                           "accumulation_steps")}}


def _compare(state: dict[str, Any], ref: dict[str, Any]) -> dict[str, bool]:
    keys = ("losses", "final_train_loss", "final_val_loss", "final_weights_sha256", "final_optimizer_sha256")
    return {k: state[k] == ref[k] for k in keys}


def _run_job(emu: _Emulation, job: FaultJob, case: str | None, log: Callable[[str], None],
             logs_dir: str | None = None) -> dict[str, Any]:
    """One job (``case=None``: the reference) from start to end; its measurements."""
    name = case or "reference"
    run = TrainingJob(emu.cluster, job, emu.workdir, name, logs_dir=logs_dir, elastic=case in ELASTIC_CASES)
    started = time.monotonic()
    deadline = started + job.deadline_s
    try:
        log(f"[{name}] {emu.cluster.nodes} nodes x {job.ranks_per_node} ranks, {job.preset}, {job.steps} steps"
            + (f", fault at step {job.fault_step}" if case else "") + " ...")
        for node in range(emu.cluster.nodes):
            run.start_node(node)
        tl = _watch(run, case, job, deadline, log) if case else None
        while run.running():
            if time.monotonic() > deadline:
                raise ClusterError(f"{name}: the job ran past its {job.deadline_s:g} s deadline\n" + run.log_tails())
            time.sleep(POLL_S)
        problem = run.failure()
        if problem:
            raise ClusterError(problem)
        time.sleep(1.0)  # let the kernel reap what the agents left, then count it
        out = {"wall_s": time.monotonic() - started, "left_behind_processes": left_behind(emu.cluster),
               **_final_state(run)}
        if tl is not None:
            out["timeline"] = tl
        return out
    finally:
        run.stop()
        emu.cluster.shape(Link(0.0, 0.0))
        _set_link(emu.cluster, up=True)


def _slowed_step(case: str, tl: _Timeline, step_times: list[float]) -> float | None:
    """slow-link: the median time of the steps logged while the link was slow (``None`` for the
    other cases, or if none was)."""
    if case != "slow-link" or len(tl.events) < 2:
        return None
    first, last = tl.events[0]["last_step_logged"], tl.events[1]["last_step_logged"]
    slowed = step_times[first:last]  # steps first + 1 .. last; step s is at index s - 1
    return statistics.median(slowed) if slowed else None


def _case_row(case: str, res: dict[str, Any], ref: dict[str, Any], job: FaultJob) -> dict[str, Any]:
    tl: _Timeline = res.pop("timeline")
    matched = _compare(res, ref)
    bound = job.timeout_s + EXIT_GRACE_S
    resumed = res["start_step"]
    if case == "node-returns" and tl.first_step_after_restart is not None:
        resumed = tl.first_step_after_restart - 1  # the final group resumed again, after the regrow
    row: dict[str, Any] = {
        "case": case, "fault_step": tl.step_at_fault, "events": tl.events,
        "worker_exits_s": sorted(tl.worker_exits.values()),
        "detection_s": tl.detected_s, "detection_bound_s": bound if case != "slow-link" else None,
        "restart_s": (tl.first_step_after_restart_s - tl.detected_s
                      if tl.detected_s is not None and tl.first_step_after_restart_s is not None else None),
        "resumed_from_step": resumed if tl.detected_s is not None else None,
        "steps_lost": (tl.last_step_before_detection - resumed if tl.detected_s is not None else 0),
        "restarts": res["restarts"], "matched": all(matched.values()), "matched_fields": matched,
        "final_val_loss": res["final_val_loss"], "final_weights_sha256": res["final_weights_sha256"],
        "left_behind_processes": res["left_behind_processes"], "wall_s": res["wall_s"],
        "reference_median_step_s": statistics.median(ref["step_times_s"]),
        "slowed_step_s": _slowed_step(case, tl, res["step_times_s"]),
    }
    row.update(final_train_loss=res["final_train_loss"], final_nodes=res["nodes"],
               val_loss_diff=res["final_val_loss"] - ref["final_val_loss"],
               # the batch of the group that finished: the reference's global batch, its shares
               final_global_batch=res["global_batch"], final_rank_batches=res["rank_batches"],
               final_accumulation_steps=res["accumulation_steps"])
    if case == "node-returns":
        row.update(
            regrow_s=(tl.regrown_s - tl.returned_s if tl.regrown_s is not None and tl.returned_s is not None
                      else None),
            steps_lost_on_regrow=(tl.last_step_before_regrow - res["start_step"]
                                  if tl.last_step_before_regrow is not None else None))
    expected_restarts = 0 if case == "slow-link" else 1
    row["detected_within_bound"] = (row["detection_s"] is not None and row["detection_s"] <= bound
                                    if case != "slow-link" else None)
    same_trajectory = row["matched"]
    if case in ELASTIC_CASES:  # another layout after the fault: the curve continues, not the bits
        same_trajectory = (abs(row["val_loss_diff"]) < VAL_LOSS_TOLERANCE
                           and row["final_global_batch"] == ref["global_batch"]
                           and row["final_nodes"] == (job.nodes - 1 if case == "node-lost" else job.nodes)
                           and (case == "node-lost" or row["regrow_s"] is not None))
    row["ok"] = (same_trajectory and row["left_behind_processes"] == 0 and row["restarts"] == expected_restarts
                 and row["detected_within_bound"] is not False)
    return row


def run_cases(cases: Sequence[str] = CASES, job: FaultJob = FaultJob(), log=None,
              logs_dir: str | None = None) -> dict[str, Any]:
    """Bring up ``job.nodes`` emulated nodes, run the reference and every case, tear everything down;
    ``logs_dir``: keep every agent's log there."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    problems = missing_requirements() + job.problems()
    for case in cases:
        if case not in CASES:
            problems.append(f"unknown case {case!r}; known: {', '.join(CASES)}")
    try:
        resolve_config(job.preset)
    except ConfigError as e:
        problems.append(str(e))
    if problems:
        raise ClusterError("qsdp bench faults: " + "; ".join(problems))
    emu = _Emulation(job.nodes, Job(ranks_per_node=job.ranks_per_node), log)
    rows = []
    with emu:
        namespaces = list(emu.cluster.namespaces)
        if logs_dir:
            os.makedirs(logs_dir, exist_ok=True)
        ref = _run_job(emu, job, None, log, logs_dir)
        log(f"[reference] done in {ref['wall_s']:.1f} s, final val loss {ref['final_val_loss']:.4f}")
        for case in dict.fromkeys(cases):
            row = _case_row(case, _run_job(emu, job, case, log, logs_dir), ref, job)
            log(f"[{case}] final state {'identical to' if row['matched'] else 'DIFFERENT from'} the reference")
            rows.append(row)
    left = sorted(set(namespaces) & set(netns.list_namespaces()))
    return {"nodes": job.nodes, "ranks_per_node": job.ranks_per_node, "job": asdict(job),
            "reference": {k: v for k, v in ref.items() if k not in ("losses", "step_times_s")},
            "reference_median_step_s": statistics.median(ref["step_times_s"]), "cases": rows,
            "namespaces_left": left, "all_ok": all(r["ok"] for r in rows) and not left,
            "exit_grace_s": EXIT_GRACE_S}


# --------------------------------------------------------------------------- report


def format_table(result: dict[str, Any]) -> str:
    job = result["job"]
    head = (f"{result['nodes']} emulated nodes x {result['ranks_per_node']} ranks, qsdp train --preset {job['preset']} "
            f"--model {job['model']}, {job['steps']} steps, checkpoint every {job['ckpt_every']}, "
            f"collective timeout {job['timeout_s']:g} s, fault at step {job['fault_step']}")
    lines = [("case", "fault", "detected", "bound", "restart", "steps lost", "restarts", "slowed step",
              "node back", "final state", "left behind")]

    def s(x):
        return "-" if x is None else f"{x:.1f} s"

    for r in result["cases"]:
        fault = r["events"][0]["event"] if r["events"] else "-"
        lines.append((r["case"], fault, s(r["detection_s"]), s(r["detection_bound_s"]), s(r["restart_s"]),
                      str(r["steps_lost"]), str(r["restarts"]),
                      "-" if r["slowed_step_s"] is None else
                      f"{r['slowed_step_s']:.2f} s ({r['slowed_step_s'] / r['reference_median_step_s']:.1f}x)",
                      _regrow(r), _final(r), f"{r['left_behind_processes']} processes"))
    foot = ("detected: until every surviving worker exited; restart: from then until the restarted group's "
            "first step; slowed step: median while the link was slow, against the reference's; node back: from "
            "the returning node's agent until the whole group's first step, and the steps that group "
            "repeated; final state: losses, weights and optimizer state against the uninterrupted reference "
            "(on another number of nodes: the final validation loss and its difference, and the global batch as "
            "the ranks' shares x micro-batches); "
            f"namespaces left: {len(result['namespaces_left'])}")
    return "\n".join([head, *aligned(lines), foot])


def _regrow(row: dict[str, Any]) -> str:
    if row.get("regrow_s") is None:
        return "-"
    lost = row["steps_lost_on_regrow"]
    return f"{row['regrow_s']:.1f} s, {lost} step{'' if lost == 1 else 's'} lost"


def _final(row: dict[str, Any]) -> str:
    if row["case"] not in ELASTIC_CASES:
        return "identical" if row["matched"] else "DIFFERENT"
    nodes, shares = row["final_nodes"], row.get("final_rank_batches") or []
    batch = (f", {row['final_global_batch']} a step as {'+'.join(map(str, shares))}"
             f" x{row['final_accumulation_steps']}" if shares else "")
    return (f"val loss {row['final_val_loss']:.4f} ({row['val_loss_diff']:+.4f}) on {nodes} "
            f"node{'s' if nodes != 1 else ''}{batch}")


def _parser() -> argparse.ArgumentParser:
    d = FaultJob()
    p = UsageParser(prog="qsdp bench faults", description=description(__doc__),
                                epilog="Needs root and the pyroute2 package (pip install 'qsdp[bench]').")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES, help="faults to inject, one job each")
    p.add_argument("--nodes", type=int, default=d.nodes, help="emulated nodes (network namespaces)")
    p.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="qsdp train --batch-size: sequences per rank")
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--model", default=d.model)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    p.add_argument("--fault-step", type=int, default=d.fault_step, help="inject once this step is logged")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="qsdp train --timeout: the collective timeout (s)")
    p.add_argument("--outage", type=float, default=d.outage_s, help="link-down: seconds the link stays down")
    p.add_argument("--replace-after", type=float, default=d.replace_after_s,
                   help="node-kill: seconds before the replacement node's agent starts")
    p.add_argument("--slow-for", type=float, default=d.slow_for_s, help="slow-link: seconds the link stays slow")
    p.add_argument("--slow-rate", type=float, default=d.slow_rate_mbit, help="slow-link: Mbit/s per direction")
    p.add_argument("--slow-delay-ms", type=float, default=d.slow_delay_ms, help="slow-link: delay (netem only)")
    p.add_argument("--slow-loss", type=float, default=d.slow_loss_pct, help="slow-link: loss in percent (netem only)")
    p.add_argument("--return-after", type=int, default=d.return_after_steps,
                   help="node-returns: steps the one-node group logs before node 1's agent starts again")
    p.add_argument("--last-call", type=float, default=d.last_call_s,
                   help="node-lost, node-returns: seconds the elastic rendezvous waits for more nodes")
    p.add_argument("--max-restarts", type=int, default=d.max_restarts, help="each agent's torchrun --max-restarts")
    p.add_argument("--deadline", type=float, default=d.deadline_s, help="seconds after which a job is killed")
    p.add_argument("--logs", metavar="DIR", help="keep every torchrun agent's log (its workers' output) in DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--save", metavar="FILE", type=save_path, help="also write the JSON result to FILE")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    job = FaultJob(preset=a.preset, model=a.model, steps=a.steps, ckpt_every=a.ckpt_every, fault_step=a.fault_step,
                   timeout_s=a.timeout, outage_s=a.outage, replace_after_s=a.replace_after, slow_for_s=a.slow_for,
                   slow_rate_mbit=a.slow_rate, slow_delay_ms=a.slow_delay_ms, slow_loss_pct=a.slow_loss,
                   max_restarts=a.max_restarts, return_after_steps=a.return_after, last_call_s=a.last_call,
                   deadline_s=a.deadline, nodes=a.nodes, ranks_per_node=a.ranks_per_node, batch_size=a.batch_size)
    problems = job.problems()
    if problems:
        parser.error("; ".join(problems))
    try:
        resolve_config(job.preset)
    except ConfigError as e:
        parser.error(str(e))
    missing = missing_requirements()
    if missing:
        print("qsdp bench faults: cannot emulate nodes, this machine lacks:\n  - " + "\n  - ".join(missing),
              file=sys.stderr)
        return 2
    result, rc = run_guarded("qsdp bench faults", lambda: run_cases(a.cases, job, logs_dir=a.logs))
    if result is None:
        return rc
    result["meta"] = {"command": "qsdp bench faults " + " ".join(argv if argv is not None else sys.argv[1:]),
                      "torch": torch.__version__,
                      "device": f"cpu (gloo), {job.nodes} network namespaces x {job.ranks_per_node} ranks on one "
                                f"machine with {os.cpu_count()} CPUs",
                      "date": time.strftime("%Y-%m-%d")}
    rc = emit(result, as_json=a.json, save=a.save, format_text=format_table)
    return rc if result["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
