"""Engine test helpers: Hugging Face `transformers` as the reference, and pool-usage checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from berth.engine import LLM
from berth.engine.models.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 (QKV bias) with untied embeddings and a sharded checkpoint."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_model(path, arch="qwen2", tie_word_embeddings=False, max_shard_size="60KB", seed=1)
    return path


@pytest.fixture(scope="module")
def llm(tiny_model: Path):
    """One in-process engine shared by a module; every test must leave its KV pool empty."""
    with LLM(tiny_model, executor="in-process", kv_cache_blocks=64, max_batch_size=16) as engine:
        yield engine


def kv_blocks_used(llm: LLM) -> int:
    """Blocks held right now (read from the engine itself, not a stats snapshot)."""
    return llm.executor.engine.kv_cache.pool.num_used


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (ending at EOS like ours) and raw log-probs per step."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.generation_config.pad_token_id,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)
    return tokens, logprobs
