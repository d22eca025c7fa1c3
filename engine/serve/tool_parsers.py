"""Tool calls in each model family's own format: read out of the generated text, written back
into a prompt, and described as a grammar that makes a model call one (tool_choice `required`
or a named function).

- `hermes` (Qwen2.5, Qwen3, Hermes, SmolLM3): one block per call after any text,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- `llama3_json` (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}`, several
  joined by `; `, optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`, after any text.
- `pythonic` (Llama 3.2 / 4 pythonic templates, ...): the whole answer is a Python list of
  calls, `[get_weather(city="Paris"), ...]`, with literal arguments.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

# The JSON a call's arguments are constrained to: the layout the formats show (llguidance's
# options, as engine/structured_outputs.py uses them).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    description: str = ""


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text that is not a call (None when there is none)
    calls: list[Call]


class ToolParser:
    name: ClassVar[str]
    # Where a call can begin in the middle of the text (a stream holds back what may start one).
    markers: ClassVar[tuple[str, ...]] = ()
    # Formats whose answer is calls from its first character: what that character may be.
    leading: ClassVar[tuple[str, ...]] = ()
    # The formats a grammar can force (tool_choice `required` or named).
    constrainable: ClassVar[bool] = True

    def extract(self, text: str) -> Parsed:
        raise NotImplementedError

    def write(self, calls: Sequence[Call]) -> str:
        """Calls as this format writes them (an assistant turn of the prompt)."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) of one call (or several, when `parallel`)."""
        raise NotImplementedError

    def describe(self, tools: Sequence[Tool]) -> str:
        """A system prompt telling a model whose chat template does not render tools what it may
        call, and how to write a call in this format."""
        listed = "\n".join(json.dumps(_function(tool)) for tool in tools)
        example = self.write([Call("NAME", json.dumps({"ARGUMENT": "VALUE"}))])
        return (
            "You can call functions. Their signatures, one JSON object a line:\n"
            f"<tools>\n{listed}\n</tools>\n"
            f"To call one, answer with:\n{example}"
        )

    def starts_calls(self, text: str) -> bool:
        """Whether an answer beginning with `text` (stripped of leading space) is calls."""
        return bool(self.leading) and text.lstrip().startswith(self.leading)


def _function(tool: Tool) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description, "parameters": tool.parameters}


def _call_schema(tools: Sequence[Tool], arguments_key: str) -> dict[str, Any]:
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                arguments_key: tool.parameters or {"type": "object"},
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return {"x-guidance": JSON_LAYOUT, **(options[0] if len(options) == 1 else {"anyOf": options})}


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark one


def _load_call(data: object, arguments_key: str) -> Call | None:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get(arguments_key, data.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(data["name"], json.dumps(arguments, ensure_ascii=False))


def _content(text: str) -> str | None:
    return text.strip() or None


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN,)
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def extract(self, text: str) -> Parsed:
        start = text.find(self.OPEN)
        if start < 0:
            return Parsed(text, [])
        calls = []
        for body in self.BLOCK.findall(text, start):
            try:
                call = _load_call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return Parsed(text, [])  # not a call this format can read: the text stays the answer
            calls.append(call)
        return Parsed(_content(text[:start]), calls)

    def write(self, calls: Sequence[Call]) -> str:
        return "\n".join(
            f'{self.OPEN}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{self.CLOSE}'
            for c in calls
        )

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        call = (
            f"call: {_lark_string(self.OPEN + chr(10))} %json {json.dumps(_call_schema(tools, 'arguments'))} "
        )
        call += _lark_string("\n" + self.CLOSE)
        return ('start: call ("\\n" call)*\n' if parallel else "start: call\n") + call


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    leading = ("{", TAG)

    def extract(self, text: str) -> Parsed:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return Parsed(text, [])
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                data, at = decoder.raw_decode(body, at)
            except ValueError:
                return Parsed(text, [])
            call = _load_call(data, "parameters")
            if call is None:
                return Parsed(text, [])
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return Parsed(None, calls)

    def write(self, calls: Sequence[Call]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        call = f"call: %json {json.dumps(_call_schema(tools, 'parameters'))}"
        return ('start: call ("; " call)*\n' if parallel else "start: call\n") + call


class MistralParser(ToolParser):
    name = "mistral"
    MARK = "[TOOL_CALLS]"
    markers = (MARK,)

    def extract(self, text: str) -> Parsed:
        start = text.find(self.MARK)
        if start < 0:
            return Parsed(text, [])
        try:
            data, _ = json.JSONDecoder().raw_decode(text[start + len(self.MARK) :].lstrip())
        except ValueError:
            return Parsed(text, [])
        calls = [_load_call(item, "arguments") for item in (data if isinstance(data, list) else [data])]
        if not calls or None in calls:
            return Parsed(text, [])
        return Parsed(_content(text[:start]), calls)

    def write(self, calls: Sequence[Call]) -> str:
        listed = ", ".join(f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls)
        return f"{self.MARK}[{listed}]"

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        listed = {
            "x-guidance": JSON_LAYOUT,
            "type": "array",
            "items": _call_schema(tools, "arguments"),
            "minItems": 1,
            **({} if parallel else {"maxItems": 1}),
        }
        return f"start: {_lark_string(self.MARK)} %json {json.dumps(listed)}"


class PythonicParser(ToolParser):
    name = "pythonic"
    leading = ("[",)
    constrainable = False  # Python's call syntax is not JSON: no grammar here forces it

    def extract(self, text: str) -> Parsed:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            return Parsed(text, [])
        if not isinstance(tree, ast.List) or not tree.elts:
            return Parsed(text, [])
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return Parsed(text, [])
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
                calls.append(Call(node.func.id, json.dumps(arguments, ensure_ascii=False)))
            except (ValueError, TypeError):
                return Parsed(text, [])
        return Parsed(None, calls)

    def write(self, calls: Sequence[Call]) -> str:
        written = []
        for call in calls:
            arguments = ", ".join(f"{key}={value!r}" for key, value in json.loads(call.arguments).items())
            written.append(f"{call.name}({arguments})")
        return f"[{', '.join(written)}]"

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        raise ValueError("the pythonic format cannot be forced by a grammar")


PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def parser_for_template(template: str | None) -> ToolParser:
    """The format a chat template writes calls in (hermes when it says nothing of tools)."""
    template = template or ""
    if MistralParser.MARK in template:
        return MistralParser()
    if Llama3JsonParser.TAG in template or '"parameters": ' in template:
        return Llama3JsonParser()
    return HermesParser()
