"""`/tokenize` and `/detokenize` in vLLM's shapes: the served tokenizer's own ids (a chat's as
the chat completion renders it), a round trip back to the text, and 400s that name what is
wrong."""

from __future__ import annotations

import copy

from berth.engine.serve.chat import render
from berth.engine.serve.protocol import ChatCompletionRequest, ChatMessage
from tests.serve.server_process import MAX_MODEL_LEN, MODEL_NAME
from tests.serve.test_serve_errors import error_of
from tests.serve.test_serve_openai import MESSAGES, chat_ids

TEXT = "The capital of France is Paris."


def test_tokenize_then_detokenize_gives_the_text_back(server, reference):
    tokenized = server.post("/tokenize", {"model": MODEL_NAME, "prompt": TEXT})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    expected = reference.tokenizer(TEXT)["input_ids"]
    assert body == {
        "count": len(expected),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": expected,
        "token_strs": None,
    }

    back = server.post("/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": reference.tokenizer.decode(expected)}
    assert TEXT in back.json()["prompt"]

    bare = server.post("/tokenize", {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True})
    assert bare.json()["tokens"] == reference.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert bare.json()["token_strs"] == reference.tokenizer.convert_ids_to_tokens(bare.json()["tokens"])


def test_tokenize_messages_gives_the_chat_completions_prompt(server, reference):
    body = server.post("/tokenize", {"model": MODEL_NAME, "messages": MESSAGES}).json()
    assert body["tokens"] == chat_ids(reference, MESSAGES) and body["count"] == len(body["tokens"])


def test_tokenizing_refuses_what_it_cannot_do_naming_the_parameter(server):
    """(Without the API key it is a 401: test_serve_errors.py.)"""
    refusals = [
        ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, "prompt"),  # one or the other
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "hi", "model": "another"}, "model"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),  # past the vocabulary
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ]
    for path, body, param in refusals:
        status = 404 if param == "model" else 400
        assert error_of(server.post(path, body), status)["param"] == param, (path, body)


def test_chat_template_kwargs_reach_the_template_and_may_not_replace_berths_own(server, reference):
    thinking = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    )
    tokenizer = copy.deepcopy(reference.tokenizer)
    tokenizer.chat_template = thinking
    ask = [ChatMessage(role="user", content="hi")]
    off = render(
        tokenizer, ChatCompletionRequest(messages=ask, chat_template_kwargs={"enable_thinking": False})
    )
    on = render(tokenizer, ChatCompletionRequest(messages=ask))
    assert tokenizer.decode(off).endswith("/no_think\n") and not tokenizer.decode(on).endswith("/no_think\n")
    for reserved in ({"tokenize": True}, {"add_generation_prompt": False}, {"messages": []}):
        answer = server.post("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": reserved})
        assert error_of(answer, 400)["param"] == "chat_template_kwargs", reserved
    plain = server.post("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"unused": 1}})
    assert plain.json()["tokens"] == server.post("/tokenize", {"messages": MESSAGES}).json()["tokens"]
