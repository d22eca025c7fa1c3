"""`POST /v1/completions`: one or more prompts (text or token ids), `n` choices each."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from berth.engine.outputs import CompletionOutput
from berth.engine.serve.auth import BEARER
from berth.engine.serve.context import serving
from berth.engine.serve.disaggregated import engine_split, kv_handle_of
from berth.engine.serve.errors import documented
from berth.engine.serve.generation import Generation, unless_disconnected
from berth.engine.serve.logprobs import completion_logprobs
from berth.engine.serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from berth.engine.serve.sampling import admit, check_token_ids, resolve_max_tokens, sampling_params
from berth.engine.serve.streaming import sse_response

router = APIRouter(dependencies=BEARER, responses=documented(400, 401, 404, 413, 503))

STREAM_DOC = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"}}


@router.post("/v1/completions", response_model=CompletionResponse, responses=STREAM_DOC)
async def create_completion(body: CompletionRequest, request: Request):
    ctx = serving(request)
    admit(ctx, body)
    # The one tokenizer this request is tokenized with (a wakeup may swap the model meanwhile).
    tokenizer = ctx.tokenizer
    # Tokenizing a long text takes long: off the event loop, so probes and streams go on.
    prompt_ids = await asyncio.to_thread(_prompt_token_ids, tokenizer, body.prompt)
    prompts = [check_token_ids(ctx, ids, "prompt") for ids in prompt_ids]
    params = [
        sampling_params(
            body,
            max_tokens=resolve_max_tokens(
                ctx, body.max_tokens, len(p), param="max_tokens", prompt_param="prompt"
            ),
            logprobs=body.logprobs,
        )
        for p in prompts
    ]
    tokenized = isinstance(body.prompt, str) or isinstance(body.prompt[0], str)
    echoes = await asyncio.to_thread(_echoes, tokenizer, body, prompts) if body.echo else [""] * len(prompts)
    generation = Generation(
        ctx,
        prompts,
        params,
        names={},
        cache_salt=body.cache_salt,
        tokenized_with=tokenizer if tokenized else None,
        disaggregated=engine_split(ctx.role, body, len(prompts)),
        correlation_id=request.headers.get("x-request-id"),
    )
    reply = CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=ctx.model_name, choices=[]
    )
    try:
        if body.stream:
            await unless_disconnected(request, generation.start())
            return sse_response(_chunks(body, generation, reply, echoes), generation, body.stream_options)
        outputs = await unless_disconnected(request, generation.final_outputs())
    except BaseException:
        generation.abort()
        raise
    reply.choices = [
        _choice(body, index, seq, echoes[index])
        for index, output in enumerate(outputs)
        for seq in output.outputs
    ]
    reply.usage = Usage.of(prompts, outputs)
    reply.kv_handle = kv_handle_of(outputs)
    return reply


def _prompt_token_ids(tokenizer, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer(prompt)["input_ids"]]
    if isinstance(prompt[0], str):
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt[0], int):
        return [prompt]
    return prompt


def _echoes(tokenizer, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """What `echo` puts before each prompt's choices: the prompt as the client wrote it, or
    its token ids decoded."""
    if isinstance(body.prompt, str):
        return [body.prompt]
    if isinstance(body.prompt[0], str):
        return list(body.prompt)
    return [tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in prompts]


def _choice(body: CompletionRequest, prompt_index: int, seq: CompletionOutput, echo: str) -> CompletionChoice:
    return CompletionChoice(
        index=prompt_index * body.n + seq.index,
        text=echo + seq.text,
        logprobs=completion_logprobs(seq, 0, 0) if body.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )


async def _chunks(
    body: CompletionRequest, generation: Generation, reply: CompletionResponse, echoes: list[str]
) -> AsyncIterator[CompletionResponse]:
    # choice index -> the text offset of its next token: where the last one's ends, as the
    # non-streamed answer counts them. Not the length of the text streamed so far: that holds
    # back a token ending inside a UTF-8 character, whose logprob entry is already out.
    logprob_offsets: dict[int, int] = {}
    done: set[int] = set()
    echoed: set[int] = set()  # the choices whose first chunk, echoing the prompt, is out
    async for prompt_index, output in generation:
        for seq in output.outputs:
            index = prompt_index * body.n + seq.index
            wants_logprobs = body.logprobs is not None and seq.token_ids_diff
            echo = echoes[prompt_index] if index not in echoed else ""
            if index in done or not (seq.text_diff or seq.finished or wants_logprobs or echo):
                continue
            echoed.add(index)
            logprobs = None
            if body.logprobs is not None:
                start = len(seq.token_ids) - len(seq.token_ids_diff)
                logprobs = completion_logprobs(seq, start, logprob_offsets.get(index, 0))
                if logprobs.tokens:
                    logprob_offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            if seq.finished:
                done.add(index)
            choice = CompletionChoice(
                index=index,
                text=echo + seq.text_diff,
                logprobs=logprobs,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            yield reply.model_copy(update={"choices": [choice]})
    if body.stream_options and body.stream_options.include_usage:
        yield reply.model_copy(update={"usage": generation.usage()})
