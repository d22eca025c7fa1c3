"""Greedy output equals Hugging Face `transformers` under continuous batching, chunked prefill
and preemption, for a Llama and a Qwen2 checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from berth.engine import LLM, SamplingParams
from tests.engine.conftest import (
    LOGPROB_TOLERANCE,
    check_against_reference,
    hf_greedy,
    kv_blocks_used,
    prompts_of_many_lengths,
)

MAX_NEW = 24


@pytest.mark.parametrize("checkpoint", ["tiny_model", "tiny_qwen2"])
def test_greedy_tokens_match_transformers_with_chunking_preemption_and_late_arrivals(checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # 12 blocks of 16 slots hold ~190 tokens: the 10 prompts need far more once they decode, so
    # the scheduler has to preempt; 16 tokens per step chops the long prompts into chunks.
    with LLM(
        path, executor="in-process", max_num_tokens=16, kv_cache_blocks=12, kv_block_size=16, max_batch_size=8
    ) as llm:
        prompts = prompts_of_many_lengths(llm.tokenizer)
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
        early = [llm.generate_async(p, params) for p in prompts[:4]]
        first = llm.generate_async(prompts[4], params, streaming=True)
        for update in first:  # the rest arrive while the first ones are decoding
            if len(update.outputs[0].token_ids) >= 3:
                break
        late = [llm.generate_async(p, params) for p in prompts[5:]]
        outputs = [r.result(timeout=120) for r in [*early, first, *late]]
        assert llm.executor.stats.num_preemptions >= 1, "the workload was meant to force a preemption"
        assert kv_blocks_used(llm) == 0

    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        theirs, hf_logprobs = hf_greedy(hf_model, prompt, MAX_NEW)
        check_against_reference(completion.token_ids, theirs, hf_logprobs)
        # The first generated tokens' log-probs (before any possible divergence).
        for step in range(3):
            token = completion.token_ids[step]
            ours = completion.logprobs[step][token].logprob
            assert ours == pytest.approx(hf_logprobs[step, token].item(), abs=LOGPROB_TOLERANCE)
            assert completion.logprobs[step][token].rank == 1


def test_token_id_prompts_and_text_prompts_agree(llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    text = "the lazy dog"
    by_text = llm.generate(text, params)[0]
    by_ids = llm.generate([llm.tokenizer(text)["input_ids"]], params)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
