"""The launch census (:mod:`qsdp.bench.census`): what one call of each collective dispatches on
the host stays within a fixed budget, whatever the rounding slices, the world or the number of
groups, without a host sync and without compiling a new kernel variant for a new seed; and the
wire bytes stay those of commit c14eb26 for fixed inputs and seeds.

The fused path (what a GPU runs) is counted under Triton's CPU interpreter, switched on before
triton is first imported: those tests run in a subprocess (``QSDP_CENSUS_TEST=interpret``),
driven by :func:`test_the_fused_path_under_the_triton_interpreter`. The wire bytes are checked
in both processes: the torch reference here, the fused kernels there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch
from prestarted import PRESTARTED, Command

from qsdp.bench.census import Case, run_case

INTERPRET = os.environ.get("QSDP_CENSUS_TEST") == "interpret"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpret_only = pytest.mark.skipif(not INTERPRET, reason="runs in the interpreter subprocess")

pytestmark = pytest.mark.timeout(300)

# sha256 of every collective call's sent buffers and result (Case: 2 calls, bf16 inputs), as
# commit c14eb26 computed them (the same with the torch reference and the fused kernels).
C14EB26_WIRE = {
    Case("qsdp", "reduce_scatter", shard=1000):
        "baa330e2b0a639404d486adf2fd82b6f29fd88d5b027e36985131551cef22faf",
    Case("qsdp", "gather_direct", shard=1000):
        "d733e4cac7cd395d7c8976e3d0a20c42aa623dca491fb08508e6b4785d80f4b0",
    Case("qsdp", "hsdp_all_reduce", shard=1000):
        "c54ef3697f30d00396beb499f719db543fccb2edd9a210dfc33dd6ad17150266",
    Case("sdp4bit", "gather_difference", shard=1000):
        "d608b2dd37b186bf80eb4a1f3e50f00ce5bee3a93aa5c4567bfce3265258823b",
    Case("sdp4bit", "hsdp_all_reduce", shard=1000):
        "c1ac837a440d4627436cd33d50e9ba9e74eaefb3ec720e4ee9df2203af1ea37d",
    Case("zeropp", "reduce_scatter", shard=1000):
        "f08442507e82d247d56394363371070771a57ad899151110150ba37d4b580735",
    Case("zeropp", "gather_direct", shard=1000):
        "04aacdaad8a89380bf4da549ab87efa97dc7e4e49725323ce6228dbfde4346ff",
    Case("sdp4bit", "reduce_scatter", shard=1000, slices=1, pipelined=True):
        "6eacf3fb29d365190fa9ce41e5fe1992042c6c19a1a6404fadb2e49fef730b34",
    Case("sdp4bit", "reduce_scatter", shard=1000, slices=2, rank=3, pipelined=True):
        "f608f37c55d5ad2d7f1c6131f99db010c7bffa5c62ab0de8f1a0386b2e82ae9e",
    Case("sdp4bit", "reduce_scatter", shard=1000, slices=8, rank=1, pipelined=True):
        "a3844f73994e43aeeb1c86e4e9c9920d40f16133f97b5c025b9886c7ba332f81",
    Case("sdp4bit", "reduce_scatter", shard=1000, slices=3, rank=2, pipelined=True):
        "b7d335b7af1fae29b88f54a539912bb7daa11ec74e2373da45f7f48455625813",
    Case("sdp4bit", "reduce_scatter", nodes=2, ranks_per_node=4, shard=777, slices=5, rank=6, pipelined=True):
        "633a2208a8d2b71b9bb3c1175847099e82bb5436ed1b62b9cf083395aff8fa65",
    Case("sdp4bit", "reduce_scatter", nodes=1, ranks_per_node=4, shard=1000, slices=8, rank=1, pipelined=True):
        "a6e67321a4498eabefb2f7a31bbe8e98fbb67539b635af905f5aaf8cad0a2fdd",
    Case("sdp4bit", "gather_difference", nodes=4, ranks_per_node=1, shard=1000):
        "a24d9b44b38d80b5183cf690ec0b599b42603a9ecb5c4a5c7675ddf7c89a2933",
    Case("sdp4bit", "reduce_scatter", shard=3000, slices=4, pipelined=True, dtype=torch.float32, rank=2):
        "ed244f7677305835e927b4dc71f1b9e993698ebe9b0c6128360151434c71ec77",
    Case("sdp4bit", "reduce_scatter", nodes=4, ranks_per_node=8, shard=640, slices=3, rank=13):
        "5557d14b3bd8de16fd44b74422bb1a7be53d5dab6367e435697439cc5b285dfa",
    Case("qsdp", "reduce_scatter", nodes=4, ranks_per_node=8, shard=640, rank=13):
        "06359672236c7f352e62044a7eea23503c02ee03eb422d58691a67d7729fd4b1",
    # whole chunks: the all-reduce encodes the shard where it is
    Case("qsdp", "hsdp_all_reduce", shard=4096):
        "914b18d59a24b1cea4069b7aacc4d64ba84db77ce60df941473c93ea20c386ce",
    Case("sdp4bit", "hsdp_all_reduce", shard=512):
        "0cf1a84eea2e3609d1af608e7c31a46950eeca23ffa2caa7ece29067c2cdaa06",
}


def _name(case: Case) -> str:
    pipelined = "-pipelined" if case.pipelined else ""
    return (f"{case.preset}-{case.collective}-{case.nodes}x{case.ranks_per_node}-shard{case.shard}-slices{case.slices}"
            f"{pipelined}-rank{case.rank}-{str(case.dtype).split('.')[-1]}")


def _heavy(case: Case) -> bool:
    """Slow in the interpreter (a program per tile, row and slice, run one by one)."""
    return case.nodes * case.ranks_per_node > 4 or case.shard > 1000 or (case.pipelined and case.slices > 3)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if INTERPRET and _heavy(c) else c
                                  for c in C14EB26_WIRE], ids=_name)
def test_the_wire_bytes_and_results_are_those_of_c14eb26(case):
    from qsdp.bench.census import fused_path

    assert fused_path() == INTERPRET
    row, _ = run_case(case)
    assert row["wire_sha256"] == C14EB26_WIRE[case]


def _interpreted_command(selection: str, tests: str | None = None) -> Command | None:
    """This file's tests of ``selection`` (and ``-k tests``) in a pytest subprocess under the
    interpreter (``None`` where the driver does not run)."""
    if INTERPRET or not HAVE_TRITON:
        return None
    return Command.pytest(__file__, "-m", selection, *(["-k", tests] if tests else []),
                          set_env={"QSDP_CENSUS_TEST": "interpret", "TRITON_INTERPRET": "1", "QSDP_TRITON_ON_CPU": "1"})


def _interpreted(request, selection: str, tests: str | None = None) -> None:
    rc, out = PRESTARTED.result(request.node.nodeid, _interpreted_command(selection, tests), timeout=280)
    assert rc == 0 and " passed" in out, out[-4000:]


@pytest.mark.skipif(INTERPRET, reason="the driver itself")
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install 'qsdp[gpu]')")
# In parts, each one process under the interpreter: the pinned bytes, the counts that must not
# grow, the rest of the counts. Each starts with the run, at low priority (tests/prestarted.py).
@pytest.mark.parametrize("tests", ["wire_bytes", "grow", "not wire_bytes and not grow"],
                         ids=["bytes", "growth", "counts"])
@pytest.mark.prestart(lambda tests: _interpreted_command("not slow", tests))
def test_the_fused_path_under_the_triton_interpreter(request, tests):
    _interpreted(request, "not slow", tests)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="the driver itself")
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install 'qsdp[gpu]')")
def test_the_fused_path_of_the_large_worlds_under_the_triton_interpreter(request):
    _interpreted(request, "slow")


def _counts(case: Case) -> dict[str, int]:
    row, _ = run_case(case)
    assert row["fused"]
    return {k: row[k] for k in ("torch", "triton", "collectives", "syncs")}


@interpret_only
def test_the_reduce_scatters_counts_do_not_grow_with_the_rounding_slices():
    rows = [run_case(Case("sdp4bit", "reduce_scatter", shard=4096, slices=k, calls=1))[0] for k in (1, 2, 8)]
    assert [row["slices"] for row in rows] == [1, 2, 8]
    counts = [{k: row[k] for k in ("torch", "triton", "collectives", "syncs")} for row in rows]
    assert counts[0] == counts[1] == counts[2]


@interpret_only
def test_the_counts_do_not_grow_with_the_world():
    for preset, collective in (("sdp4bit", "reduce_scatter"), ("qsdp", "reduce_scatter"), ("zeropp", "gather_direct"),
                               ("sdp4bit", "gather_difference"), ("sdp4bit", "hsdp_all_reduce")):
        small = _counts(Case(preset, collective, nodes=2, ranks_per_node=2, shard=256, calls=1))
        large = _counts(Case(preset, collective, nodes=4, ranks_per_node=8, shard=256, calls=1, rank=13))
        assert small == large, (preset, collective)


@interpret_only
def test_the_counts_per_call_do_not_grow_with_the_groups():
    for preset, collective in (("sdp4bit", "reduce_scatter"), ("sdp4bit", "gather_difference")):
        _, tallies = run_case(Case(preset, collective, shard=512, groups=3, calls=1))
        assert len({tuple(sorted(t.counts().items())) for t in tallies}) == 1, preset


@interpret_only
@pytest.mark.parametrize("preset,collective,most", [
    ("sdp4bit", "reduce_scatter", 15), ("zeropp", "reduce_scatter", 15), ("qsdp", "reduce_scatter", 15),
    ("qsdp", "gather_direct", 4), ("zeropp", "gather_direct", 4), ("sdp4bit", "gather_difference", 4),
    ("qsdp", "hsdp_all_reduce", 6), ("sdp4bit", "hsdp_all_reduce", 6), ("zeropp", "hsdp_all_reduce", 6),
])
def test_a_call_launches_at_most_its_budget(preset, collective, most):
    counts = _counts(Case(preset, collective, shard=2048, slices=8 if preset == "sdp4bit" else None, calls=1))
    assert counts["torch"] + counts["triton"] <= most, counts


@interpret_only
def test_a_node_replicas_fill_launches_nothing():
    # each replica row gathered straight into its node's block of FSDP2's buffer, in one grouped
    # gather with the differences' gather beside it: no temporary for a kernel to reorder
    _, tallies = run_case(Case("sdp4bit", "gather_difference", shard=512, calls=2))
    assert all(not t.torch and t.collectives == {"all_gather": 2} for t in tallies)


@interpret_only
def test_no_collective_reads_a_value_on_the_host():
    from qsdp.bench.census import default_cases
    import dataclasses

    for case in default_cases():
        if case.collective != "gather_difference_step":
            counts = _counts(dataclasses.replace(case, shard=512, calls=1))
            assert counts["syncs"] == 0, (case, counts)


def test_a_steps_difference_gathers_read_once_on_the_host_for_every_group():
    _, tallies = run_case(Case("sdp4bit", "gather_difference_step", shard=512, groups=3, calls=2))
    per_step = [tallies[:3], tallies[3:]]
    for step in per_step:
        assert [t.counts()["syncs"] for t in step] == [1, 0, 0]
        assert [sum(t.collectives.values()) for t in step] == [3, 2, 2]  # the agreement's all-reduce


@interpret_only
def test_fresh_seeds_compile_no_new_kernel_variant():
    import dataclasses

    from qsdp.codecs import triton_kernels as tk

    keys = []

    @contextlib.contextmanager
    def seen(kernel, grid, args, kwargs):
        keys.append(args[list(kernel.arg_names).index("key")])
        yield

    variants = set()
    tk.launch_observers.append(seen)
    try:
        for seed in range(4):
            for case in (Case("sdp4bit", "reduce_scatter", shard=512, slices=2, calls=1),
                         Case("qsdp", "gather_direct", shard=512, calls=1)):
                cfg = dataclasses.replace(case.config(), seed=seed)
                _, tallies = run_case(dataclasses.replace(case, preset=cfg, slices=None))
                variants |= {s for t in tallies for s in t.launch_signatures}
    finally:
        tk.launch_observers.remove(seen)
    # the keys the kernels derive their random streams from cross 2**31, as random 32-bit keys do
    unsigned = {k & 0xFFFFFFFF for k in keys}
    assert min(unsigned) < 2**31 <= max(unsigned)
    # ... and no call site compiles a variant of its own for either side
    without_key = {(name, tuple(a for a in sig if a[0] != "key")) for name, sig in variants}
    assert len(without_key) == len(variants)
    assert len({a for _, sig in variants for a in sig if a[0] == "key"}) == 1


@interpret_only
def test_the_host_floor_of_a_call_stands_beside_fsdp2s_own_collective():
    row, _ = run_case(Case("qsdp", "gather_direct", nodes=2, ranks_per_node=4, shard=512, calls=1, host=True))
    assert row["host_us"] > 0 and row["fsdp2_us"] > 0
    assert row["host_ratio"] == pytest.approx(row["host_us"] / row["fsdp2_us"], rel=0.05)
    assert 0 < row["qsdp_calls"] < row["py_calls"]


@interpret_only
def test_more_runs_of_the_host_floor_keep_each_figures_minimum():
    from qsdp.bench.census import keep_best_host_floors

    case = Case("qsdp", "gather_direct", nodes=2, ranks_per_node=4, shard=512, calls=1, host=True)
    row, _ = run_case(case)
    first = dict(row)
    keep_best_host_floors([case], [row], 3)
    assert row["host_us"] <= first["host_us"] and row["fsdp2_us"] <= first["fsdp2_us"]
    assert row["host_ratio"] == round(row["host_us"] / row["fsdp2_us"], 2)
    assert {k: v for k, v in row.items() if k not in ("host_us", "fsdp2_us", "host_ratio")} == {
        k: v for k, v in first.items() if k not in ("host_us", "fsdp2_us", "host_ratio")}


def test_the_census_refuses_fewer_than_one_run(capsys):
    from qsdp.bench.census import main

    with pytest.raises(SystemExit) as exit_:
        main(["--runs", "0"])
    assert exit_.value.code == 2 and "--runs must be at least 1" in capsys.readouterr().err


@interpret_only
def test_a_launch_that_does_nothing_is_what_the_host_floor_measures():
    from qsdp.bench.host_floor import launches_do_nothing
    from qsdp.codecs import triton_kernels as tk

    kernel = tk._quantize_kernel
    with launches_do_nothing() as names:
        assert {"_quantize_kernel", "_dequantize_kernel"} <= set(names)
        assert tk._quantize_kernel is not kernel and tk._quantize_kernel[(1,)](1, 2, X=3) is None
    assert tk._quantize_kernel is kernel


@interpret_only
def test_the_emulated_collectives_move_no_bytes_while_a_floor_is_timed():
    # a GPU host only enqueues a collective: its bytes are the device's work, like a kernel's
    from qsdp.bench.census import CensusGroup, emulated_world
    from qsdp.bench.host_floor import collectives_move_nothing
    from qsdp.comm.collectives import all_gather, all_gather_coalesced, all_to_all

    with emulated_world(1, 2) as topo:
        send, recv, gathered, grouped = torch.ones(2, 4), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 8)
        with collectives_move_nothing(CensusGroup):
            all_to_all(recv, send, topo.group)
            all_gather(gathered, send[0], topo.group)
            all_gather_coalesced(list(grouped), list(send), topo.group)
        assert not recv.any() and not gathered.any() and not grouped.any()
        all_to_all(recv, send, topo.group)
        all_gather(gathered, send[0], topo.group)
        all_gather_coalesced(list(grouped), list(send), topo.group)
        assert recv.eq(1).all() and gathered.eq(1).all() and grouped.eq(1).all()


@interpret_only
@pytest.mark.parametrize("preset", ["qsdp", "sdp4bit"])
def test_the_reduce_scatters_last_kernel_divides_casts_and_watches_for_nan(preset):
    import torch.distributed as dist

    from qsdp.bench.census import emulated_world
    from qsdp.comm.reduce_scatter import QuantizedReduceScatter

    cfg = Case(preset, "reduce_scatter").config()
    with emulated_world(2, 2) as topo:
        rs = QuantizedReduceScatter(cfg, topo, 0)
        grads, out = torch.randn(4 * 512).bfloat16(), torch.empty(512, dtype=torch.bfloat16)
        rs(out, grads, topo.group, dist.ReduceOp.AVG)
        assert next(iter(rs._plans.values())).direct
        assert not rs.take_nonfinite_flag().item()
        assert rs.take_nonfinite_flag() is None  # nothing reduced since
        grads[3] = float("nan")
        rs(out, grads, topo.group, dist.ReduceOp.AVG)
        rs(out, torch.randn(4 * 512).bfloat16(), topo.group, dist.ReduceOp.AVG)
        assert rs.take_nonfinite_flag().item()  # the NaN of an earlier call is kept until taken
        rs(out, torch.randn(4 * 512).bfloat16(), topo.group, dist.ReduceOp.AVG)
        assert not rs.take_nonfinite_flag().item()


@interpret_only
@pytest.mark.parametrize("preset,collective,most", [
    ("qsdp", "reduce_scatter", 24), ("sdp4bit", "reduce_scatter", 35), ("zeropp", "reduce_scatter", 35),
    ("qsdp", "gather_direct", 31), ("zeropp", "gather_direct", 31), ("sdp4bit", "gather_difference", 42),
    ("sdp4bit", "gather_difference_step", 48), ("qsdp", "hsdp_all_reduce", 34), ("sdp4bit", "hsdp_all_reduce", 34),
])
def test_a_steady_calls_python_stays_within_its_budget(preset, collective, most):
    # qsdp's own function calls a steady call makes (census-host-xeon.json): a count, not a time, so it holds on any
    # machine; every collective's plan is built once, and a steady call launches its first call's kernels again
    row, _ = run_case(Case(preset, collective, nodes=2, ranks_per_node=4, shard=6922, calls=1, host=True))
    assert row["qsdp_calls"] <= most, row


@interpret_only
@pytest.mark.parametrize("preset,collective", [
    ("qsdp", "reduce_scatter"), ("sdp4bit", "reduce_scatter"), ("qsdp", "gather_direct"),
    ("sdp4bit", "gather_difference"), ("sdp4bit", "hsdp_all_reduce"),
])
def test_a_steady_call_launches_the_kernels_of_its_first_call(preset, collective):
    # the first call derives its launches, the later ones launch them again with their own tensors: the same
    # kernels with arguments of the same types and alignments (no new compiled variant), fewer Python calls
    _, tallies = run_case(Case(preset, collective, shard=512, calls=3))
    signatures = [tuple(t.launch_signatures) for t in tallies]
    assert len(signatures) == 3 and signatures[0] and len(set(signatures)) == 1


def _switched_off_after_two_calls(preset: str, collective: str, monkeypatch) -> list[torch.Tensor]:
    """The third call's result of a comm whose kernels run twice, then are switched off
    (QSDP_DISABLE_TRITON=1), beside that of one whose kernels stay on; the launches of the third."""
    import torch.distributed as dist

    from qsdp.bench.census import counting, emulated_world
    from qsdp.comm import QuantizedAllGather, QuantizedReduceScatter
    from qsdp.comm.hsdp import ReplicaAllReduce

    cfg = Case(preset, collective).config()
    results, launched = [], []
    with emulated_world(2, 2) as topo:
        for switch in (False, True):
            torch.manual_seed(0)  # the same inputs for both
            if collective == "reduce_scatter":
                comm = QuantizedReduceScatter(cfg, topo, 0)
                grads, out = torch.randn(4 * 512).bfloat16(), torch.empty(512, dtype=torch.bfloat16)

                def call():
                    comm(out, grads, topo.group, dist.ReduceOp.AVG)
                    return out.clone()
            elif collective == "gather_direct":
                comm = QuantizedAllGather(cfg, topo, 0)
                flat = torch.randn(4 * 512).bfloat16()
                shard = flat.view(4, 512)[topo.rank]

                def call():
                    comm(flat, shard, topo.group)
                    return flat.clone()
            else:
                comm = ReplicaAllReduce(cfg, topo.group, 0)
                x = torch.randn(512)

                def call():
                    return comm(x).clone()
            call(), call()
            if switch:
                monkeypatch.setenv("QSDP_DISABLE_TRITON", "1")
            with counting() as tally:
                results.append(call())
            launched.append(sum(tally.triton.values()))
            monkeypatch.delenv("QSDP_DISABLE_TRITON", raising=False)
    return results, launched


@interpret_only
@pytest.mark.parametrize("preset,collective", [
    ("qsdp", "reduce_scatter"), ("sdp4bit", "reduce_scatter"), ("qsdp", "gather_direct"), ("qsdp", "hsdp_all_reduce"),
])
def test_kernels_switched_off_after_the_first_calls_give_the_same_result_by_the_reference(
        preset, collective, monkeypatch):
    (fused, reference), (launched, none) = _switched_off_after_two_calls(preset, collective, monkeypatch)
    assert launched > 0 and none == 0
    assert torch.equal(fused.view(torch.uint8), reference.view(torch.uint8))
