"""Fixtures shared by every test folder: tiny checkpoints, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from berth.engine.models.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama with tied embeddings and a trained BPE tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(path, seed=0)
    return path
