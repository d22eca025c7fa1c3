"""The official `openai` client against `berth serve`: sync and async, streamed and not,
completions and chat. Every answer is checked against the engine's own result for the same
prompt token ids and sampling parameters (greedy, and seeded sampling)."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict

import pytest

from berth.engine import SamplingParams
from berth.engine.outputs import RequestOutput
from tests.serve.server_process import MODEL_NAME

PROMPT = "The capital of France is"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]
LOGPROB_TOLERANCE = 1e-4


# ---- the engine's own answers --------------------------------------------------------------------


def engine_output(reference, prompt_ids: list[int], **params) -> RequestOutput:
    [output] = reference.generate([prompt_ids], SamplingParams(**params))
    return output


def engine_stream(reference, prompt_ids: list[int], **params) -> tuple[RequestOutput, dict[int, str]]:
    """The engine's streamed result: its last update, and each sequence's text as streamed."""
    texts: dict[int, str] = defaultdict(str)
    last = None
    for last in reference.generate_async(prompt_ids, SamplingParams(**params), streaming=True):
        for seq in last.outputs:
            texts[seq.index] += seq.text_diff
    return last, dict(texts)


def prompt_ids(reference, prompt: str) -> list[int]:
    return reference.tokenizer(prompt)["input_ids"]


def chat_ids(reference, messages: list[dict]) -> list[int]:
    """The prompt the server builds from messages: the checkpoint's chat template, rendered to
    text, then tokenized with no special tokens of our own (engine/serve/chat.py)."""
    text = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return reference.tokenizer(text, add_special_tokens=False)["input_ids"]


def sampled_logprobs(seq) -> list[float]:
    return [entry[token].logprob for token, entry in zip(seq.token_ids, seq.logprobs)]


def assert_top_logprobs_match(served: dict[str, float], engine_entry: dict, k: int) -> None:
    """One step's alternatives: each served (token, logprob) is one of the engine's top k."""
    ranked = sorted(engine_entry.values(), key=lambda lp: lp.rank)
    engine_top = [lp for lp in ranked if lp.rank <= k]
    assert len(served) == len({lp.decoded_token for lp in engine_top})
    for token, logprob in served.items():
        assert any(
            lp.decoded_token == token and lp.logprob == pytest.approx(logprob, abs=LOGPROB_TOLERANCE)
            for lp in engine_top
        ), (token, logprob, engine_top)


# ---- models ----------------------------------------------------------------------------------------


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"


# ---- completions -----------------------------------------------------------------------------------


def test_greedy_completion_with_logprobs_is_the_engines(client, reference):
    ids = prompt_ids(reference, PROMPT)
    expected = engine_output(reference, ids, temperature=0, max_tokens=24, logprobs=3).outputs[0]

    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3
    )

    [choice] = reply.choices
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == len(ids) + len(expected.token_ids)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(expected.token_ids)
    assert logprobs.token_logprobs == pytest.approx(sampled_logprobs(expected), abs=LOGPROB_TOLERANCE)
    assert "".join(logprobs.tokens) == "".join(
        e[t].decoded_token for t, e in zip(expected.token_ids, expected.logprobs)
    )
    assert logprobs.text_offset[0] == 0
    for served, entry in zip(logprobs.top_logprobs, expected.logprobs):
        assert_top_logprobs_match(served, entry, 3)


def test_seeded_n2_completion_is_the_engines_and_reproducible(client, reference):
    ids = prompt_ids(reference, PROMPT)
    expected = engine_output(reference, ids, n=2, temperature=0.9, seed=1234, max_tokens=16)

    def ask(seed: int):
        return client.completions.create(
            model=MODEL_NAME, prompt=ids, n=2, temperature=0.9, seed=seed, max_tokens=16
        )

    reply = ask(1234)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [seq.text for seq in expected.outputs]
    assert reply.choices[0].text != reply.choices[1].text  # two samples, not one twice
    assert reply.usage.prompt_tokens == len(ids)  # once, whatever n
    assert reply.usage.completion_tokens == sum(len(seq.token_ids) for seq in expected.outputs)

    assert [c.text for c in ask(1234).choices] == [c.text for c in reply.choices]
    assert [c.text for c in ask(4321).choices] != [c.text for c in reply.choices]


def test_a_batch_of_prompts_answers_n_choices_each_in_order(client, reference):
    prompts = [prompt_ids(reference, "Once upon a time"), prompt_ids(reference, "1, 2, 3,")]
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12)
    expected = reference.generate(prompts, params)

    reply = client.completions.create(
        model=MODEL_NAME, prompt=prompts, n=2, temperature=0.8, seed=7, max_tokens=12
    )

    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [seq.text for out in expected for seq in out.outputs]
    assert reply.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_a_stop_string_ends_the_completion_where_the_engine_stops(client, reference):
    ids = prompt_ids(reference, PROMPT)
    free = engine_output(reference, ids, temperature=0, max_tokens=32).outputs[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), f"pick another prompt: the greedy text {free!r} has no usable middle"
    expected = engine_output(reference, ids, temperature=0, max_tokens=32, stop=[stop]).outputs[0]
    assert expected.finish_reason == "stop"

    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0, stop=stop
    )

    [choice] = reply.choices
    assert choice.text == expected.text and stop not in choice.text
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop  # vLLM's extension: which stop ended it


def test_streamed_completion_is_the_engines_stream(client, reference):
    ids = prompt_ids(reference, PROMPT)
    expected, expected_texts = engine_stream(reference, ids, n=2, temperature=1.0, seed=99, max_tokens=20)

    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        n=2,
        temperature=1.0,
        seed=99,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []  # the usage chunk comes last, alone
            usage = chunk.usage
            continue
        assert usage is None
        for choice in chunk.choices:
            assert choice.index not in finish, "a choice sent text after it finished"
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason

    assert dict(texts) == expected_texts
    assert finish == {seq.index: seq.finish_reason for seq in expected.outputs}
    assert usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == sum(len(seq.token_ids) for seq in expected.outputs)


async def test_async_completions_side_by_side_are_each_the_engines(async_client, reference):
    ids = prompt_ids(reference, PROMPT)
    seeds = [11, 12, 13, 14]
    expected = reference.generate(
        [ids] * len(seeds), [SamplingParams(temperature=1.0, seed=s, max_tokens=16) for s in seeds]
    )

    replies = await asyncio.gather(
        *(
            async_client.completions.create(
                model=MODEL_NAME, prompt=ids, temperature=1.0, seed=s, max_tokens=16
            )
            for s in seeds
        )
    )

    assert [r.choices[0].text for r in replies] == [out.outputs[0].text for out in expected]


async def test_async_streamed_completion_with_logprobs(async_client, reference):
    ids = prompt_ids(reference, PROMPT)
    expected, expected_texts = engine_stream(reference, ids, temperature=0, max_tokens=10, logprobs=1)
    [seq] = expected.outputs

    stream = await async_client.completions.create(
        model=MODEL_NAME, prompt=ids, temperature=0, max_tokens=10, logprobs=1, stream=True
    )
    text, token_logprobs, offsets = "", [], []
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                token_logprobs += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset

    assert text == expected_texts[0]
    assert token_logprobs == pytest.approx(sampled_logprobs(seq), abs=LOGPROB_TOLERANCE)
    # Where each token starts, counted as the non-streamed answer counts them, however the
    # tokens fell into chunks (a chunk may end inside a UTF-8 character the text holds back).
    whole = await async_client.completions.create(
        model=MODEL_NAME, prompt=ids, temperature=0, max_tokens=10, logprobs=1
    )
    assert offsets == whole.choices[0].logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[0] == 0


# ---- chat completions ------------------------------------------------------------------------------


def test_greedy_chat_with_logprobs_is_the_engines(client, reference):
    ids = chat_ids(reference, MESSAGES)
    expected = engine_output(reference, ids, temperature=0, max_tokens=20, logprobs=2).outputs[0]

    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=20,
        logprobs=True,
        top_logprobs=2,
    )

    [choice] = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx(sampled_logprobs(expected), abs=LOGPROB_TOLERANCE)
    for served, entry in zip(content, expected.logprobs):
        assert len(served.top_logprobs) == 2
        assert served.bytes == list(served.token.encode())
        assert_top_logprobs_match({t.token: t.logprob for t in served.top_logprobs}, entry, 2)


def test_seeded_n2_chat_with_stop_is_the_engines_and_reproducible(client, reference):
    ids = chat_ids(reference, MESSAGES)
    params = {"n": 2, "temperature": 0.7, "seed": 2024, "max_tokens": 24, "stop": ["e"]}
    expected = engine_output(reference, ids, **params)

    def ask():
        return client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, n=2, temperature=0.7, seed=2024, max_tokens=24, stop=["e"]
        )

    reply = ask()
    assert [c.message.content for c in reply.choices] == [seq.text for seq in expected.outputs]
    assert [c.finish_reason for c in reply.choices] == [seq.finish_reason for seq in expected.outputs]
    assert all("e" not in c.message.content for c in reply.choices)
    assert [c.message.content for c in ask().choices] == [c.message.content for c in reply.choices]


async def test_async_streamed_n2_chat_is_the_engines_stream(async_client, reference):
    ids = chat_ids(reference, MESSAGES)
    expected, expected_texts = engine_stream(reference, ids, n=2, temperature=1.0, seed=5, max_tokens=16)

    stream = await async_client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        n=2,
        temperature=1.0,
        seed=5,
        max_completion_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    roles: dict[int, str] = {}
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk" and chunk.model == MODEL_NAME
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role is not None:
                roles[choice.index] = choice.delta.role
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason

    assert roles == {0: "assistant", 1: "assistant"}  # every choice opens with its role
    assert dict(texts) == expected_texts
    assert finish == {seq.index: seq.finish_reason for seq in expected.outputs}
    assert usage.completion_tokens == sum(len(seq.token_ids) for seq in expected.outputs)
    assert usage.prompt_tokens == len(ids)


async def test_async_chat_without_a_limit_runs_to_eos_or_the_models_length(async_client, reference):
    ids = chat_ids(reference, MESSAGES)
    expected = engine_output(reference, ids, temperature=0, max_tokens=None).outputs[0]

    reply = await async_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0)

    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.completion_tokens == len(expected.token_ids)


# ---- echo, usage details, continuous usage --------------------------------------------------------


def test_echo_puts_the_prompt_before_each_choice_streamed_or_not(client, reference):
    ids = prompt_ids(reference, PROMPT)
    expected = engine_output(reference, ids, n=2, temperature=1.0, seed=5, max_tokens=8).outputs
    params = dict(model=MODEL_NAME, n=2, temperature=1.0, seed=5, max_tokens=8, echo=True)

    reply = client.completions.create(prompt=PROMPT, **params)
    assert [c.text for c in reply.choices] == [PROMPT + seq.text for seq in expected]
    by_ids = client.completions.create(prompt=ids, **params)  # token ids: echoed decoded
    decoded = reference.tokenizer.decode(ids, skip_special_tokens=True)
    assert [c.text for c in by_ids.choices] == [decoded + seq.text for seq in expected]
    assert reply.usage.completion_tokens == sum(len(seq.token_ids) for seq in expected)

    texts: dict[int, str] = defaultdict(str)
    for chunk in client.completions.create(prompt=PROMPT, stream=True, **params):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert dict(texts) == {i: PROMPT + seq.text for i, seq in enumerate(expected)}


def test_the_same_prompt_again_reports_the_prefix_cache_hit_in_usage(client):
    """The shared server caches prefixes (the default); a salt of its own makes the first ask a
    miss whatever ran before."""
    prompt = " ".join(["a prefix the cache keeps"] * 12)
    salted = dict(model=MODEL_NAME, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "usage-details"})
    first = client.completions.create(**salted)
    again = client.completions.create(**salted)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < again.usage.prompt_tokens  # whole KV blocks
    streamed = [c.usage for c in client.completions.create(
        **salted, stream=True, stream_options={"include_usage": True}
    ) if c.usage is not None]  # fmt: skip
    assert streamed[-1].prompt_tokens_details.cached_tokens == cached


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, reference):
    ids = prompt_ids(reference, PROMPT)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0, logprobs=0, stream=True,
            stream_options=options, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert all(c.usage is not None and c.usage.prompt_tokens == len(ids) for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    # Each chunk counts the tokens streamed so far, its own included (one or more a chunk).
    streamed = list(itertools.accumulate(len(c.choices[0].logprobs.tokens) for c in chunks[:-1]))
    assert [c.usage.completion_tokens for c in chunks[:-1]] == streamed and streamed[-1] == 6

    chat = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4, temperature=0, stream=True,
            stream_options=options, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 4
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.usage is not None for c in plain][-2:] == [False, True]  # without it: the last alone
