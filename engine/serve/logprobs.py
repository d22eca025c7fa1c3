"""Log-probabilities in OpenAI's two shapes: the legacy completions one and the chat one."""

from __future__ import annotations

from berth.engine.outputs import CompletionOutput, Logprob
from berth.engine.serve.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def _steps(output: CompletionOutput, start: int) -> list[tuple[Logprob, list[Logprob]]]:
    """(sampled token, alternatives by rank) for each generated token from `start` on."""
    steps = []
    for token_id, entry in zip(output.token_ids[start:], (output.logprobs or [])[start:]):
        steps.append((entry[token_id], sorted(entry.values(), key=lambda lp: lp.rank)))
    return steps


def completion_logprobs(output: CompletionOutput, start: int, text_offset: int) -> CompletionLogprobs:
    """The tokens from `start` on; `text_offset` is where the first of them begins in the text."""
    result = CompletionLogprobs()
    for sampled, ranked in _steps(output, start):
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in ranked})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(output: CompletionOutput, start: int, top_logprobs: int) -> ChatLogprobs:
    content = []
    for sampled, ranked in _steps(output, start):
        top = [_top(lp) for lp in ranked if lp.rank <= top_logprobs][:top_logprobs]
        content.append(TokenLogprob(**_top(sampled).model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def _top(lp: Logprob) -> TopLogprob:
    token = lp.decoded_token or ""
    return TopLogprob(token=token, logprob=lp.logprob, bytes=list(token.encode("utf-8")))
