"""SmolLM2-135M-Instruct (a real checkpoint) through berth and through transformers.

float32: greedy tokens identical, for chat-templated and raw prompts, with prompts longer than
one prefill chunk. bfloat16 (and a bfloat16 KV cache under float32): the two sides round
differently, so where their greedy choices part, each side's token must be among the other's
top 5 (vLLM's `check_logprobs_close`), and up to there the chosen tokens' log-probabilities
must be close.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from berth.engine import LLM, SamplingParams
from berth.engine.bench.parity_rules import close_parity_problem
from tests.engine.conftest import hf_greedy, kv_blocks_used

MAX_NEW = 10
CHUNK = 48  # max_num_tokens: the long prompts need two or more prefill steps
TOP = 5
PARAGRAPH = (
    "Kubernetes is an open-source system for automating deployment, scaling, and management of "
    "containerized applications. It groups containers that make up an application into logical "
    "units for easy management and discovery. An operator extends it with custom resources and "
    "a controller that reconciles the state the user asked for with the state of the cluster."
)


def prompts(tokenizer) -> list[list[int]]:
    def chat(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    batch = [
        chat("What is the capital of France?"),
        chat(f"{PARAGRAPH}\nSummarize this in one sentence."),
        tokenizer("The three primary colors are")["input_ids"],
        tokenizer(PARAGRAPH + " In short,")["input_ids"],
    ]
    assert sum(len(p) > CHUNK for p in batch) >= 2, "some prompts must span several prefill chunks"
    return batch


def berth_greedy(
    model_dir, dtype: str, prompt_ids: list[list[int]], kv_cache_dtype: str = "auto", limits=None
):
    """Greedy completions with the top-5 logprobs; `limits` (a list) gets what the engine served."""
    with LLM(
        model_dir,
        executor="in-process",
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_num_tokens=CHUNK,
        max_batch_size=4,
        kv_cache_blocks=64,
    ) as llm:
        outputs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=TOP))
        assert kv_blocks_used(llm) == 0
        if limits is not None:
            limits.append(llm.limits)
    return [output.outputs[0] for output in outputs]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from berth.engine.tokenizer import load_tokenizer

    return load_tokenizer(smollm2)


def test_float32_greedy_tokens_equal_transformers(smollm2, tokenizer):
    batch = prompts(tokenizer)
    ours = berth_greedy(smollm2, "float32", batch)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for prompt, completion in zip(batch, ours):
        theirs, hf_logprobs = hf_greedy(hf, prompt, MAX_NEW)
        assert completion.token_ids == theirs, (
            f"prompt {tokenizer.decode(prompt)[-60:]!r}: berth {tokenizer.decode(completion.token_ids)!r} "
            f"vs transformers {tokenizer.decode(theirs)!r}"
        )
        for step, token in enumerate(completion.token_ids):
            assert completion.logprobs[step][token].logprob == pytest.approx(
                hf_logprobs[step, token].item(), abs=2e-3
            )
    assert "Paris" in tokenizer.decode(ours[0].token_ids)


def test_bfloat16_greedy_choices_within_each_others_top5(smollm2, tokenizer):
    batch = prompts(tokenizer)
    ours = berth_greedy(smollm2, "bfloat16", batch)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16).eval()
    for prompt, completion in zip(batch, ours):
        theirs, hf_logprobs = hf_greedy(hf, prompt, MAX_NEW)
        check_logprobs_close(completion, theirs, hf_logprobs)
    assert "Paris" in tokenizer.decode(ours[0].token_ids)


def test_bfloat16_kv_cache_on_a_float32_model_stays_close_to_float32_at_half_the_bytes(smollm2, tokenizer):
    """Keys and values stored in bfloat16 (the attention reads them in bfloat16), everything else
    in float32: close to transformers in float32 by the same rule, at half the KV bytes a token."""
    batch = prompts(tokenizer)
    limits = []
    ours = berth_greedy(smollm2, "float32", batch, kv_cache_dtype="bfloat16", limits=limits)
    (plan,) = [served.kv_cache for served in limits]
    # 30 layers x 3 KV heads x 64 dims, keys and values: 46,080 bytes a token in float32.
    assert (plan.dtype, plan.bytes_per_token) == ("bfloat16", 2 * 30 * 3 * 64 * 2)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for prompt, completion in zip(batch, ours):
        theirs, hf_logprobs = hf_greedy(hf, prompt, MAX_NEW)
        check_logprobs_close(completion, theirs, hf_logprobs, abs_logprob=0.05)
    assert "Paris" in tokenizer.decode(ours[0].token_ids)


def check_logprobs_close(
    completion, theirs: list[int], hf_logprobs: torch.Tensor, abs_logprob: float = 0.15
) -> None:
    problem = close_parity_problem(
        completion.token_ids, completion.logprobs, theirs, hf_logprobs, abs_logprob
    )
    assert problem is None, problem
