"""The OpenAI request and response bodies the server speaks (the subset berth implements).

Names, defaults and ranges follow OpenAI's API reference; the extra sampling fields
(`top_k`, `ignore_eos`, `stop_token_ids`, ...) are vLLM's extensions, which OpenAI clients
send through `extra_body`. Unknown fields are ignored, as vLLM does, so clients written for
newer API versions still work. The constraints here are also the server's OpenAPI document,
which the fuzz tests generate requests from.

Every number is bounded to what the engine can represent (64-bit integers, 32-bit token ids),
and no string may hold a lone UTF-16 surrogate (JSON's `"\\ud800"` escape): it is not text,
and would fail wherever it is encoded (the tokenizer, an error message), so it is refused
here with a 400 that names the parameter.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from berth.engine.engine_io import DEFAULT_DRAIN_TIMEOUT, MAX_CACHE_SALT_BYTES
from berth.engine.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TOKEN_ID,
    MIN_REPETITION_PENALTY,
)

NonEmptyString = Annotated[str, Field(min_length=1)]
# Strict: JSON's true and false are not token ids (lax mode would read them as 1 and 0).
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID, strict=True)]
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # in a str, any surrogate is a lone one


def lone_surrogate_at(value: object, path: str = "") -> str | None:
    """Where in `value` (strings, and lists and dicts of them, keys included) a string holds a
    lone surrogate: "" for the value itself, "[2].content" or "[0] key" inside it; None if
    nowhere."""
    if isinstance(value, str):
        return path if _LONE_SURROGATE.search(value) else None
    if isinstance(value, list):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    elif isinstance(value, dict):
        items = ((f"{path}.{key}" if isinstance(key, str) else path, item) for key, item in value.items())
        for key in value:
            if lone_surrogate_at(key) is not None:
                return f"{path} key".lstrip()
    else:
        return None
    for where, item in items:
        found = lone_surrogate_at(item, where)
        if found is not None:
            return found
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _text_is_text(cls, value: object) -> object:
        where = lone_surrogate_at(value)
        if where is not None:
            place = f" (at {where.lstrip('.')})" if where else ""
            raise ValueError(f"holds a lone UTF-16 surrogate{place}, which is not text")
        return value


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (not only the last one).
    continuous_usage_stats: bool = False


class DisaggregatedParams(_Request):
    """Disaggregated prefill/decode (what a router sends): `context_only` runs the prompt and
    answers the first token with a `kv_handle`; `kv_handle` continues from one."""

    context_only: bool = False
    kv_handle: dict | None = None
    fallback: Literal["error", "local"] = "error"
    timeout: float = Field(30.0, gt=0, le=3600, description="seconds for the KV transfer")
    pin_seconds: float = Field(30.0, gt=0, le=3600, description="context-only: how long the KV waits")


class _SamplingFields(_Request):
    """What completions and chat completions share."""

    model: str | None = Field(None, description="the served model name; omitted: the one model served")
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    # torch seeds are 64-bit; a seed outside that range must be refused here, not in the engine.
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: NonEmptyString | list[NonEmptyString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, float] | None = Field(
        None,
        description="token id (a string of digits) -> a bias in [-100, 100] added to its logit; "
        f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens",
    )
    # vLLM's extensions.
    top_k: int = Field(0, ge=-1, le=INT64_MAX, description="0 or -1: no top-k filter")
    min_p: float = Field(
        0.0, ge=0, le=1, description="drop tokens below min_p times the likeliest's probability"
    )
    repetition_penalty: float = Field(
        1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, description="1.0: off"
    )
    min_tokens: int = Field(0, ge=0, le=INT64_MAX, description="no EOS or stop token id before this many")
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(
        None,
        description="prefix-cache reuse only among requests with the same salt (a tenant's secret); "
        f"at most {MAX_CACHE_SALT_BYTES} bytes in UTF-8",
    )
    disaggregated: DisaggregatedParams | None = None
    # Structured outputs (engine/serve/structured.py): OpenAI's response_format, or vLLM's fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmptyString | None = None
    guided_choice: list[NonEmptyString] | None = Field(None, min_length=1)
    guided_grammar: NonEmptyString | None = None


def _prompt_shape(value: object) -> str | None:
    """Which of the prompt's four shapes `value` has, so an error names what is wrong with it
    (not with the first shape tried): a list of anything else is read as token ids."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        first = value[0] if value else None
        return "texts" if isinstance(first, str) else "batches" if isinstance(first, list) else "ids"
    return None


