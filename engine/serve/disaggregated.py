"""A server's part in disaggregated prefill and decode: its role, and the engine request type a
body's `disaggregated` field asks for.

`--role context` serves only context-only requests (a router's first half), `--role generation`
only requests that continue from a KV handle (its second half), `both` (the default) anything.
"""

from __future__ import annotations

from berth.engine.disaggregation import (
    ContextOnly,
    Disaggregated,
    GenerationOnly,
    handle_from_dict,
    handle_to_dict,
)
from berth.engine.outputs import RequestOutput
from berth.engine.serve.errors import bad_request
from berth.engine.serve.protocol import ChatCompletionRequest, CompletionRequest


def engine_split(
    role: str, body: CompletionRequest | ChatCompletionRequest, num_prompts: int
) -> Disaggregated | None:
    """The request type this body asks for, checked against the server's role (400 if it may not)."""
    split = body.disaggregated
    context_only = split is not None and split.context_only
    handle = split.kv_handle if split is not None else None
    if context_only and handle is not None:
        raise bad_request("disaggregated: context_only and kv_handle exclude each other", "disaggregated")
    if role == "context" and not context_only:
        raise bad_request(
            "this server runs the context part of disaggregated requests only (--role context): "
            "send requests through the router",
            "disaggregated",
            "wrong_role",
        )
    if role == "generation" and handle is None:
        raise bad_request(
            "this server continues disaggregated requests only (--role generation): send requests "
            "through the router",
            "disaggregated",
            "wrong_role",
        )
    if not (context_only or handle is not None):
        return None
    if num_prompts != 1:
        raise bad_request("a disaggregated request has one prompt", "prompt")
    if context_only:
        if body.stream:
            raise bad_request("a context-only request answers once: stream must be false", "stream")
        return ContextOnly(pin_seconds=split.pin_seconds)
    try:
        return GenerationOnly(handle_from_dict(handle), fallback=split.fallback, timeout=split.timeout)
    except ValueError as error:
        raise bad_request(f"disaggregated.kv_handle: {error}", "disaggregated") from None


def kv_handle_of(outputs: list[RequestOutput]) -> dict | None:
    handle = outputs[0].kv_handle if len(outputs) == 1 else None
    return handle_to_dict(handle) if handle is not None else None
