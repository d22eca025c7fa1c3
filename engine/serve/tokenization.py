"""`POST /tokenize` and `POST /detokenize` (vLLM's shapes): the served model's tokenizer, for
clients that count tokens or build prompts of ids. Behind the API key, like `/v1`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from berth.engine.serve.auth import BEARER
from berth.engine.serve.chat import render as render_chat
from berth.engine.serve.context import serving
from berth.engine.serve.errors import bad_request, documented
from berth.engine.serve.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter(dependencies=BEARER, responses=documented(400, 401, 404))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """The token ids of `prompt`, or of `messages` as a chat completion would render them."""
    ctx = serving(request)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either a prompt or messages (one of them)", param="prompt")
    tokenizer = ctx.tokenizer
    if body.messages is not None:
        chat = ChatCompletionRequest(
            messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        tokens = await asyncio.to_thread(render_chat, tokenizer, chat)
    else:
        encoded = await asyncio.to_thread(tokenizer, body.prompt, add_special_tokens=body.add_special_tokens)
        tokens = encoded["input_ids"]
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=ctx.max_model_len,
        tokens=tokens,
        token_strs=tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ctx = serving(request)
    ctx.check_model(body.model)
    vocab_size = ctx.limits.vocab_size
    outside = [token for token in body.tokens if token >= vocab_size]
    if outside:
        raise bad_request(
            f"token id {outside[0]} is out of range for the vocabulary (size {vocab_size})", param="tokens"
        )
    return DetokenizeResponse(prompt=await asyncio.to_thread(ctx.tokenizer.decode, body.tokens))
