import os
import sys

import pytest
import torch

# Make tests/distributed.py importable as a plain module from every test file.
sys.path.insert(0, os.path.dirname(__file__))

# The test process forks its ranks (tests/distributed.py), and each rank sets one intra-op
# thread. A fork taken after this process had started an OpenMP pool hands the child the pool's
# state without its threads, which torch does not survive in every case (pytorch/pytorch#54752):
# one intra-op thread here too, so that no pool ever exists to be forked.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``QSDP_TEST_SHARD=i/n``: only every n-th collected test from the i-th (0-based), so a
    driver test can split a long pytest subprocess into parts that each fit the time budget
    (tests/test_triton_kernels.py's interpreter suite)."""
    shard = os.environ.get("QSDP_TEST_SHARD")
    if not shard:
        return
    index, count = (int(v) for v in shard.split("/"))
    items[:] = items[index::count]


def _session_cache(config) -> str:
    """The token cache of this test session (not the user's), under pytest's base temporary folder."""
    # config._tmp_path_factory: the factory behind the tmp_path_factory fixture, the only way to
    # its folder before any fixture runs (no public hook gives it before collection ends).
    return str(config._tmp_path_factory.getbasetemp() / "qsdp-cache")  # noqa: SLF001


def pytest_collection_finish(session):
    """Queue the subprocesses of the selected tests marked ``prestart`` (tests/prestarted.py), in
    the environment the tests will run in: the session's cache is set first, so that a queued
    command is the very command (environment included) its test builds."""
    from prestarted import PRESTARTED

    os.environ["QSDP_CACHE_DIR"] = _session_cache(session.config)
    commands = {}
    for item in session.items:
        marker = item.get_closest_marker("prestart")
        if marker is None:
            continue
        command = marker.args[0](**(item.callspec.params if hasattr(item, "callspec") else {}))
        if command is not None:
            commands[item.nodeid] = command
    PRESTARTED.start(commands)


def pytest_unconfigure(config):
    from prestarted import PRESTARTED

    PRESTARTED.stop()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """A 300 kB slice of the default corpus: the same kind of text, a fraction of the load time."""
    from qsdp.train.data import load_corpus

    path = tmp_path_factory.mktemp("data") / "chat.txt"
    path.write_text(load_corpus(None)[:300_000], encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> str:
    """A few lines repeated: enough text for a command line to accept, nothing to learn."""
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("hello there, how are you today?\nfine thanks.\n" * 400, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session", autouse=True)
def session_environment(tmp_path_factory):
    """Every test runs with the session's token cache (not the user's), and the server that
    local launches fork their workers from (qsdp.worker_start) starts here, in that environment:
    a test that changes the environment gets spawned workers, as a user's script would."""
    from qsdp.worker_start import start_method

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QSDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qsdp-cache"))
        if not os.environ.get("QSDP_TEST_SUBPROCESS"):  # a driver's part of the suite launches nothing
            start_method()
        yield


@pytest.fixture
def outside_torchrun(tmp_path_factory, monkeypatch):
    """The environment of a command typed at a shell: no torchrun variables (nor a stray
    LOCAL_WORLD_SIZE or fault injection), and the cache of the test session."""
    monkeypatch.setenv("QSDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qsdp-cache"))
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "QSDP_TEST_KILL_AT"):
        monkeypatch.delenv(var, raising=False)
