"""Each tool-call format read, written and forced: what a format writes it reads back; its
grammar accepts what it writes (and forces arguments that validate); a streamed answer splits
into the same content and calls as the whole answer, whatever the chunking."""

from __future__ import annotations

import json

import pytest

from berth.engine.serve.protocol import ChatCompletionRequest
from berth.engine.serve.tool_calls import ToolStream, tool_use
from berth.engine.serve.tool_parsers import PARSERS, Call, Tool, parser_for_template
from berth.engine.structured_outputs import Grammars, StructuredOutputs

WEATHER = Tool(
    "get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
)
TIME = Tool("get_time", {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}})
HERMES_OSLO = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
MISTRAL_CET = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]'
CALLS = [Call("get_weather", json.dumps({"city": "Paris"})), Call("get_time", json.dumps({"zone": "UTC"}))]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_what_a_format_writes_it_reads_back(name) -> None:
    parser = PARSERS[name]()
    for calls in (CALLS[:1], CALLS):
        parsed = parser.extract(parser.write(calls))
        assert parsed.calls == calls and parsed.content is None


@pytest.mark.parametrize(
    ("name", "text", "content", "names"),
    [
        ("hermes", f"Let me look.\n{HERMES_OSLO}", "Let me look.", ["get_weather"]),
        ("hermes", "No call here.", "No call here.", []),
        ("hermes", 'Cut <tool_call>\n{"name": "get_wea', "Cut", []),  # cut short: the call is dropped
        ("hermes", '<tool_call>\n{"oops": 1}\n</tool_call>', '<tool_call>\n{"oops": 1}\n</tool_call>', []),
        ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
         '"parameters": {"city": "Rome"}}', None, ["get_time", "get_weather"]),
        ("llama3_json", "{not json at all", "{not json at all", []),
        ("mistral", f"Sure {MISTRAL_CET}", "Sure", ["get_time"]),
        ("pythonic", "[get_weather(city='Lima'), get_time()]", None, ["get_weather", "get_time"]),
        ("pythonic", "[not_a_call]", "[not_a_call]", []),
    ],
)  # fmt: skip
def test_answers_split_into_content_and_calls(name, text, content, names) -> None:
    parsed = PARSERS[name]().extract(text)
    assert parsed.content == content
    assert [call.name for call in parsed.calls] == names
    assert all(isinstance(json.loads(call.arguments), dict) for call in parsed.calls)


@pytest.mark.parametrize("name", [n for n in sorted(PARSERS) if PARSERS[n].constrainable])
def test_a_formats_grammar_accepts_what_it_writes_and_nothing_outside_the_schema(name, tiny_model) -> None:
    from transformers import AutoTokenizer

    parser = PARSERS[name]()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    grammars = Grammars(str(tiny_model), vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])
    for calls, parallel in ((CALLS[:1], False), (CALLS, True)):
        matcher = grammars.matcher(StructuredOutputs(grammar=parser.grammar([WEATHER, TIME], parallel)))
        assert matcher.consume_tokens(tokenizer.encode(parser.write(calls), add_special_tokens=False))
        assert matcher.is_accepting(), (name, parser.write(calls))
    one = grammars.matcher(StructuredOutputs(grammar=parser.grammar([WEATHER, TIME], False)))
    outside = parser.write([Call("get_weather", json.dumps({"town": "Paris"}))])  # not its schema
    tokens = tokenizer.encode(outside, add_special_tokens=False)
    assert one.validate_tokens(tokens) < len(tokens)


def chat(**fields) -> ChatCompletionRequest:
    tools = [
        {"type": "function", "function": {"name": t.name, "parameters": t.parameters}}
        for t in (WEATHER, TIME)
    ]
    return ChatCompletionRequest(
        **{"messages": [{"role": "user", "content": "hi"}], "tools": tools, **fields}
    )


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_streamed_answer_splits_as_the_whole_one_does(name, step) -> None:
    parser = PARSERS[name]()
    prose = "" if parser.leading else "Checking both.\n"
    for text in (prose + parser.write(CALLS), "Just words, no call <tool", "[1, 2] is a list"):
        use = tool_use(chat(), None, name)
        whole = use.answer(text)
        stream, deltas = ToolStream(use), []
        for start in range(0, len(text), step):
            chunk = text[start : start + step]
            deltas += stream.feed(chunk, start + step >= len(text))
        content = "".join(d.get("content", "") for d in deltas)
        assert content.strip() == (whole.content or "").strip(), (name, text, deltas)
        heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
        arguments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d]
        assert [h["function"]["name"] for h in heads] == [c.name for c in whole.calls]
        assert [h["index"] for h in heads] == list(range(len(whole.calls)))
        assert [a for a in arguments if a] == [c.arguments for c in whole.calls]


def test_the_format_comes_from_the_chat_template() -> None:
    assert parser_for_template("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert parser_for_template("<tool_call>").name == "hermes"
    assert parser_for_template(None).name == "hermes"


def test_a_call_cut_short_is_dropped_streamed_as_whole() -> None:
    use = tool_use(chat(), None, "hermes")
    text = 'Well.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    stream = ToolStream(use)
    deltas = stream.feed(text[:9], False) + stream.feed(text[9:], True)
    assert deltas == [{"content": "Well."}] and use.answer(text).content == "Well."


def test_a_template_that_renders_tools_gets_them_and_earlier_calls_as_objects(tiny_model) -> None:
    from transformers import AutoTokenizer

    from berth.engine.serve.chat import render

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}({{ c.function.arguments.city }})"
        "{% endfor %}\n"
        "{% endfor %}"
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    body = chat(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21"},
        ]
    )
    use = tool_use(body, tokenizer.chat_template, None)
    assert use.renders_tools
    text = tokenizer.decode(render(tokenizer, body, use))
    assert text.startswith("TOOL get_weather\nTOOL get_time\n")
    assert "assistant:  CALL get_weather(Oslo)" in text and "tool: 21" in text
    # A template that does not render tools: a system prompt describes them, calls are written out.
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    use = tool_use(body, tokenizer.chat_template, None)
    text = tokenizer.decode(render(tokenizer, body, use))
    assert text.startswith("system: You can call functions.") and '"name": "get_time"' in text
    assert (
        'assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    )
