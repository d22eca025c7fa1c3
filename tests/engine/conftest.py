"""Engine test helpers: Hugging Face `transformers` as the reference, and pool-usage checks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from berth.engine import LLM


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


# Near-ties are the only excuse for a mismatch: both tokens in each other's top-5 and their
# log-probs within this much of each other (then the comparison stops: the futures diverge).
TIE_TOLERANCE = 1e-3
# First-token log-probs agree to float32 accumulation noise.
LOGPROB_TOLERANCE = 1e-4


def prompts_of_many_lengths(tokenizer, lengths=(1, 3, 7, 16, 17, 31, 45, 60, 9, 2)) -> list[list[int]]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "def", "add", "print"]
    return [
        tokenizer(" ".join(words[(i + j) % len(words)] for j in range(n)))["input_ids"][:n]
        for i, n in enumerate(lengths)
    ]


def check_against_reference(ours, theirs, hf_logprobs: torch.Tensor) -> None:
    for step, (mine, ref) in enumerate(zip(ours, theirs)):
        if mine == ref:
            continue
        row = hf_logprobs[step]
        top5 = row.topk(5).indices.tolist()
        assert mine in top5, f"step {step}: berth chose {mine}, not in transformers' top-5 {top5}"
        gap = abs(row[mine] - row[ref]).item()
        assert gap < TIE_TOLERANCE, f"step {step}: berth {mine} vs transformers {ref}, not a tie ({gap})"
        return
    assert len(ours) == len(theirs), f"berth made {len(ours)} tokens, transformers {len(theirs)}"


def poisoned_copy(model: Path, target: Path) -> Path:
    """A copy of `model` that loads (right names, shapes, dtypes) with one weight NaN: every
    forward gives logits that are not finite."""
    shutil.copytree(model, target)
    weights = load_file(target / "model.safetensors")
    name = next(key for key in weights if key.endswith("mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target
