"""From an OpenAI request to the engine's inputs: checked prompt token ids and SamplingParams.

Everything a client can get wrong is refused here with a 400 that names the parameter, so no
bad input reaches the engine (where some could fail the whole engine, not one request).
"""

from __future__ import annotations

from berth.engine.sampling_params import SamplingParams
from berth.engine.serve.context import ServingContext
from berth.engine.serve.errors import bad_request
from berth.engine.serve.protocol import ChatCompletionRequest, CompletionRequest

# Below this temperature, softmax(logits / T) overflows to NaN: such requests are sampled
# greedily, which is what they ask for in effect (vLLM does the same).
GREEDY_TEMPERATURE = 1e-5


def admit(ctx: ServingContext, body: CompletionRequest | ChatCompletionRequest) -> None:
    """The checks every generation request passes before its prompt is even looked at."""
    ctx.check_model(body.model)
    ctx.check_admitting()
    check_supported(ctx, body)


def check_supported(ctx: ServingContext, body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuses the OpenAI parameters berth accepts in the schema but does not implement, and
    those the engine's configuration cannot serve."""
    if body.n > ctx.max_batch_size:  # the engine refuses it too, but cannot name the parameter
        raise bad_request(
            f"n={body.n} exceeds this server's max_batch_size={ctx.max_batch_size} "
            "(the n choices of a request run in one batch)",
            param="n",
        )
    unsupported = {
        "presence_penalty": body.presence_penalty != 0,
        "frequency_penalty": body.frequency_penalty != 0,
        "logit_bias": bool(body.logit_bias),
    }
    if isinstance(body, CompletionRequest):
        unsupported |= {
            "echo": body.echo,
            "suffix": body.suffix is not None,
            "best_of": body.best_of is not None and body.best_of != body.n,
        }
    else:
        unsupported |= {
            "tools": bool(body.tools),
            "response_format": bool(body.response_format) and body.response_format.get("type") != "text",
        }
    for name, used in unsupported.items():
        if used:
            raise bad_request(f"{name} is not supported by this server", param=name)
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")


def check_token_ids(ctx: ServingContext, token_ids: list[int], param: str) -> list[int]:
    if not token_ids:
        raise bad_request(f"{param} is empty: nothing to generate from", param=param)
    too_big = [t for t in token_ids if t >= ctx.vocab_size]
    if too_big:
        raise bad_request(
            f"{param} has token id {too_big[0]}, outside the vocabulary (size {ctx.vocab_size})", param=param
        )
    return token_ids


def resolve_max_tokens(
    ctx: ServingContext, requested: int | None, num_prompt: int, *, param: str, prompt_param: str
) -> int:
    """The output budget: `requested`, or all that the model's length leaves (None)."""
    limit = ctx.max_model_len
    if num_prompt >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, the prompt has "
            f"{num_prompt} tokens, which leaves no room for a completion. Please shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return limit - num_prompt
    if num_prompt + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} for the "
            f"completion). Please reduce the prompt or {param}.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest, *, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    temperature = 0.0 if body.temperature < GREEDY_TEMPERATURE else body.temperature
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
        )
    except ValueError as error:  # SamplingParams names the field first
        field = str(error).split(" ", 1)[0]
        raise bad_request(str(error), param=field) from error
