"""Greedy parity with Hugging Face `transformers`: the reference run, and the two rules the tests
and `make gpu-check` judge berth's tokens by.

- Same precision on both sides (float32): the tokens are equal. The one excuse is a near-tie:
  where the two choose differently, each token is in the other's top 5 and their
  log-probabilities differ by less than `TIE_TOLERANCE`; the comparison stops there, since the
  continuations part.
- Low precision (bfloat16, float16): the two round differently, so where their choices part,
  each side's token must be in the other's top 5 (vLLM's `check_logprobs_close`), and until
  then the chosen tokens' log-probabilities agree within `abs_logprob`.

Each rule returns what is wrong, or None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

TIE_TOLERANCE = 1e-3
TOP = 5


class Logprob(Protocol):
    logprob: float
    rank: int | None


def hf_greedy(model, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (ending at EOS like berth's) and its log-probs per step
    [steps, vocab], float32 on the CPU; on the model's device."""
    out = model.generate(
        torch.tensor([list(prompt_ids)], device=model.device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.generation_config.pad_token_id,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1).cpu()
    return tokens, logprobs


def prompts_of_many_lengths(tokenizer, lengths=(1, 3, 7, 16, 17, 31, 45, 60, 9, 2)) -> list[list[int]]:
    """Prompts of these token counts (one token up to several prefill chunks), from a few words."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "def", "add", "print"]
    return [
        tokenizer(" ".join(words[(i + j) % len(words)] for j in range(n)))["input_ids"][:n]
        for i, n in enumerate(lengths)
    ]


def exact_parity_problem(ours: Sequence[int], theirs: Sequence[int], hf_logprobs: torch.Tensor) -> str | None:
    for step, (mine, ref) in enumerate(zip(ours, theirs)):
        if mine == ref:
            continue
        row = hf_logprobs[step]
        top = row.topk(TOP).indices.tolist()
        if mine not in top:
            return f"step {step}: berth chose {mine}, not in transformers' top-{TOP} {top}"
        gap = abs(row[mine] - row[ref]).item()
        if gap >= TIE_TOLERANCE:
            return f"step {step}: berth {mine} vs transformers {ref}, not a tie ({gap:.2e})"
        return None
    if len(ours) != len(theirs):
        return f"berth made {len(ours)} tokens, transformers {len(theirs)}"
    return None


def close_parity_problem(
    ours: Sequence[int],
    our_logprobs: Sequence[Mapping[int, Logprob]],
    theirs: Sequence[int],
    hf_logprobs: torch.Tensor,
    abs_logprob: float = 0.15,
) -> str | None:
    """`our_logprobs[step]` maps token -> Logprob: berth's top 5 and the chosen token."""
    for step, (mine, ref) in enumerate(zip(ours, theirs)):
        our_top, their_row = our_logprobs[step], hf_logprobs[step]
        if mine != ref:
            their_top = their_row.topk(TOP).indices.tolist()
            if mine not in their_top:
                return f"step {step}: berth's {mine} is not in transformers' top {their_top}"
            ranked = sorted(our_top, key=lambda t: our_top[t].rank)[:TOP]
            if ref not in ranked:
                return f"step {step}: transformers' {ref} is not in berth's top {ranked}"
            return None  # the two continuations differ from here on
        gap = abs(our_top[mine].logprob - their_row[mine].item())
        if gap > abs_logprob:
            return f"step {step}: log-probability of {mine} differs by {gap:.3f} (> {abs_logprob})"
    if len(ours) != len(theirs):
        return f"berth made {len(ours)} tokens, transformers {len(theirs)}"
    return None