PROMPT_SHAPES = ("text", "texts", "ids", "batches")
Prompt = Annotated[
    Annotated[NonEmptyString, Tag("text")]
    | Annotated[list[NonEmptyString], Field(min_length=1), Tag("texts")]
    | Annotated[list[TokenId], Field(min_length=1), Tag("ids")]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1), Tag("batches")],
    Discriminator(
        _prompt_shape,
        custom_error_type="prompt_shape",
        custom_error_message="a string, a list of strings, a list of token ids or a list of lists of them",
    ),
]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: Count | None = Field(16, description="null: up to the model's maximum length")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls ({"id", "type": "function", "function": {"name", "arguments"}}),
    # and the call a tool turn answers.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = Field(None, description="null: up to the model's length")
    max_tokens: Count | None = Field(None, description="deprecated by OpenAI: max_completion_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='variables for the chat template, e.g. {"enable_thinking": false}'
    )


class TokenizeRequest(_Request):
    """vLLM's `/tokenize`: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = Field(None, description="the served model name; omitted: the one model served")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = Field(
        True, description="a prompt's BOS and the like (messages: the template writes its own)"
    )
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = Field(None, description="the served model name; omitted: the one model served")
    tokens: list[TokenId]


# ---- responses ------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache held (not computed again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompts: list[list[int]], outputs: list) -> Usage:
        """Prompt tokens count once per prompt, whatever `n`; completion tokens of every choice.
        `outputs` may lack prompts not heard from yet (a stream's usage so far)."""
        prompt = sum(len(p) for p in prompts)
        completion = sum(len(seq.token_ids) for output in outputs for seq in output.outputs)
        cached = sum(output.num_cached_tokens or 0 for output in outputs)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_handle: dict | None = None  # a context-only request's


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # a reasoning model's thinking (`--reasoning-parser`)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_handle: dict | None = None  # a context-only request's


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # OpenAI sends only the keys that changed: {"role": ...} / {"content": ...} / {}
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "berth"
    root: str  # the model directory serving now (a wakeup may have swapped in another revision)
    revision: str | None = None  # the digest of that directory's checkpoint
    max_model_len: int


# ---- admin ---------------------------------------------------------------------------------------

# The longest drain a sleep may ask for: a day (a number past it is a typo, not a plan).
MAX_DRAIN_TIMEOUT = 86400.0


class _AdminRequest(_Request):
    model_config = ConfigDict(extra="forbid")  # a misspelt field must not silently mean its default


class SleepRequest(_AdminRequest):
    level: int = Field(
        1,
        ge=1,
        le=2,
        strict=True,  # JSON's true is not level 1
        description="1: free the KV cache (and move weights to host memory); 2: drop the weights too",
    )
    mode: Literal["drain", "abort"] = Field(
        "drain", description="drain: let requests in flight finish (up to `timeout`); abort: abort them now"
    )
    timeout: float = Field(
        DEFAULT_DRAIN_TIMEOUT,
        ge=0,
        le=MAX_DRAIN_TIMEOUT,
        allow_inf_nan=False,
        description="seconds a drain may take before what is left is aborted",
    )


class WakeupRequest(_AdminRequest):
    model: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="another revision of the model (a directory on the engine's machine) to load in place",
    )
    revision: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description=(
            "a name for the weights this wakeup loads from `model` (which it needs: the same "
            "directory re-reads it), reported as model_revision.label"
        ),
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- Responses API -------------------------------------------------------------------------------
# OpenAI's `POST /v1/responses`, stateless (engine/serve/responses.py): the request is translated
# into a chat completion's. Items, tools and `text` are objects of several shapes; responses.py
# reads them and answers a 400 naming the field (`input[2].call_id`) for what it cannot serve.


class ResponsesRequest(_Request):
    model: str | None = Field(None, description="the served model name; omitted: the one model served")
    input: str | list[dict[str, Any]] = Field(
        description="a user message's text, or a list of messages and function_call(_output) items"
    )
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: Count | None = Field(None, description="null: up to the model's length")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(
        None, description='function tools: {"type": "function", "name", "description", "parameters"}'
    )
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = Field(
        None, description='{"format": {"type": "text" | "json_object" | "json_schema", ...}}'
    )
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = Field(True, description="accepted; this server is stateless and stores nothing")
    # Refused with a 400 naming them when they ask for something (responses.py).
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool = False
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tool_calls: int | None = Field(None, ge=1, le=INT64_MAX)
    # vLLM's extensions, as on chat.
    top_k: int = Field(0, ge=-1, le=INT64_MAX, description="0 or -1: no top-k filter")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[ResponseOutputText] = Field(default_factory=list)


class ResponseFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text of an object
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(BaseModel):
    """A reasoning model's thinking (`--reasoning-parser`), as its text."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ResponseReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


ResponseOutputItem = Annotated[
    ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionCall, Discriminator("type")
]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        details = usage.prompt_tokens_details or PromptTokensDetails()
        return cls(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=details.cached_tokens),
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """OpenAI's response object (what `client.responses.create` returns)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete"]
    error: ErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[ResponseOutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
