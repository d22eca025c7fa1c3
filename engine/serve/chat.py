"""`POST /v1/chat/completions`: messages rendered through the checkpoint's chat template."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from berth.engine.serve.auth import BEARER
from berth.engine.serve.completions import STREAM_DOC
from berth.engine.serve.context import serving
from berth.engine.serve.disaggregated import engine_split, kv_handle_of
from berth.engine.serve.errors import bad_request, documented
from berth.engine.serve.generation import Generation, unless_disconnected
from berth.engine.serve.logprobs import chat_logprobs
from berth.engine.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    Usage,
)
from berth.engine.serve.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream
from berth.engine.serve.sampling import admit, check_token_ids, resolve_max_tokens, sampling_params
from berth.engine.serve.streaming import sse_response
from berth.engine.serve.structured import structured_outputs
from berth.engine.serve.tool_calls import ToolStream, ToolUse, template_messages, tool_calls, tool_use
from berth.engine.serve.tool_parsers import Parsed

router = APIRouter(dependencies=BEARER, responses=documented(400, 401, 404, 413, 503))


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_DOC)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    ctx = serving(request)
    admit(ctx, body)
    # The one tokenizer (and template) this request is rendered with: a wakeup may swap them.
    tokenizer = ctx.tokenizer
    use = tool_use(body, getattr(tokenizer, "chat_template", None), ctx.tool_call_parser)
    # A grammar constrains the whole answer: there is no thinking to split from it.
    constrained = (use is not None and use.choice != "auto") or structured_outputs(body) is not None
    reasoner = REASONING_PARSERS[ctx.reasoning_parser]() if ctx.reasoning_parser and not constrained else None
    # Rendering and tokenizing a long chat takes long: off the event loop, so probes go on.
    prompt = check_token_ids(ctx, await asyncio.to_thread(render, tokenizer, body, use), "messages")
    budget_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(
        ctx, getattr(body, budget_param), len(prompt), param=budget_param, prompt_param="messages"
    )
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    constraint = use.constraint() if use is not None else None
    params = sampling_params(body, max_tokens=max_tokens, logprobs=top_logprobs, constraint=constraint)
    names = {"prompt": "messages", "max_tokens": budget_param}
    generation = Generation(
        ctx, [prompt], [params], names=names, cache_salt=body.cache_salt, tokenized_with=tokenizer,
        disaggregated=engine_split(ctx.role, body, 1), correlation_id=request.headers.get("x-request-id"),
    )  # fmt: skip
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    try:
        if body.stream:
            await unless_disconnected(request, generation.start())
            chunk = ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=[])
            chunks = _chunks(body, generation, chunk, use, reasoner)
            return sse_response(chunks, generation, body.stream_options)
        [output] = await unless_disconnected(request, generation.final_outputs())
    except BaseException:
        generation.abort()
        raise
    choices = []
    for seq in output.outputs:
        reasoning, parsed = answer_of(seq.text, use, reasoner)
        message = AssistantMessage(
            content=parsed.content, reasoning_content=reasoning, tool_calls=tool_calls(parsed.calls)
        )
        choices.append(
            ChatChoice(
                index=seq.index,
                message=message,
                logprobs=chat_logprobs(seq, 0, top_logprobs) if top_logprobs is not None else None,
                finish_reason=_finish_reason(seq.finish_reason, bool(parsed.calls)),
                stop_reason=seq.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=ctx.model_name,
        choices=choices,
        usage=Usage.of([prompt], [output]),
        kv_handle=kv_handle_of([output]),
    )


# What berth itself passes the template: a request's chat_template_kwargs may not replace them.
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "add_generation_prompt", "tokenize", "tools"})


def render(tokenizer, body: ChatCompletionRequest, use: ToolUse | None = None) -> list[int]:
    """The prompt's token ids: the messages through the checkpoint's chat template, with the
    request's `chat_template_kwargs` (e.g. `{"enable_thinking": false}`) as its variables, and
    its tools (`tool_calls.py`)."""
    messages = template_messages(body.messages, use)
    variables = body.chat_template_kwargs or {}
    if use is not None and use.renders_tools:
        variables = {**variables, "tools": use.template_tools()}
    reserved = sorted(TEMPLATE_ARGUMENTS & set(body.chat_template_kwargs or {}))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=False, **variables
        )
    except Exception as error:  # the template is the checkpoint's code; it may refuse these messages
        raise bad_request(
            f"the model's chat template cannot render these messages: {error}", "messages"
        ) from error
    # The template writes the special tokens it wants (BOS included): add none of our own.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def _chunks(
    body: ChatCompletionRequest,
    generation: Generation,
    chunk: ChatCompletionChunk,
    use: ToolUse | None,
    reasoner: ReasoningParser | None,
) -> AsyncIterator[ChatCompletionChunk]:
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    answers = {index: AnswerStream(use, reasoner) for index in range(body.n)}
    for index in range(body.n):  # OpenAI opens every choice with the role
        yield _with(chunk, ChatStreamChoice(index=index, delta={"role": "assistant", "content": ""}))
    latest = None
    done: set[int] = set()
    async for _, output in generation:
        latest = output
        for seq in output.outputs:
            wants_logprobs = top_logprobs is not None and seq.token_ids_diff
            if seq.index in done or not (seq.text_diff or seq.finished or wants_logprobs):
                continue
            if seq.finished:
                done.add(seq.index)
            start = len(seq.token_ids) - len(seq.token_ids_diff)
            logprobs = chat_logprobs(seq, start, top_logprobs) if top_logprobs is not None else None
            answer = answers[seq.index]
            deltas = answer.feed(seq.text_diff, seq.finished)
            for delta in deltas[:-1]:
                yield _with(chunk, ChatStreamChoice(index=seq.index, delta=delta))
            last = deltas[-1] if deltas else {}
            if not (last or seq.finished or logprobs):
                continue
            yield _with(
                chunk,
                ChatStreamChoice(
                    index=seq.index,
                    delta=last,
                    logprobs=logprobs,
                    finish_reason=_finish_reason(seq.finish_reason, answer.called),
                    stop_reason=seq.stop_reason,
                ),
            )
    if body.stream_options and body.stream_options.include_usage:
        yield chunk.model_copy(update={"usage": Usage.of(generation.prompt_token_ids, [latest])})


class AnswerStream:
    """One choice's streamed text as deltas: thinking (`reasoning_content`), then content and
    tool calls, each as soon as it is known."""

    def __init__(self, use: ToolUse | None, reasoner: ReasoningParser | None) -> None:
        self._tools = ToolStream(use) if use is not None else None
        self._reasoning = ReasoningStream(reasoner) if reasoner is not None else None

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.calls_sent > 0

    def feed(self, diff: str, finished: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if self._reasoning is not None:
            thought, diff = self._reasoning.feed(diff, finished)
            deltas += [{"reasoning_content": thought}] if thought else []
        if self._tools is not None:
            return deltas + self._tools.feed(diff, finished)
        return deltas + ([{"content": diff}] if diff else [])


def answer_of(text: str, use: ToolUse | None, reasoner: ReasoningParser | None) -> tuple[str | None, Parsed]:
    """A whole answer's thinking, and its content and calls."""
    reasoning, content = reasoner.split(text) if reasoner is not None else (None, text)
    if use is None:
        return reasoning, Parsed(content, [])
    return reasoning, use.answer(content or "")


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` for an answer that ended with calls."""
    return "tool_calls" if called and reason == "stop" else reason


def _with(chunk: ChatCompletionChunk, choice: ChatStreamChoice) -> ChatCompletionChunk:
    return chunk.model_copy(update={"choices": [choice]})
