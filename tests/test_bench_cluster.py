"""`qsdp bench cluster`: emulated nodes in network namespaces joined by a shaped veth link.

The end-to-end tests need root and pyroute2 and are skipped, with the reason, where either is
missing; they run with `ip` and `tc` off the PATH (the benchmark speaks netlink itself). The
requirement checks run everywhere.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import torch

from distributed import run_pooled
from prestarted import PRESTARTED, Command
from qsdp.bench import netns
from qsdp.bench.cluster import (
    Job,
    _job_args,
    baseline_row,
    format_rates_table,
    format_table,
    ideal_speedup,
    main,
    missing_requirements,
    parse_rate,
    select_rows,
    train_result,
)
from qsdp.train.loop import TrainArgs, train_worker
from qsdp.train.model import MODEL_SIZES, GPTConfig, default_vocab, n_params

_MISSING = missing_requirements()
needs_netns = pytest.mark.skipif(
    bool(_MISSING), reason="needs " + "; ".join(_MISSING) if _MISSING else "")
_RUN_MAIN = "from qsdp.bench.cluster import main; raise SystemExit(main(sys.argv[1:]))"


def _ours(pid: int) -> list[str]:
    return [ns for ns in netns.list_namespaces() if ns.startswith(f"qsdp-{pid}-")]


def _cluster_cmd(*args: str, prelude: str = "") -> list[str]:
    return [sys.executable, "-c", "import sys; " + prelude + _RUN_MAIN, *args]


def _env_without_iproute2() -> dict[str, str]:
    """This environment with a PATH that has the interpreter's directory alone (no `ip`, `tc`)."""
    path = os.path.dirname(sys.executable)
    assert shutil.which("ip", path=path) is None and shutil.which("tc", path=path) is None
    return dict(os.environ, PATH=path)


