"""`POST /v1/responses`: OpenAI's Responses API (what Codex-style clients speak), stateless, on
the chat path.

- The request becomes a chat completion's (`ChatCompletionRequest`): `instructions` a system
  message first, `input` (a string: one user message) its messages, `function_call` items an
  assistant turn's `tool_calls`, `function_call_output` items `role: "tool"` results; the flat
  Responses tools chat's `{"type": "function", "function": {...}}`, `text.format` its
  `response_format`, `max_output_tokens` its `max_completion_tokens`. It then runs through what
  chat runs (`tool_use`, `render`, `sampling_params`, `Generation`), in chat's order; every 400
  names the Responses parameter (`input[2].arguments`, `text.format`, `max_output_tokens`).
- The answer is a response object: a `reasoning` item with a reasoning model's thinking
  (`--reasoning-parser`, split as chat splits it), a `message` item with the text (no call
  markup) and a `function_call` item per call, read by the same parser as chat; `status`
  `incomplete` (`incomplete_details.reason` `max_output_tokens`) when the budget cut it.
  `reasoning` items in the input (earlier thinking sent back) are left out of the prompt.
- Streamed: OpenAI's named events, each with a `sequence_number`: `response.created`,
  `response.in_progress`, per item `response.output_item.added` ... `.done` (a message's
  `content_part` and `output_text` deltas, thinking's `reasoning_text`, a call's
  `function_call_arguments`), then `response.completed` (or `response.incomplete`) with the
  whole response.
- Stateless: `store` is accepted and nothing is stored; `previous_response_id`, `conversation`,
  `prompt` and `background` (which need stored responses), and what the engine does not do
  (`reasoning`, `include`, built-in tools, `truncation: auto`, `top_logprobs`, `max_tool_calls`,
  non-text input) are a 400 naming the parameter. `n` is 1.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError

from berth.engine.serve.auth import BEARER
from berth.engine.serve.chat import AnswerStream, answer_of, render
from berth.engine.serve.completions import STREAM_DOC
from berth.engine.serve.context import serving
from berth.engine.serve.disaggregated import engine_split
from berth.engine.serve.errors import APIError, bad_request, documented
from berth.engine.serve.generation import Generation, unless_disconnected
from berth.engine.serve.protocol import (
    ChatCompletionRequest,
    IncompleteDetails,
    ResponseFunctionCall,
    ResponseObject,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningText,
    ResponsesRequest,
    ResponseUsage,
    Usage,
)
from berth.engine.serve.reasoning import REASONING_PARSERS, ReasoningParser
from berth.engine.serve.sampling import admit, check_token_ids, resolve_max_tokens, sampling_params
from berth.engine.serve.streaming import named_sse_response
from berth.engine.serve.structured import structured_outputs
from berth.engine.serve.tool_calls import ToolUse, tool_calls, tool_use

router = APIRouter(dependencies=BEARER, responses=documented(400, 401, 404, 413, 503))

# The engine's names (Generation) for this API's parameters.
NAMES = {"prompt": "input", "max_tokens": "max_output_tokens"}
# Chat's parameters, in the errors of the pieces shared with chat, as this API names them.
CHAT_NAMES = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
OutputItem = ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionCall
STATELESS = "this server is stateless and stores no responses: send the whole conversation as input"


@router.post("/v1/responses", response_model=ResponseObject, responses=STREAM_DOC)
async def create_response(body: ResponsesRequest, request: Request):
    ctx = serving(request)
    with _responses_names():
        refuse_unsupported(body)
        chat = chat_request(body)
        admit(ctx, chat)
        # From here on, chat's order (chat.py's create_chat_completion).
        tokenizer = ctx.tokenizer
        use = tool_use(chat, getattr(tokenizer, "chat_template", None), ctx.tool_call_parser)
        # As chat: a grammar constrains the whole answer, so there is no thinking to split from it.
        constrained = (use is not None and use.choice != "auto") or structured_outputs(chat) is not None
        reasoner = (
            REASONING_PARSERS[ctx.reasoning_parser]() if ctx.reasoning_parser and not constrained else None
        )
        prompt = check_token_ids(ctx, await asyncio.to_thread(render, tokenizer, chat, use), "input")
        max_tokens = resolve_max_tokens(
            ctx, body.max_output_tokens, len(prompt), param="max_output_tokens", prompt_param="input"
        )
        constraint = use.constraint() if use is not None else None
        params = sampling_params(chat, max_tokens=max_tokens, logprobs=None, constraint=constraint)
        reply = ResponseObject(
            id=f"resp_{uuid.uuid4().hex}",
            status="in_progress",
            model=ctx.model_name,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls,
            temperature=body.temperature,
            top_p=body.top_p,
            text={"format": (body.text or {}).get("format") or {"type": "text"}},
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            user=body.user,
            metadata=body.metadata or {},
        )
        generation = Generation(
            ctx, [prompt], [params], names=NAMES, cache_salt=chat.cache_salt, tokenized_with=tokenizer,
            disaggregated=engine_split(ctx.role, chat, 1), correlation_id=request.headers.get("x-request-id"),
        )  # fmt: skip
    try:
        if body.stream:
            await unless_disconnected(request, generation.start())
            return named_sse_response(_events(reply, generation, use, reasoner), generation)
        [output] = await unless_disconnected(request, generation.final_outputs())
    except BaseException:
        generation.abort()
        raise
    seq = output.outputs[0]
    reasoning, parsed = answer_of(seq.text, use, reasoner)
    items: list[OutputItem] = []
    if reasoning:
        thought = ResponseReasoningText(text=reasoning)
        items.append(ResponseReasoningItem(id=_item_id("rs"), status="completed", content=[thought]))
    if parsed.content or not (parsed.calls or reasoning):
        text = ResponseOutputText(text=parsed.content or "")
        items.append(ResponseOutputMessage(id=_item_id("msg"), status="completed", content=[text]))
    items += [
        ResponseFunctionCall(
            id=_item_id("fc"), call_id=call.id, name=call.function.name, arguments=call.function.arguments
        )
        for call in tool_calls(parsed.calls)
    ]
    return _finished(reply, items, seq.finish_reason, Usage.of([prompt], [output]))


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 naming each parameter this stateless server cannot serve (never ignored)."""
    stateful = {
        "previous_response_id": body.previous_response_id is not None,
        "conversation": body.conversation is not None,
        "prompt": body.prompt is not None,  # a stored prompt template
        "background": body.background,  # a response to poll for later
    }
    for name, used in stateful.items():
        if used:
            raise bad_request(f"{name} is not supported: {STATELESS}", param=name)
    reasoning = {k: v for k, v in (body.reasoning or {}).items() if v is not None}
    if reasoning and reasoning != {"effort": "none"}:
        raise bad_request(
            f"reasoning cannot be set on this server (got {reasoning!r}): a reasoning model's thinking "
            "(--reasoning-parser) comes as a reasoning item, at the model's own effort",
            param="reasoning",
        )
    if body.include:
        raise bad_request(f"include {body.include[0]!r} is not supported by this server", param="include")
    if body.truncation == "auto":
        raise bad_request(
            'truncation "auto" is not supported: an input longer than the model allows is a 400',
            param="truncation",
        )
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses", param="top_logprobs")
    if body.max_tool_calls is not None:
        raise bad_request("max_tool_calls is not supported by this server", param="max_tool_calls")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request `body` asks for (n 1); 400s name the Responses field."""
    fields = {
        "model": body.model,
        "messages": _messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "stream": body.stream,
        "user": body.user,
        "tools": _chat_tools(body.tools),
        "tool_choice": _chat_tool_choice(body.tool_choice, body.tools),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "cache_salt": body.cache_salt,
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # not expected: every field was checked as the chat's is
        first = error.errors()[0]
        where = str(first["loc"][0]) if first.get("loc") else None
        raise bad_request(str(first.get("msg", error)), param=CHAT_NAMES.get(where, where)) from None


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    if not body.input:
        raise bad_request("input is empty: nothing to generate from", param="input")
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for index, item in enumerate(body.input):
        where = f"input[{index}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"a message's role must be one of {', '.join(ROLES)}", f"{where}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
            try:
                loaded = json.loads(arguments)
            except (ValueError, RecursionError) as error:  # RecursionError: nested past any use
                message = f"a function call's arguments are not JSON: {error}"
                raise bad_request(message, f"{where}.arguments") from None
            if not isinstance(loaded, dict):
                raise bad_request("a function call's arguments must be a JSON object", f"{where}.arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn: its text, its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue  # earlier thinking, which clients send back: templates leave it out of the prompt
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise bad_request(
                f"input items of type {kind!r} are not supported by this server: messages, "
                "function_call and function_call_output are",
                f"{where}.type",
            )
    return messages


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{item.get('type')} needs {key} as a string", f"{where}.{key}")
    return value


def _text(content: object, where: str) -> str:
    """A string, or text parts (`input_text` / `output_text`) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of input_text parts", where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"only text content (input_text / output_text parts with a text) is supported, got {kind!r}",
                f"{where}[{index}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's (which checks their names and schemas)."""
    if tools is None:
        return None
    chat_tools = []
    for index, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"tools of type {kind!r} are not supported by this server: only function tools "
                '({"type": "function", "name", "description", "parameters"})',
                f"tools[{index}].type",
            )
        if not isinstance(tool.get("name"), str):
            raise bad_request(
                'a function tool needs a "name" (Responses tools are flat: {"type": "function", '
                '"name", "description", "parameters"})',
                f"tools[{index}].name",
            )
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _chat_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None):
    if choice is None or isinstance(choice, str):
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": one of '
            f"the tools}}, got {choice!r}",
            param="tool_choice",
        )
    if tools and name not in [tool.get("name") for tool in tools]:
        raise bad_request(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (which checks that its schema compiles)."""
    if text is None:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity is not supported by this server", param="text.verbosity")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise bad_request(
                'text.format json_schema needs {"type": "json_schema", "name", "schema": {a JSON schema}}',
                param="text.format",
            )
        described = {key: spec[key] for key in ("name", "schema", "strict") if key in spec}
        return {"type": "json_schema", "json_schema": described}
    raise bad_request(
        f'text.format must be {{"type": "text" | "json_object" | "json_schema", ...}}, got {spec!r}',
        param="text.format",
    )


@contextmanager
def _responses_names() -> Iterator[None]:
    """Errors of the pieces shared with chat, naming this API's parameters instead of chat's."""
    try:
        yield
    except APIError as error:
        error.param = _responses_param(error.param)
        for chat, ours in CHAT_NAMES.items():
            if chat != "messages":  # a word, too, in many messages
                error.message = re.sub(rf"\b{chat}\b", ours, error.message)
        raise


def _responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for chat, ours in CHAT_NAMES.items():
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            return ours
    return re.sub(r"^(tools\[\d+\])\.function\b", r"\1", param)  # tools[0].function.parameters


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _finished(
    reply: ResponseObject,
    items: list[OutputItem],
    finish_reason: str | None,
    usage: Usage,
) -> ResponseObject:
    cut = finish_reason == "length"
    if cut and items and items[-1].type != "function_call":  # what was cut (a call cut short is dropped)
        items[-1].status = "incomplete"
    return reply.model_copy(
        update={
            "status": "completed" if finish_reason == "stop" else "incomplete",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
            "completed_at": int(time.time()) if finish_reason == "stop" else None,
            "output": items,
            "usage": ResponseUsage.of(usage),
        }
    )


class _Events:
    """Named events with a `sequence_number` counting from 0."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> tuple[str, str]:
        data = {"type": kind, "sequence_number": self.sequence}
        data |= {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in fields.items()}
        self.sequence += 1
        return kind, json.dumps(data, ensure_ascii=False)


async def _events(
    reply: ResponseObject, generation: Generation, use: ToolUse | None, reasoner: ReasoningParser | None
) -> AsyncIterator[tuple[str, str]]:
    event = _Events()
    yield event("response.created", response=reply)
    yield event("response.in_progress", response=reply)
    answer = AnswerStream(use, reasoner)  # chat's: thinking, then content and calls
    items: list[OutputItem] = []
    current: OutputItem | None = None  # the item being written (the last of `items`)
    latest, finish_reason = None, None

    def open_item(item: OutputItem) -> Iterator[tuple[str, str]]:
        nonlocal current
        yield from close()
        items.append(item)
        current = item
        yield event("response.output_item.added", output_index=len(items) - 1, item=item)
        if item.type == "message":
            item.content.append(ResponseOutputText(text=""))
            yield event(
                "response.content_part.added", item_id=item.id, output_index=len(items) - 1,
                content_index=0, part=item.content[0],
            )  # fmt: skip
        elif item.type == "reasoning":
            item.content.append(ResponseReasoningText(text=""))

    def close(status: str = "completed") -> Iterator[tuple[str, str]]:
        nonlocal current
        item, current, index = current, None, len(items) - 1
        if item is None:
            return
        at = {"item_id": item.id, "output_index": index}
        if item.type == "message":
            yield event(
                "response.output_text.done", **at, content_index=0, text=item.content[0].text, logprobs=[]
            )
            yield event("response.content_part.done", **at, content_index=0, part=item.content[0])
        elif item.type == "reasoning":
            yield event("response.reasoning_text.done", **at, content_index=0, text=item.content[0].text)
        else:
            yield event("response.function_call_arguments.done", **at, arguments=item.arguments)
        item.status = "completed" if item.type == "function_call" else status
        yield event("response.output_item.done", output_index=index, item=item)

    try:
        async for _, output in generation:
            latest, seq = output, output.outputs[0]
            if not (seq.text_diff or seq.finished):
                continue
            for delta in answer.feed(seq.text_diff, seq.finished):
                if delta.get("reasoning_content"):
                    if current is None or current.type != "reasoning":
                        for sent in open_item(ResponseReasoningItem(id=_item_id("rs"), status="in_progress")):
                            yield sent
                    current.content[0].text += delta["reasoning_content"]
                    yield event(
                        "response.reasoning_text.delta", item_id=current.id, output_index=len(items) - 1,
                        content_index=0, delta=delta["reasoning_content"],
                    )  # fmt: skip
                if delta.get("content"):
                    if current is None or current.type != "message":
                        for sent in open_item(
                            ResponseOutputMessage(id=_item_id("msg"), status="in_progress")
                        ):
                            yield sent
                    current.content[0].text += delta["content"]
                    yield event(
                        "response.output_text.delta", item_id=current.id, output_index=len(items) - 1,
                        content_index=0, delta=delta["content"], logprobs=[],
                    )  # fmt: skip
                for piece in delta.get("tool_calls") or []:
                    function = piece["function"]
                    if piece.get("id"):  # a call begins (ToolStream: its id and name, then its arguments)
                        call = ResponseFunctionCall(
                            id=_item_id("fc"), call_id=piece["id"], name=function["name"], arguments="",
                            status="in_progress",
                        )  # fmt: skip
                        for sent in open_item(call):
                            yield sent
                    if function.get("arguments") and current is not None and current.type == "function_call":
                        current.arguments += function["arguments"]
                        yield event(
                            "response.function_call_arguments.delta", item_id=current.id,
                            output_index=len(items) - 1, delta=function["arguments"],
                        )  # fmt: skip
            if seq.finished:
                finish_reason = seq.finish_reason
    except APIError as error:
        # The 200 is already sent: the error travels in the stream, as OpenAI's does.
        yield event("error", code=error.code, message=error.message, param=error.param)
        return
    if not items:  # an empty answer is still a message
        for item in open_item(ResponseOutputMessage(id=_item_id("msg"), status="in_progress")):
            yield item
    for item in close("incomplete" if finish_reason == "length" else "completed"):
        yield item
    final = _finished(reply, items, finish_reason, Usage.of(generation.prompt_token_ids, [latest]))
    yield event(
        "response.completed" if final.status == "completed" else "response.incomplete", response=final
    )
