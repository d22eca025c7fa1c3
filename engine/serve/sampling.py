"""From an OpenAI request to the engine's inputs: checked prompt token ids and SamplingParams.

Everything a client can get wrong is refused here with a 400 that names the parameter. The
limits are the engine's own (`EngineLimits`, as it reported them), checked by the same rules
the engine applies again when the request arrives.
"""

from __future__ import annotations

import numpy as np

from berth.engine.engine_io import RequestError, check_cache_salt
from berth.engine.sampling_params import SamplingParams
from berth.engine.serve.context import ServingContext
from berth.engine.serve.errors import bad_request, from_engine_error
from berth.engine.serve.protocol import ChatCompletionRequest, CompletionRequest
from berth.engine.serve.structured import structured_outputs
from berth.engine.structured_outputs import StructuredOutputs


def admit(ctx: ServingContext, body: CompletionRequest | ChatCompletionRequest) -> None:
    """The checks every generation request passes before its prompt is even looked at."""
    ctx.check_model(body.model)
    ctx.check_admitting()
    check_supported(ctx, body)


def check_supported(ctx: ServingContext, body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuses the OpenAI parameters berth accepts in the schema but does not implement, and
    those the engine's limits cannot serve."""
    try:
        ctx.limits.check_n(body.n)  # the engine's own rule, here so the answer names `n`
        check_cache_salt(body.cache_salt)
    except RequestError as error:
        raise from_engine_error(error) from error
    except ValueError as error:
        raise bad_request(str(error), param="cache_salt") from error
    check_logit_bias(ctx, body.logit_bias)
    unsupported: dict[str, bool] = {}
    if isinstance(body, CompletionRequest):
        unsupported |= {
            # vLLM answers it with the prompt's own logprobs, which the engine does not compute.
            "echo": body.echo and body.logprobs is not None,
            "suffix": body.suffix is not None,
            "best_of": body.best_of is not None and body.best_of != body.n,
        }
    for name, used in unsupported.items():
        if used:
            what = "echo with logprobs is" if name == "echo" else f"{name} is"
            raise bad_request(f"{what} not supported by this server", param=name)
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")


def check_logit_bias(ctx: ServingContext, logit_bias: dict[str, float] | None) -> None:
    """Token ids past the model's vocabulary, by the engine's own rule (the rest of logit_bias,
    keys that are not ids included, SamplingParams checks)."""
    ids = [int(key) for key in logit_bias or () if key.isascii() and key.isdigit() and len(key) <= 10]
    try:
        ctx.limits.check_logit_bias(ids)
    except RequestError as error:
        raise from_engine_error(error) from error


def check_token_ids(ctx: ServingContext, token_ids: list[int], param: str) -> list[int]:
    if not token_ids:
        raise bad_request(f"{param} is empty: nothing to generate from", param=param)
    try:
        ctx.limits.check_prompt(np.asarray(token_ids, dtype=np.int64))
    except RequestError as error:
        raise from_engine_error(error, {"prompt": param}) from error
    return token_ids


def resolve_max_tokens(
    ctx: ServingContext, requested: int | None, num_prompt: int, *, param: str, prompt_param: str
) -> int:
    """The output budget: `requested`, or all that the model's length leaves (None); refused
    (by the engine's own rules, naming this API's parameters) when it cannot be served."""
    try:
        max_tokens = ctx.limits.output_budget(num_prompt, requested)
        ctx.limits.check_fits(num_prompt, max_tokens)
    except RequestError as error:
        raise from_engine_error(error, {"prompt": prompt_param, "max_tokens": param}) from error
    return max_tokens


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    constraint: StructuredOutputs | None = None,
) -> SamplingParams:
    """`constraint`: the grammar a forced tool call gives (tool_calls.py), in place of the
    request's own structured output, which cannot come with it."""
    asked = structured_outputs(body)
    if constraint is not None and asked is not None:
        raise bad_request(
            "tool_choice forces a call: it cannot be combined with a structured output", "tool_choice"
        )
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_p=body.min_p,
            min_tokens=body.min_tokens,
            logit_bias=body.logit_bias,
            structured_outputs=constraint or asked,
        )
    except ValueError as error:  # SamplingParams names the field first
        field = str(error).split(" ", 1)[0]
        raise bad_request(str(error), param=field) from error