@needs_netns
@pytest.mark.slow  # 50 s; the sweep's rows and plot, beside the single-rate runs below
@pytest.mark.timeout(300)
def test_quick_sweep_without_iproute2_has_a_row_per_rate_and_preset_and_a_plot(tmp_path):
    save = tmp_path / "sweep.json"
    proc = subprocess.Popen(
        _cluster_cmd("--presets", "fsdp", "sdp4bit", "--rates", "1gbit", "unlimited", "--steps", "1",
                     "--unlimited-steps", "1", "--delay-ms", "0", "--no-advise", "--timeout", "200", "--json", "--save", str(save)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env_without_iproute2())
    out, err = proc.communicate(timeout=290)
    assert proc.returncode == 0, err[-3000:]
    assert _ours(proc.pid) == []  # namespaces (and their veths) are gone
    data = json.loads(out)
    assert data == json.loads(save.read_text())
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert data["rates_mbit"] == [1000.0, 0.0] and data["nodes"] == 2 and data["ranks_per_node"] == 2
    assert set(data["meta"]) >= {"command", "torch", "date", "device"}
    rows = {(r["rate_mbit"], r["preset"]): r for r in data["rows"]}
    assert set(rows) == {(1000.0, "fsdp"), (1000.0, "sdp4bit"), (0.0, "fsdp"), (0.0, "sdp4bit")}
    assert rows[1000.0, "fsdp"]["qdisc"] == "tbf" and rows[0.0, "fsdp"]["qdisc"] == "none"
    for r in rows.values():
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["link_tx_bytes_per_run"] > 0
        assert r["speedup_vs_fsdp"] == pytest.approx(rows[r["rate_mbit"], "fsdp"]["step_time_s"] / r["step_time_s"])
    for rate in (1000.0, 0.0):  # the bytes do not depend on the link
        assert rows[rate, "sdp4bit"]["inter_bytes_per_step"] * 5 < rows[rate, "fsdp"]["inter_bytes_per_step"]
    table = format_rates_table(data)
    assert "1 Gbit/s" in table and "unlimited" in table and "sdp4bit" in table


@needs_netns
@pytest.mark.timeout(120)
def test_interrupt_removes_namespaces():
    # A shell's background job inherits SIGINT ignored (no job control): give the child the
    # default disposition, so that Python installs its KeyboardInterrupt handler, as in a terminal.
    proc = subprocess.Popen(_cluster_cmd("--presets", "fsdp", "--steps", "50", "--rate", "1", "--delay-ms", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env_without_iproute2(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while len(_ours(proc.pid)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.2)
        time.sleep(2)  # let the torchrun agents start inside the namespaces
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert _ours(proc.pid) == []


@needs_netns
@pytest.mark.timeout(60)
def test_stale_namespaces_of_dead_runs_are_removed():
    from qsdp.bench.cluster import remove_stale_namespaces

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"qsdp-{dead.pid}-n0"
    netns.create_namespace(name)
    try:
        assert name in remove_stale_namespaces()
        assert _ours(dead.pid) == []
    finally:
        netns.remove_namespace(name)


def test_missing_root_and_netlink_package_are_named():
    problems = missing_requirements(euid=1000, package=netns.missing_package() or "pyroute2: pip install 'qsdp[bench]'")
    text = "\n".join(problems)
    assert "root" in text and "pyroute2" in text and "qsdp[bench]" in text
    assert missing_requirements(euid=0, package=None) == []


def _ahead(*args: str, prelude: str = "") -> Command:
    return Command.python(*_cluster_cmd(*args, prelude=prelude)[1:], cwd=os.path.dirname(os.path.abspath(__file__)))


# Both run ahead of their tests (a fresh interpreter's imports each): stdout and stderr come together.
WITHOUT_PYROUTE2 = _ahead("--presets", "fsdp", prelude="sys.modules['pyroute2'] = None; ")
CUDA_HERE = _ahead("--presets", "fsdp", "--device", "cuda")


@pytest.mark.timeout(60)
@pytest.mark.prestart(lambda: WITHOUT_PYROUTE2)
def test_without_pyroute2_the_error_names_the_package_and_the_extra(request):
    # pyroute2 made unimportable in the child, as on a machine where the extra is not installed.
    rc, printed = PRESTARTED.result(request.node.nodeid, WITHOUT_PYROUTE2, timeout=50)
    assert rc == 2
    assert printed.startswith("qsdp bench cluster: cannot emulate nodes, this machine lacks:\n"), printed
    assert "package pyroute2" in printed and "qsdp[bench]" in printed and "lacks" in printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.timeout(60)
@pytest.mark.prestart(lambda: None if torch.cuda.is_available() else CUDA_HERE)
def test_device_cuda_without_cuda_is_refused_before_any_namespace_exists(request):
    rc, printed = PRESTARTED.result(request.node.nodeid, CUDA_HERE, timeout=50)
    assert rc == 2
    assert "--device cuda" in printed and "torch.cuda.is_available() is False" in printed
    assert "stale" not in printed and "Mbit/s" not in printed  # nothing was set up


def test_rates_are_read_in_mbit_per_second():
    assert [parse_rate(r) for r in ("20mbit", "100Mbit", "1gbit", "10gbit", "500kbit", "250", "unlimited")] == \
        [20.0, 100.0, 1000.0, 10000.0, 0.5, 250.0, 0.0]
    for bad in ("fast", "0mbit", "40gbit", "-5"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_a_bad_rate_or_an_hsdp_row_in_a_sweep_is_refused_before_any_network_is_touched(capsys):
    for argv in (["--rates", "20mbit", "quick"], ["--rates", "20mbit", "--hsdp"]):
        with pytest.raises(SystemExit) as exc:
            main(["--presets", "fsdp", *argv])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "rate 'quick'" in err and "HSDP rows are measured at one --rate" in err


def test_the_gpt2_125m_size_has_over_100m_parameters_with_its_default_vocabulary():
    cfg = GPTConfig(vocab_size=default_vocab("gpt2-125m"), block_size=64, **MODEL_SIZES["gpt2-125m"])
    assert n_params(cfg) > 100e6
    assert default_vocab("tiny") == 256


def test_serial_ideal_speedup_subtracts_the_saved_link_time():
    # fsdp: 10 s a step; the preset saves 8e6 bytes = 64 Mbit = 8 s at 8 Mbit/s -> 2 s ideal.
    assert ideal_speedup(10.0, 9e6, 1e6, 8.0) == pytest.approx(5.0)
    assert ideal_speedup(10.0, 9e6, 1e6, 8.0, t_floor=4.0) == pytest.approx(2.5)  # compute floor
    assert ideal_speedup(10.0, 9e6, 9e6, 8.0) == pytest.approx(1.0)


# --------------------------------------------------------------------------- HSDP rows


# Two whole 2 x 2 `qsdp train` jobs in namespaces through the command line: 45 s on 2 idle cores,
# past make test's 30 s a test; make test keeps the rows' figures (hsdp_runs below) and the
# namespaces' clean-up (test_interrupt_removes_namespaces).
@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_hsdp_rows_run_qsdp_train_hsdp_and_send_fewer_inter_node_bytes(tmp_path):
    proc = subprocess.Popen(
        _cluster_cmd("--presets", "hsdp:fsdp", "hsdp:sdp4bit", "--steps", "2", "--warmup", "1", "--rate", "1000",
                     "--delay-ms", "0", "--no-unlimited", "--timeout", "240", "--json"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env_without_iproute2())
    out, err = proc.communicate(timeout=290)
    assert proc.returncode == 0, err[-3000:]
    assert _ours(proc.pid) == []
    data = json.loads(out)
    assert "hsdp:sdp4bit" in format_table(data)
    rows = data["presets"]
    exact, quantized = rows["hsdp:fsdp"], rows["hsdp:sdp4bit"]
    assert exact["baseline"] == quantized["baseline"] == "hsdp:fsdp" and exact["speedup_vs_fsdp"] == 1.0
    assert len(quantized["step_times_s"]) == 2 and quantized["step_time_s"] > 0
    assert quantized["inter_bytes_per_step"] * 5 < exact["inter_bytes_per_step"]
    assert quantized["link_tx_bytes_per_run"] > 0


def test_hsdp_adds_each_presets_hsdp_row_after_the_presets_with_their_baseline_first():
    assert select_rows(["fsdp", "sdp4bit"], hsdp=True) == ["fsdp", "sdp4bit", "hsdp:fsdp", "hsdp:sdp4bit"]
    assert select_rows(["sdp4bit", "hsdp:zeropp"]) == ["sdp4bit", "hsdp:zeropp"]
    assert select_rows(["hsdp:zeropp", "qsdp"], hsdp=True) == ["hsdp:zeropp", "qsdp", "hsdp:fsdp", "hsdp:qsdp"]


def test_hsdp_rows_are_compared_with_the_exact_hsdp_route_and_the_others_with_fsdp():
    assert baseline_row("hsdp:sdp4bit") == baseline_row("hsdp:fsdp") == "hsdp:fsdp"
    assert baseline_row("sdp4bit") == baseline_row("fsdp") == "fsdp"


def test_a_bad_hsdp_row_is_refused_before_any_network_is_touched(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--presets", "fsdp", "hsdp:nope"])
    assert exc.value.code == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_an_hsdp_row_runs_the_training_job_with_hsdp_and_a_plain_row_the_workload(tmp_path):
    hsdp = _job_args("hsdp:sdp4bit", Job(), 3, str(tmp_path / "run"), str(tmp_path))
    assert hsdp[:4] == ["-m", "qsdp.cli", "train", "--hsdp"]
    for flag, value in (("--preset", "sdp4bit"), ("--local-world-size", "2"), ("--steps", "4"),
                        ("--device", "cpu"), ("--backend", "gloo")):
        assert hsdp[hsdp.index(flag) + 1] == value
    plain = _job_args("sdp4bit", Job(), 3, str(tmp_path / "r.json"), str(tmp_path))
    assert plain[:2] == ["-m", "qsdp.bench.workload"] and "--hsdp" not in plain


def test_a_cuda_job_runs_every_rank_on_the_gpu_in_bf16(tmp_path):
    job = Job(model="gpt2-125m", device="cuda", param_dtype="bfloat16")
    for row in ("sdp4bit", "hsdp:sdp4bit"):
        args = _job_args(row, job, 3, str(tmp_path / "r"), str(tmp_path))
        for flag, value in (("--device", "cuda"), ("--param-dtype", "bfloat16"), ("--model", "gpt2-125m")):
            assert args[args.index(flag) + 1] == value


def _train(rank, world, args):
    return train_worker(args)


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory, corpus):
    """``qsdp train --hsdp`` runs of 3 steps on 2 x 2 gloo ranks, as the HSDP rows launch them."""
    runs = {}
    for preset in ("fsdp", "sdp4bit"):
        out = tmp_path_factory.mktemp(f"hsdp-{preset}")
        args = TrainArgs(preset=preset, hsdp=True, local_world_size=2, out=str(out), data=corpus, steps=3,
                         batch_size=2, seq_len=32, eval_every=0, eval_batches=4, ckpt_every=0, progress=False,
                         cache_dir=str(tmp_path_factory.getbasetemp() / "qsdp-cache"))
        run_pooled(_train, 4, args, local_world_size=2, timeout=120)
        runs[preset] = train_result(str(out), warmup=1, steps=2)
    return runs


@pytest.mark.timeout(240)
def test_an_hsdp_rows_result_has_its_timed_steps_and_keeps_weights_inside_the_node(hsdp_runs):
    for run in hsdp_runs.values():
        assert run["hsdp"] is True and len(run["step_times_s"]) == 2 and run["step_time_s"] > 0
        assert run["stats"]["weights"]["inter"]["bytes"] == 0  # gathers stay inside the node
        assert run["stats"]["weights"]["intra"]["bytes"] > 0 and run["stats"]["grads"]["inter"]["bytes"] > 0
        assert run["tokens_per_step"] == 2 * 32 * 4


@pytest.mark.timeout(240)
def test_an_hsdp_rows_inter_node_gradients_shrink_with_4_bit_hsdp(hsdp_runs):
    exact, quantized = (hsdp_runs[p]["stats"]["grads"]["inter"]["bytes"] for p in ("fsdp", "sdp4bit"))
    assert 5 * quantized < exact  # 4.25 b/elt against 32


def _bf16_steps(rank, world):
    from qsdp.bench.workload import run_steps

    return run_steps("sdp4bit", 1, "tiny", seq_len=16, batch_size=2, ranks_per_node=1, param_dtype="bfloat16")


@pytest.mark.timeout(120)
def test_the_workload_trains_in_bf16_and_reports_its_size_dtype_and_kernels():
    res = run_pooled(_bf16_steps, 2, timeout=100)[0]
    assert res["param_dtype"] == "bfloat16" and res["device"] == "cpu" and res["codec_kernels"] == "torch"
    assert res["n_params"] > 0 and res["step_time_s"] > 0
    assert res["stats"]["weights"]["inter"]["bytes"] > 0


# --------------------------------------------------------------------------- the advisor in the sweep


def _sweep_result(step_times: dict[tuple[float, str], float]) -> dict:
    rows = []
    for (rate, preset), t in step_times.items():
        rows.append({"rate_mbit": rate, "preset": preset, "step_time_s": t, "tokens_per_s": 1024 / t,
                     "inter_bytes_per_step": 1e6, "speedup_vs_fsdp": step_times[rate, "fsdp"] / t})
    return {"nodes": 2, "ranks_per_node": 2, "model": "tiny", "seq_len": 64, "batch_size": 4,
            "param_dtype": "float32", "rows": rows}


def test_every_sweep_row_gets_the_models_prediction_its_error_and_the_advisors_pick():
    from qsdp.bench.cluster_advice import ModelInputs, predict_rows

    inputs = ModelInputs(compute_s=0.05, intra_gbps=1.0, latency_us=100.0,
                         kernels={"quantize": 0.5, "hadamard_quantize": 0.4, "dequantize": 1.0})
    result = _sweep_result({(20.0, "fsdp"): 5.0, (20.0, "sdp4bit"): 0.5, (0.0, "fsdp"): 0.1, (0.0, "sdp4bit"): 0.2})
    summary = predict_rows(result, inputs)
    rows = {(r["rate_mbit"], r["preset"]): r for r in result["rows"]}
    # fsdp sends its ~10 MB of fp32 weights and gradients per node and step over 20 Mbit/s: > 3 s.
    assert rows[20.0, "fsdp"]["predicted_step_s"] > 3.0 > rows[20.0, "sdp4bit"]["predicted_step_s"]
    assert rows[20.0, "fsdp"]["predicted_step_s"] > rows[0.0, "fsdp"]["predicted_step_s"]
    for r in rows.values():
        base = rows[r["rate_mbit"], "fsdp"]["predicted_step_s"]
        assert r["predicted_speedup"] == pytest.approx(base / r["predicted_step_s"])
        assert r["prediction_error"] == pytest.approx(r["predicted_speedup"] / r["speedup_vs_fsdp"] - 1)
        assert r["fastest_measured"] == ("sdp4bit" if r["rate_mbit"] == 20.0 else "fsdp")
    assert rows[20.0, "sdp4bit"]["advisor_pick"] == "sdp4bit"
    assert summary["picks"][0] == {"rate_mbit": 20.0, "pick": "sdp4bit", "fastest_measured": "sdp4bit",
                                   "pick_ok": True, "pick_slower_by": 0.0}
    errors = [abs(rows[rate, "sdp4bit"]["prediction_error"]) for rate in (20.0, 0.0)]
    assert summary["mean_abs_error"] == pytest.approx(sum(errors) / 2)
    assert result["advisor"] is summary and summary["inputs"]["latency_us"] == 100.0
    assert "advisor pick" in format_rates_table({**result, "device": "cpu", "topology": "veth pair", "steps": 1,
                                                 "unlimited_steps": 1, "warmup_steps": 1, "n_params": None})


@pytest.mark.slow  # 4 spawned ranks: about 40 s on a loaded 2-core machine
@pytest.mark.timeout(180)
def test_the_models_inputs_are_measured_by_as_many_ranks_as_the_emulation_has():
    from qsdp.bench.cluster_advice import CODEC_STEPS, measure_inputs
    from qsdp.bench.comm_calls import preset_calls
    from qsdp.perfmodel import CALLS

    inputs = measure_inputs(2, 2, model="tiny", seq_len=16, batch_size=2, gather_mb=0.5, codec_elements=1 << 14,
                            presets=("fsdp", "sdp4bit", "zeropp"))
    assert inputs.compute_s > 0 and inputs.intra_gbps > 0 and inputs.latency_us > 0
    assert set(inputs.kernels) == set(CODEC_STEPS) and all(v > 0 for v in inputs.kernels.values())
    # every comm step each preset runs, timed as the comm objects run it with its config
    assert set(inputs.call_us) == {"fsdp", "sdp4bit", "zeropp"} == set(inputs.call_ns_per_element)
    for preset, steps in inputs.call_us.items():
        assert tuple(steps) == preset_calls(preset, 2, 2) == tuple(inputs.call_ns_per_element[preset])
        assert all(v > 0 for v in steps.values())
    assert {name for steps in inputs.call_us.values() for name in steps} < set(CALLS)


def test_gloo_gathers_in_a_ring_and_reduce_scatters_by_a_ring_all_reduce():
    from qsdp.bench.cluster_advice import gloo_collectives
    from qsdp.perfmodel import step_collectives

    for preset in ("fsdp", "qsdp"):
        colls = step_collectives(preset, [4096, 8192], 2, 2, param_bytes=4, grad_bytes=4)
        algos = {(c.kind, c.algo) for c in gloo_collectives(colls)}
        if preset == "fsdp":
            assert algos == {("weights", "ring"), ("grads", "ring_allreduce")}
        else:  # the quantized reduce-scatter is an all-to-all of its own
            assert algos == {("weights", "ring"), ("grads", "a2a")}


def test_an_unshaped_link_costs_only_the_hosts_copy():
    from qsdp.bench.cluster_advice import ModelInputs, emulated_hardware

    inputs = ModelInputs(compute_s=0.05, intra_gbps=0.2, latency_us=1000.0, kernels={}, codec_call_us=300.0)
    hw = emulated_hardware(inputs, 0.0, 2)
    assert hw.host_staged and hw.codec_call_us == 300.0 and hw.inter_gbps == float("inf")
    assert emulated_hardware(inputs, 80.0, 2).inter_gbps == pytest.approx(80 / 8e3 * 1448 / 1514 / 2)


def test_the_advisor_prices_the_fsdp2_groups_of_the_bench_model():
    from qsdp.bench.cluster_advice import bench_shards
    from qsdp.perfmodel import step_bytes

    shards = bench_shards("tiny", 64, 4)
    # the root holds the untied embedding and head, the position table and the last norm
    assert shards == [(2 * 256 * 128 + 64 * 128 + 2 * 128) // 4] + [(12 * 128 * 128 + 13 * 128) // 4] * 4
    # FSDP2 keeps the root gathered from forward to backward: the meter's 10.1 MB per node and step
    b = step_bytes("fsdp", shards, 2, 2, gathers=[1] + [2] * 4, param_bytes=4, grad_bytes=4)
    assert 2 * (b["weights"]["inter"] + b["grads"]["inter"]) == 10108928


def test_each_comm_steps_cost_splits_into_fixed_and_per_element_as_the_model_counts_them():
    from qsdp.bench.comm_calls import LARGE_SHARD, SMALL_SHARD, fit_calls, preset_calls
    from qsdp.config import PRESETS
    from qsdp.perfmodel import step_collectives

    fixed_s, per_element_s = 3e-3, 20e-9
    times = {}
    for preset in PRESETS:
        times[preset] = {}
        for name in preset_calls(preset, 2, 2):
            times[preset][name] = []
            for n in (SMALL_SHARD, LARGE_SHARD):
                colls = [c for c in step_collectives(preset, [n], 2, 2, gathers=1, param_bytes=4, host_staged=True)
                         if c.call == name]
                times[preset][name].append(len(colls) * fixed_s + sum(c.elements for c in colls) * per_element_s)
    # the two-level reduce-scatter's 64K-element shard rounds in 4 slices, sent on gloo in one
    # exchange (pipeline_slices="auto"): 1 fixed cost, not 4
    assert times["sdp4bit"]["two_level_slice"][1] < 2 * fixed_s
    fixed, per_element = fit_calls(times, 2, 2, 4)
    for preset, steps in times.items():
        assert fixed[preset] == pytest.approx({name: 3000.0 for name in steps})
        assert per_element[preset] == pytest.approx({name: 0.0 if name == "agreement" else 20.0 for name in steps})


def test_the_probe_times_its_steps_in_rounds_that_call_each_once():
    from qsdp.bench.comm_calls import interleaved_median_seconds

    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    medians = interleaved_median_seconds(fns, torch.device("cpu"), repeats=3)
    assert calls == ["a", "b"] * 4  # a warm-up round, then 3 timed ones
    assert set(medians) == {"a", "b"} and all(t >= 0 for t in medians.values())


def test_each_preset_runs_the_comm_steps_of_its_modes():
    from qsdp.bench.comm_calls import preset_calls

    assert preset_calls("fsdp", 2, 2) == ("gather", "reduce_scatter")
    assert preset_calls("qsdp", 2, 2) == ("quantized_gather", "one_level_reduce_scatter")
    assert preset_calls("sdp4bit", 2, 2) == ("difference_update", "replica_fill", "agreement", "two_level_slice")
    assert preset_calls("zeropp", 2, 2) == ("quantized_gather", "two_level_slice")


def test_a_dearer_comm_step_slows_the_presets_that_run_it_once_per_collective():
    from qsdp.bench.cluster_advice import ModelInputs, bench_shards, predict_step_s
    from qsdp.config import resolve_config
    from qsdp.perfmodel import step_collectives

    shape = dict(nodes=2, ranks_per_node=2, model="tiny", seq_len=64, batch_size=4, param_dtype="float32")
    calls = {"fsdp": {"reduce_scatter": 1000.0}, "sdp4bit": {"two_level_slice": 1000.0},
             "zeropp": {"two_level_slice": 1000.0}}
    cheap = ModelInputs(compute_s=0.05, intra_gbps=0.3, latency_us=900.0, kernels={}, call_us=calls)
    dear = dataclasses.replace(cheap, call_us={**calls, "sdp4bit": {"two_level_slice": 2000.0}})
    shards = bench_shards("tiny", 64, 4)
    # the root's shard in one slice, each block's in three, each in an exchange of its own where
    # every slice reaches grads.pipeline_min_bytes (the tiny model's never reach the default 1 MiB)
    every_slice = resolve_config("sdp4bit", {"grads.pipeline_min_bytes": 1})
    assert sum(c.call == "two_level_slice" for c in step_collectives(every_slice, shards, 2, 2)) == 13
    assert sum(c.call == "two_level_slice" for c in step_collectives("sdp4bit", shards, 2, 2)) == 5
    # on gloo, pipeline_slices="auto" sends every group's slices in one exchange per hop
    slices = sum(c.call == "two_level_slice" for c in step_collectives("sdp4bit", shards, 2, 2, host_staged=True))
    assert slices == 5
    for rate in (0.0, 20.0):
        slower = predict_step_s("sdp4bit", dear, rate, **shape) - predict_step_s("sdp4bit", cheap, rate, **shape)
        if rate == 0.0:
            assert slower == pytest.approx(slices * 1e-3)
        else:  # the shaped link refills its bucket meanwhile: host work hides some of its wait
            assert 0.0 <= slower < slices * 1e-3
        # the same step measured with another preset's config prices that preset alone
        for other in ("fsdp", "zeropp"):
            assert predict_step_s(other, dear, rate, **shape) == predict_step_s(other, cheap, rate, **shape)


def test_the_tbf_shapers_bucket_is_shared_by_the_ranks_of_a_node():
    from qsdp.bench.cluster_advice import TCP_PAYLOAD_FRACTION, ModelInputs, emulated_hardware

    inputs = ModelInputs(compute_s=0.05, intra_gbps=0.2, latency_us=1000.0, kernels={})
    # 5 ms of tokens at 1 Gbit/s, at least 64 KiB below 105 Mbit/s; netem shapes without one
    assert emulated_hardware(inputs, 1000.0, 2).inter_burst_bytes == pytest.approx(625e3 * TCP_PAYLOAD_FRACTION / 2)
    assert emulated_hardware(inputs, 20.0, 2).inter_burst_bytes == pytest.approx(65536 * TCP_PAYLOAD_FRACTION / 2)
    assert emulated_hardware(inputs, 20.0, 2, qdisc="netem").inter_burst_bytes == 0.0
