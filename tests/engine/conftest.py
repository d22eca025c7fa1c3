"""Engine test helpers: Hugging Face `transformers` as the reference (`bench/parity_rules.py`), and
pool-usage checks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from berth.engine import LLM

# hf_greedy and prompts_of_many_lengths are the tests' too (imported from here).
from berth.engine.bench.parity_rules import exact_parity_problem, hf_greedy, prompts_of_many_lengths  # noqa: F401


@pytest.fixture(scope="module")
def llm(tiny_model: Path):
    """One in-process engine shared by a module; every test must leave its KV pool empty."""
    with LLM(tiny_model, executor="in-process", kv_cache_blocks=64, max_batch_size=16) as engine:
        yield engine


def kv_blocks_used(llm: LLM) -> int:
    """Blocks held right now (read from the engine itself, not a stats snapshot)."""
    return llm.executor.engine.kv_cache.pool.num_used


# First-token log-probs agree to float32 accumulation noise.
LOGPROB_TOLERANCE = 1e-4


def check_against_reference(ours, theirs, hf_logprobs: torch.Tensor) -> None:
    problem = exact_parity_problem(ours, theirs, hf_logprobs)
    assert problem is None, problem


def poisoned_copy(model: Path, target: Path) -> Path:
    """A copy of `model` that loads (right names, shapes, dtypes) with one weight NaN: every
    forward gives logits that are not finite."""
    shutil.copytree(model, target)
    weights = load_file(target / "model.safetensors")
    name = next(key for key in weights if key.endswith("mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target
