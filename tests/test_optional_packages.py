"""The library without its extras: ``pip install qsdp`` brings torch, numpy and xxhash only.

Each check runs a fresh Python (run ahead of its test) in which the packages of ``qsdp[train]``
are not there: its path finder (the one that finds installed packages) answers for them what it
answers for a package that is not installed, so ``importlib.util.find_spec`` gives ``None`` and ``import`` raises
``ModuleNotFoundError``. The core imports and quantizes, ``qsdp train`` on a text file trains,
and each command that needs a missing package stops with one line naming the extra.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from prestarted import PRESTARTED, Command
from qsdp.extras import EXTRA_OF

TRAIN_PACKAGES = sorted(m for m, (_, extra) in EXTRA_OF.items() if extra == "train")

BLOCK = textwrap.dedent(f"""
    import importlib.machinery
    import sys

    BLOCKED = {TRAIN_PACKAGES!r}
    _path_find_spec = importlib.machinery.PathFinder.find_spec

    def _find_spec(name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None  # what the path finder says of a package that is not installed
        return _path_find_spec(name, path, target)

    importlib.machinery.PathFinder.find_spec = staticmethod(_find_spec)
""")


# Each check runs from a folder of its own, with a token cache of its own, as a user's fresh
# shell would; the three run ahead of their tests (tests/prestarted.py): a fresh interpreter's
# imports each.
_IN_A_FOLDER = textwrap.dedent("""
    import atexit, os, shutil, tempfile
    os.chdir(tempfile.mkdtemp(prefix="qsdp-no-extras-"))
    atexit.register(shutil.rmtree, os.getcwd(), True)
    os.environ["QSDP_CACHE_DIR"] = os.path.join(os.getcwd(), "cache")
""")


def _without_extras(body: str) -> Command:
    """``body`` after the blocker in a fresh interpreter, outside any torchrun; it prints one JSON line last."""
    return Command.python("-c", BLOCK + _IN_A_FOLDER + textwrap.dedent(body), cwd=os.path.dirname(__file__),
                          drop_env=("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                                    "MASTER_PORT"))


def _result(request, command: Command, timeout: float = 200) -> dict:
    rc, printed = PRESTARTED.result(request.node.nodeid, command, timeout=timeout)
    assert rc == 0, printed[-6000:]
    return json.loads(printed.strip().splitlines()[-1])


IMPORTS = _without_extras("""
    import json
    import torch
    import qsdp
    import qsdp.cli  # the command line itself loads without them
    from qsdp.codecs import dequantize, quantize
    from qsdp.comm.wire import RowCodec

    x = torch.randn(1000)
    q = quantize(x, bits=4, group_size=128, symmetric=True, rounding="stochastic", seed=1)
    err = (dequantize(q) - x).abs().max().item()
    buf = RowCodec(bits=8, group_size=64).encode(x.view(2, 500), seed=2)
    print(json.dumps({"presets": sorted(qsdp.PRESETS), "quantize_comms": callable(qsdp.quantize_comms),
                      "err": err, "rows": list(buf.shape),
                      "loaded": sorted(m for m in BLOCKED if m in sys.modules)}))
""")


@pytest.mark.timeout(120)
@pytest.mark.prestart(lambda: IMPORTS)
def test_the_library_imports_and_quantizes_without_the_train_packages(request):
    got = _result(request, IMPORTS, timeout=110)
    assert {"fsdp", "qsdp", "sdp4bit", "zeropp"} <= set(got["presets"]) and got["quantize_comms"]
    assert 0 < got["err"] < 1 and got["rows"][0] == 2 and got["loaded"] == []


COMMANDS = _without_extras("""
    import contextlib, io, json
    from qsdp.cli import main
    from qsdp.train.data import sample_corpus_path

    sample = sample_corpus_path()
    cases = {
        "train": ["train", "--steps", "1", "--out", "a"],
        "progress": ["train", "--data", sample, "--steps", "1", "--out", "b"],
        "bpe": ["train", "--data", sample, "--tokenizer", "bpe", "--no-progress", "--out", "c"],
        "demo": ["demo", "--out", "d"],
        "plot": ["plot", "e"],
    }
    results = {}
    for name, argv in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = main(argv)
        results[name] = [rc, err.getvalue()]
    results["wrote"] = os.path.exists("a")
    print(json.dumps(results))
""")


@pytest.mark.timeout(200)
@pytest.mark.prestart(lambda: COMMANDS)
def test_commands_that_need_a_missing_package_exit_with_one_line_naming_the_extra(request):
    got = _result(request, COMMANDS)
    needs = {"train": ("the default corpus", "chitchat-dataset", "--data FILE.txt"),
             "progress": ("the progress bar", "tqdm", "--no-progress"),
             "bpe": ("--tokenizer bpe", "tokenizers", "--tokenizer byte"),
             "demo": ("drawing the demo's loss curves", "matplotlib", ""),
             "plot": ("plotting loss curves", "matplotlib", "")}
    for name, (what, package, alternative) in needs.items():
        rc, err = got[name]
        assert rc == 2 and err.count("\n") == 1, (name, rc, err)
        assert err.startswith(f"qsdp: error: {what} needs the Python package {package}: pip install 'qsdp[train]'")
        assert alternative in err, (name, err)
    assert not got["wrote"]  # stopped before anything was written


TRAIN = _without_extras("""
    import json, socket
    with socket.socket() as s:  # a free port for the one-rank world
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from qsdp.cli import main
    from qsdp.train.data import sample_corpus_path
    from qsdp.train.metrics import read_summary

    rc = main(["train", "--preset", "sdp4bit", "--data", sample_corpus_path(), "--no-progress",
               "--model", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
               "--eval-batches", "1", "--ckpt-every", "0", "--device", "cpu", "--out", "run"])
    summary = read_summary("run")
    print(json.dumps({"rc": rc, "steps": summary["steps"], "loss": summary["final_val_loss"],
                      "codec_kernels": summary["codec_kernels"],
                      "loaded": sorted(m for m in BLOCKED if m in sys.modules)}))
""")


@pytest.mark.timeout(200)
@pytest.mark.prestart(lambda: TRAIN)
def test_train_on_the_sample_text_needs_none_of_them(request):
    got = _result(request, TRAIN)
    assert got["rc"] == 0 and got["steps"] == 2 and got["loss"] > 0 and got["loaded"] == []
    assert got["codec_kernels"] == "none"  # one rank: nothing travels, so nothing was quantized
