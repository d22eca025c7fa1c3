"""The sampling parameters OpenAI and vLLM clients send (penalties, logit_bias, min_p,
min_tokens) take effect through the server: each answer is the engine's own for the same
parameters, and differs from the answer without them the way the parameter says it must."""

from __future__ import annotations

import math

import pytest

from berth.engine import SamplingParams
from tests.serve.server_process import MODEL_NAME

PROMPT = "the quick brown fox"
# The OpenAI SDK's own arguments; vLLM's (min_p, ignore_eos, ...) travel in extra_body.
OPENAI_FIELDS = {
    "max_tokens",
    "temperature",
    "seed",
    "logprobs",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
}


def engine_tokens(reference, ids: list[int], **params) -> list[int]:
    """The engine's answer to the same parameters (string logit_bias keys too, as JSON has them)."""
    [output] = reference.generate([ids], SamplingParams(**params))
    return output.outputs[0].token_ids


def complete(client, ids: list[int], **fields):
    named = {key: value for key, value in fields.items() if key in OPENAI_FIELDS}
    extra = {key: value for key, value in fields.items() if key not in OPENAI_FIELDS}
    return client.completions.create(model=MODEL_NAME, prompt=ids, **named, extra_body=extra)


@pytest.fixture(scope="module")
def ids(reference) -> list[int]:
    return reference.tokenizer(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def plain(reference, ids) -> list[int]:
    """The greedy answer with nothing adjusted: it repeats a token (the penalties' target)."""
    tokens = engine_tokens(reference, ids, temperature=0, max_tokens=24, ignore_eos=True)
    assert len(set(tokens)) < len(tokens), "pick a prompt whose greedy answer repeats a token"
    return tokens


def test_logit_bias_plus_100_forces_its_token_in_completions_and_chat(client, reference, ids):
    forced = 300
    expected = reference.tokenizer.decode([forced] * 4)
    sampled = complete(client, ids, max_tokens=4, temperature=0.8, seed=1, logit_bias={str(forced): 100})
    assert sampled.choices[0].text == expected
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=4,
        logit_bias={str(forced): 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.content == expected


def test_logit_bias_minus_100_on_the_greedy_token_changes_the_answer(client, reference, ids, plain):
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logit_bias": {str(plain[0]): -100}}
    banned = engine_tokens(reference, ids, **params)
    assert banned[0] != plain[0]
    assert complete(client, ids, **params).choices[0].text == reference.tokenizer.decode(banned)


@pytest.mark.parametrize(
    "penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.5}]
)
def test_a_large_penalty_stops_the_greedy_answer_repeating(client, reference, ids, plain, penalty):
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, **penalty}
    penalized = engine_tokens(reference, ids, **params)
    assert len(set(penalized)) == len(penalized) and penalized != plain
    assert complete(client, ids, **params).choices[0].text == reference.tokenizer.decode(penalized)


def test_min_p_keeps_only_tokens_near_the_likeliest(client, reference, ids):
    """At temperature 1 the served logprobs (the model's distribution) show the rule held: each
    sampled token is at least min_p times as likely as the step's likeliest one."""
    params = {"temperature": 1.0, "seed": 11, "max_tokens": 16, "ignore_eos": True}
    [choice] = complete(client, ids, **params, min_p=0.3, logprobs=1).choices
    assert choice.text == reference.tokenizer.decode(engine_tokens(reference, ids, **params, min_p=0.3))
    assert choice.text != reference.tokenizer.decode(engine_tokens(reference, ids, **params))
    for sampled, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert sampled >= math.log(0.3) + max(top.values()) - 1e-4


def test_min_tokens_delays_an_eos_that_the_bias_forces(client, reference, ids):
    [eos] = reference.executor.engine.eos_token_ids
    forced = {"logit_bias": {str(eos): 100}, "max_tokens": 12, "temperature": 0}
    at_once = complete(client, ids, **forced)
    assert (at_once.usage.completion_tokens, at_once.choices[0].finish_reason) == (1, "stop")
    held = complete(client, ids, **forced, min_tokens=5)
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (6, "stop")
