import os
import sys

import pytest

# Make tests/distributed.py importable as a plain module from every test file.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """A 300 kB slice of the default corpus: the same kind of text, a fraction of the load time."""
    from qsdp.train.data import load_corpus

    path = tmp_path_factory.mktemp("data") / "chat.txt"
    path.write_text(load_corpus(None)[:300_000], encoding="utf-8")
    return str(path)
