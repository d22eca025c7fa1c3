"""Structured outputs on the engine (`SamplingParams(structured_outputs=...)`): every output that
ends with finish_reason "stop" is complete and valid, on a model with random weights (the mask,
not the model, makes it so), at any temperature, with n > 1, and when a small KV pool preempts
sequences mid-output."""

from __future__ import annotations

import json
import random
import re
import shutil
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from berth.engine import LLM, SamplingParams
from berth.engine.engine_io import RequestError
from berth.engine.pyexecutor.grammar_masks import StepMasks
from berth.engine.pyexecutor.sampler import _constrained
from berth.engine.structured_outputs import Grammars, StructuredOutputs, forbidden_tokens, grammar_problem

TEMPERATURES = (0.0, 0.7, 1.5)


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, executor="in-process", max_batch_size=16, kv_cache_blocks=256) as engine:
        yield engine


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Objects, arrays, enums, nesting, bounded strings and integers, numbers, booleans,
    anyOf with null: the shapes agents send."""
    leaves = [
        lambda: {"type": "string", "maxLength": rng.randint(1, 12)},
        lambda: {"type": "string", "minLength": 2, "maxLength": 6},
        lambda: {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 500)},
        lambda: {"type": "number", "minimum": 0, "maximum": 10},
        lambda: {"type": "boolean"},
        lambda: {"enum": rng.sample(["red", "green", "blue", "a b", 'qu"ote', 3, None], 3)},
        lambda: {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
    ]
    if depth >= 2 or rng.random() < 0.3:
        return rng.choice(leaves)()
    if rng.random() < 0.35:
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "tags", "score", "ok", "child", "kind", "note"], rng.randint(1, 4))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def test_every_finished_output_validates_against_its_random_schema_at_any_temperature(llm) -> None:
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(40)]
    params = [
        SamplingParams(
            n=2,
            max_tokens=160,
            temperature=TEMPERATURES[i % len(TEMPERATURES)],
            seed=i,
            structured_outputs=StructuredOutputs(json=schema),
        )
        for i, schema in enumerate(schemas)
    ]
    outputs = llm.generate([f"Write record {i}:" for i in range(len(schemas))], params)
    finished = 0
    for schema, output in zip(schemas, outputs):
        for sequence in output.outputs:
            assert sequence.finish_reason in ("stop", "length")
            if sequence.finish_reason == "stop":
                jsonschema.validate(json.loads(sequence.text), schema)
                finished += 1
    # The bounds make most documents short: nearly all finish inside the budget.
    assert finished >= 0.9 * 2 * len(schemas), finished


def test_regex_choice_grammar_and_json_object_constrain_every_sequence(llm) -> None:
    cases = [
        (StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"), re.compile(r"[0-9]{3}-[a-z]{2,4}").fullmatch),
        (StructuredOutputs(choice=["yes", "no", 'it "depends"']), {"yes", "no", 'it "depends"'}.__contains__),
        (
            StructuredOutputs(grammar='start: "(" num ("," num)* ")"\nnum: /[1-9][0-9]?/'),
            re.compile(r"\(\d+(,\d+)*\)").fullmatch,
        ),
        (StructuredOutputs(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    ]
    params = [
        SamplingParams(n=4, max_tokens=64, temperature=1.0, seed=3, structured_outputs=spec)
        for spec, _ in cases
    ]
    outputs = llm.generate(["Answer:"] * len(cases), params)
    for (spec, valid), output in zip(cases, outputs):
        stopped = [s.text for s in output.outputs if s.finish_reason == "stop"]
        assert stopped, (spec, [s.text for s in output.outputs])
        assert all(valid(text) for text in stopped), (spec, stopped)


def test_preempted_sequences_keep_their_grammar(tiny_model) -> None:
    """A pool far too small for the batch: sequences are preempted and recomputed mid-output;
    their matchers follow the kept tokens and every finished document still validates."""
    schema = {
        "type": "object",
        "properties": {
            "words": {
                "type": "array",
                "items": {"type": "string", "minLength": 3, "maxLength": 6},
                "minItems": 12,
                "maxItems": 12,
            }
        },
        "required": ["words"],
        "additionalProperties": False,
    }
    with LLM(
        tiny_model, executor="in-process", max_batch_size=8, kv_cache_blocks=12, kv_block_size=16
    ) as engine:
        params = SamplingParams(
            n=1, max_tokens=150, temperature=1.0, seed=1, structured_outputs=StructuredOutputs(json=schema)
        )
        outputs = engine.generate([f"List {i}:" for i in range(8)], [params] * 8)
        assert engine.executor.stats.num_preemptions > 0, "the pool was meant to be too small"
    stopped = [s.text for o in outputs for s in o.outputs if s.finish_reason == "stop"]
    assert stopped
    for text in stopped:
        jsonschema.validate(json.loads(text), schema)


def test_a_grammar_that_cannot_compile_fails_its_request_alone_with_the_reason(llm) -> None:
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(json={"not": {"type": "string"}}))
    good = SamplingParams(max_tokens=8, temperature=0)
    with pytest.raises(RequestError, match=r"Unimplemented keys.*not"):
        llm.generate(["Hello"], bad)
    assert llm.generate(["Hello"], good)[0].outputs[0].text is not None


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (StructuredOutputs(json={"type": "string", "format": "no-such"}), "Unknown format"),
        (StructuredOutputs(regex="[a-"), "unclosed character class"),
        (StructuredOutputs(grammar="start: undefined_rule"), "unknown name"),
        (StructuredOutputs(json="{not json"), "not valid JSON"),
        (StructuredOutputs(), "exactly one of"),
        (StructuredOutputs(regex="a", choice=["b"]), "exactly one of"),
        (StructuredOutputs(choice=[]), "choice must be"),
    ],
)
def test_what_cannot_constrain_says_why_without_a_tokenizer(spec, says) -> None:
    assert says in (grammar_problem(spec) or "")


def test_structured_outputs_refuse_what_would_end_them_early_or_never() -> None:
    spec = StructuredOutputs(json_object=True)
    for conflict in ({"ignore_eos": True}, {"stop": ["}"]}, {"stop_token_ids": [5]}, {"min_tokens": 2}):
        with pytest.raises(ValueError, match="structured_outputs cannot be combined"):
            SamplingParams(structured_outputs=spec, **conflict)


def test_a_schema_sent_again_is_copied_not_compiled_again(tiny_model) -> None:
    grammars = Grammars(str(tiny_model), vocab_size=512, eos_token_ids=[2])
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    first, second = grammars.matcher(spec), grammars.matcher(StructuredOutputs(json=dict(spec.json)))
    assert first is not second and len(grammars._compiled) == 1
    assert first.consume_tokens([]) and not first.is_error()


def test_a_drained_sleep_finishes_structured_outputs_and_a_new_revision_brings_its_tokenizer(
    tiny_model, tmp_path
) -> None:
    revision = tmp_path / "revision"
    shutil.copytree(tiny_model, revision)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 5}
    params = SamplingParams(
        max_tokens=80, temperature=1.0, seed=2, structured_outputs=StructuredOutputs(json=schema)
    )
    with LLM(tiny_model, executor="in-process") as engine:
        in_flight = [engine.generate_async(f"Numbers {i}:", params) for i in range(4)]
        engine.sleep(mode="drain")
        finished = [result.result(timeout=60).outputs[0] for result in in_flight]
        engine.wake_up(model=revision)
        grammars = engine.executor.engine.grammar_masks._grammars
        assert grammars.model_dir == str(revision)  # matchers now use the new revision's tokenizer
        finished += engine.generate([f"More {i}:" for i in range(4)], params)[0].outputs
    for sequence in finished:
        assert sequence.finish_reason == "stop", sequence.text
        jsonschema.validate(json.loads(sequence.text), schema)


def test_the_masks_forbid_what_the_bits_do_not_allow_in_the_constrained_rows_only() -> None:
    bitmask = np.array([[0b101, -1], [-1, 0]], dtype=np.int32)  # row 0: tokens 0 and 2 of 0..31, 32..39
    forbidden = forbidden_tokens(bitmask, 40)
    assert forbidden[0].tolist() == [False, True, False] + [True] * 29 + [False] * 8
    assert forbidden[1].tolist() == [False] * 32 + [True] * 8
    logits = torch.zeros(3, 40)
    masks = StepMasks([2], forbidden[:1], [None])
    copied = _constrained(logits, masks, copy=True)  # a request wants log-probs: the raw stay
    assert not logits.isinf().any() and copied[:2].eq(0).all()
    assert copied[2].isinf().tolist() == forbidden[0].tolist()
    assert _constrained(logits, masks, copy=False) is logits and logits[2].isinf().sum() == 30


def test_masks_the_sampler_cannot_apply_fail_their_rows_and_the_others_draw() -> None:
    from berth.engine.pyexecutor.sampler import Sampler
    from berth.engine.pyexecutor.sequence import Sequence

    def row(index: int) -> Sequence:
        greedy = SamplingParams(temperature=0)
        return Sequence(index, 0, [1, 2], greedy, priority=0.5, max_tokens=4, arrival_time=0.0)

    logits = torch.zeros(2, 40)
    logits[0, 7] = 1.0
    wrong_width = np.zeros((1, 39), dtype=bool)  # not the vocabulary's width
    out = Sampler().sample(logits, [row(0), row(1)], StepMasks([1], wrong_width, [None]))
    assert out.token_ids[0] == 7 and out.errors[0] is None
    assert out.token_ids[1] is None and "could not be applied" in str(out.errors[1])
