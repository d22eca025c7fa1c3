"""Tool calling on chat completions, as OpenAI defines it, over the model's own call format
(`tool_parsers.py`).

- `tools` are checked (each a function with a name and a JSON-schema `parameters` that can
  constrain an output); `tool_choice` is `none`, `auto` (default with tools), `required`, or a
  named function; `parallel_tool_calls` allows several calls in one answer.
- The prompt: the tools go to the chat template (`tools=`), and earlier turns' calls and
  results with it. A template that does not render tools gets them in a system prompt, and
  earlier calls written in the format, so any model can be asked.
- `required` and a named function are forced by a grammar of the format whose arguments are
  each tool's schema: every call's arguments validate. `auto` lets the model choose; its answer
  is read for calls.
- The answer: calls become `message.tool_calls` (finish_reason `tool_calls`), the rest is
  `content`; no call markup is left in `content`. A call cut short (`max_tokens`) is dropped.
  Streamed, content flows as it comes (holding back what may begin a call), and each call is
  sent once complete: its index, id and name, then its arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from berth.engine.serve.errors import bad_request
from berth.engine.serve.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from berth.engine.serve.tool_parsers import PARSERS, Call, Parsed, Tool, ToolParser, parser_for_template
from berth.engine.structured_outputs import StructuredOutputs, grammar_problem

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class ToolUse:
    parser: ToolParser
    tools: list[Tool]
    choice: str  # "auto", "required", or the name of the one function to call
    parallel: bool
    renders_tools: bool  # the chat template renders `tools` itself

    def constraint(self) -> StructuredOutputs | None:
        """The grammar that forces a call (`required`, or a named function); None for `auto`."""
        if self.choice == "auto":
            return None
        if self.choice == "required":
            return StructuredOutputs(grammar=self.parser.grammar(self.tools, self.parallel))
        named = [tool for tool in self.tools if tool.name == self.choice]
        return StructuredOutputs(grammar=self.parser.grammar(named, False))  # one call of it, as OpenAI

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.renders_tools:
            return None
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in self.tools
        ]

    def answer(self, text: str) -> Parsed:
        return self.parser.extract(text)


def tool_use(body: ChatCompletionRequest, template: str | None, parser_name: str | None) -> ToolUse | None:
    """What `body` asks of tools (None: no tools, or `tool_choice` none); 400s name the field."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    tools = [_tool(entry, index) for index, entry in enumerate(body.tools)]
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct names", param="tools")
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise bad_request(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                f'{{"name": one of the tools}}}}, got {choice!r}',
                param="tool_choice",
            )
        choice = name
    if choice == "none":
        return None
    parser = PARSERS[parser_name]() if parser_name else parser_for_template(template)
    if choice != "auto":
        if not parser.constrainable:
            raise bad_request(
                f"tool_choice {choice!r} needs a call format a grammar can force; {parser.name} is not one",
                param="tool_choice",
            )
        if body.response_format is not None and body.response_format.get("type") != "text":
            raise bad_request(
                "tool_choice forces a call: it cannot be combined with response_format", "tool_choice"
            )
    renders = bool(template) and "tools" in template
    return ToolUse(parser, tools, choice, body.parallel_tool_calls, renders)


def _tool(entry: dict[str, Any], index: int) -> Tool:
    param = f"tools[{index}]"
    function = entry.get("function")
    if entry.get("type") != "function" or not isinstance(function, dict):
        raise bad_request('a tool must be {"type": "function", "function": {"name", ...}}', param=param)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_request(f"a function's name must be 1 to 64 letters, digits, _ or -, got {name!r}", param)
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(
            "a function's parameters must be a JSON schema", param=f"{param}.function.parameters"
        )
    problem = grammar_problem(StructuredOutputs(json=parameters))
    if problem is not None:
        raise bad_request(
            f"{name}'s parameters cannot constrain a call: {problem}", f"{param}.function.parameters"
        )
    description = function.get("description") or ""
    return Tool(name, parameters, description if isinstance(description, str) else "")


def template_messages(messages: Sequence[ChatMessage], use: ToolUse | None) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: earlier calls as `tool_calls` (arguments
    as objects, as templates expect them) where the template renders tools, written in the
    call format otherwise; with the tools described in a system prompt for such a template."""
    rendered = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        calls = [_call_of(call) for call in message.tool_calls or []]
        if calls and use is not None and not use.renders_tools:
            entry["content"] = "\n".join(filter(None, [entry["content"], use.parser.write(calls)]))
        elif calls:
            entry["tool_calls"] = [
                {
                    "id": c.get("id"),
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.loads(call.arguments)},
                }
                for c, call in zip(message.tool_calls or [], calls)
            ]
        rendered.append(entry)
    if use is not None and not use.renders_tools:
        described = use.parser.describe(use.tools)
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{described}"}
        else:
            rendered.insert(0, {"role": "system", "content": described})
    return rendered


def _call_of(entry: dict[str, Any]) -> Call:
    function = entry.get("function") if isinstance(entry, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("an assistant's tool_calls must be function calls with a name", "messages")
    arguments = function.get("arguments", "{}")
    try:
        loaded = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError as error:
        raise bad_request(f"a tool call's arguments are not JSON: {error}", "messages") from error
    if not isinstance(loaded, dict):
        raise bad_request("a tool call's arguments must be a JSON object", "messages")
    return Call(function["name"], json.dumps(loaded, ensure_ascii=False))


def tool_calls(calls: Sequence[Call]) -> list[ToolCall]:
    return [ToolCall(id=_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolStream:
    """One choice's streamed answer, split into content deltas and complete calls."""

    use: ToolUse
    text: str = ""
    sent: int = 0  # characters of `text` sent as content
    calls_sent: int = 0
    in_calls: bool = False  # the text from `sent` on is calls
    decided: bool = False  # whether the answer's start said if it is calls (leading formats)
    _ids: list[str] = field(default_factory=list)

    def feed(self, diff: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas `diff` gives (content and tool_calls), with the rest when `finished`."""
        self.text += diff
        parser = self.use.parser
        deltas: list[dict[str, Any]] = []
        if not self.decided and parser.leading:
            if not self.text.strip() and not finished:
                return deltas
            self.decided = True
            self.in_calls = parser.starts_calls(self.text)
        if not self.in_calls:
            found = [i for i in (self.text.find(m, self.sent) for m in parser.markers) if i >= 0]
            if found:
                deltas += self._content(self.text[self.sent : min(found)].rstrip())
                self.sent, self.in_calls = min(found), True
            else:
                # Held back: what may begin a marker, and trailing space (the content before a
                # call ends without it).
                end = len(self.text)
                if not finished:
                    end = len(self.text[: end - _held_back(self.text, parser.markers)].rstrip())
                end = max(end, self.sent)
                deltas += self._content(self.text[self.sent : end])
                self.sent = end
        if self.in_calls:
            parsed = parser.extract(self.text)
            for call in parsed.calls[self.calls_sent :]:
                index, call_id = self.calls_sent, _call_id()
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": call_id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
                self.calls_sent += 1
            # Not calls after all (the format reads the whole text as the answer): the rest is
            # content. A call cut short is dropped, as the whole answer drops it.
            if finished and not parsed.calls and parsed.content == self.text:
                deltas += self._content(self.text[self.sent :])
                self.sent = len(self.text)
        return deltas

    @staticmethod
    def _content(text: str) -> list[dict[str, Any]]:
        return [{"content": text}] if text else []


def _held_back(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of `text` may be the start of a marker."""
    return max((n for m in markers for n in range(1, len(m)) if text.endswith(m[:n])), default=0)
