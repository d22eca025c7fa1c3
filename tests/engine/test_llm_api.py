"""The LLM API end to end on the in-process engine: sampling, stops, n, seeds, abort, async,
errors. Every test leaves the KV pool empty."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import shutil
import threading
import time

import pytest

from berth.engine import LLM, EngineConfig, SamplingParams
from berth.engine.executor import EngineDeadError, GenerationRequest, RequestError
from berth.engine.executor.in_process import InProcessExecutor
from berth.engine.executor.proxy import ProxyExecutor
from berth.engine.tokenizer import load_tokenizer
from tests.engine.conftest import kv_blocks_used

PROMPTS = ["the quick brown fox", "def add(a, b):", "print the lazy dog", "over the"]


@pytest.fixture(autouse=True)
def pool_is_empty_after_each_test(llm):
    yield
    # A stop string is found client-side; the engine frees those blocks a turn later.
    deadline = time.monotonic() + 10
    while kv_blocks_used(llm) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kv_blocks_used(llm) == 0


def greedy(max_tokens: int = 12, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **extra)


def test_outputs_come_back_in_prompt_order_with_lengths_and_reasons(llm):
    outputs = llm.generate(PROMPTS, greedy(max_tokens=5, ignore_eos=True))
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        (completion,) = output.outputs
        assert output.finished and completion.finish_reason == "length"
        assert len(completion.token_ids) == 5
        assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_same_seed_same_output_whatever_else_is_batched(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    companions = [SamplingParams(temperature=1.0, seed=s, max_tokens=16) for s in range(5)]
    crowded = llm.generate([PROMPTS[0], *PROMPTS[1:], *PROMPTS[1:]], [params, *companions, companions[0]])
    assert crowded[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate(PROMPTS[0], other_seed)[0].outputs[0].token_ids != alone


def test_n_gives_n_distinct_indexed_samples(llm):
    params = SamplingParams(n=3, temperature=1.5, seed=7, max_tokens=10, ignore_eos=True)
    (output,) = llm.generate(PROMPTS[1], params)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_top_k_one_is_greedy(llm):
    sampled = llm.generate(PROMPTS[2], SamplingParams(temperature=0.8, top_k=1, max_tokens=10, seed=5))
    assert sampled[0].outputs[0].token_ids == llm.generate(PROMPTS[2], greedy(10))[0].outputs[0].token_ids


def test_stop_string_ends_generation_and_is_not_emitted(llm):
    full = llm.generate(PROMPTS[0], greedy(20, ignore_eos=True))[0].outputs[0].text
    stop = full[6:9]
    assert len(stop) == 3 and stop.strip(), f"the greedy text is too short to pick a stop from: {full!r}"
    cut = full[: full.find(stop)]
    completion = llm.generate(PROMPTS[0], greedy(20, ignore_eos=True, stop=[stop, "\x00never"]))[0].outputs[0]
    assert completion.text == cut
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    kept = llm.generate(PROMPTS[0], greedy(20, ignore_eos=True, stop=stop, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == cut + stop


def test_stop_string_never_leaks_while_streaming(llm):
    full = llm.generate(PROMPTS[3], greedy(20, ignore_eos=True))[0].outputs[0].text
    stop = full[5:8]
    streamed = ""
    for update in llm.generate_async(PROMPTS[3], greedy(20, ignore_eos=True, stop=stop), streaming=True):
        streamed += update.outputs[0].text_diff
        assert stop not in streamed
    assert streamed == full[: full.find(stop)]


def test_stop_token_ends_generation_with_its_id(llm):
    tokens = llm.generate(PROMPTS[1], greedy(12, ignore_eos=True))[0].outputs[0].token_ids
    stop_id = tokens[4]
    cut = tokens.index(stop_id)
    completion = llm.generate(PROMPTS[1], greedy(12, ignore_eos=True, stop_token_ids=[stop_id]))[0].outputs[0]
    assert completion.token_ids == tokens[: cut + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)


def test_eos_ends_generation_unless_ignored(llm, tiny_model, tmp_path):
    """EOS is made a token greedy decoding surely produces: a checkpoint whose generation config
    names the fourth token the model generates as its end of sequence."""
    prompt = [[5, 6, 7]]
    free_running = llm.generate(prompt, greedy(12, ignore_eos=True))[0].outputs[0].token_ids
    model = tmp_path / "eos"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": free_running[3]}))
    with LLM(model, executor="in-process", kv_cache_blocks=16) as with_eos:
        eos_ids = with_eos.executor.engine.eos_token_ids
        stopped = with_eos.generate(prompt, greedy(12))[0].outputs[0]
        ignoring = with_eos.generate(prompt, greedy(12, ignore_eos=True))[0].outputs[0]
    first_eos = next(i for i, token in enumerate(free_running) if token in eos_ids)
    assert first_eos <= 3
    assert stopped.token_ids == free_running[: first_eos + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    assert ignoring.token_ids == free_running and ignoring.finish_reason == "length"


def test_logprobs_are_normalised_ranked_and_include_the_sampled_token(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=4, ignore_eos=True)
    completion = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert len(completion.logprobs) == 6
    for token, step in zip(completion.token_ids, completion.logprobs):
        assert token in step
        top = sorted((lp for tid, lp in step.items() if lp.rank <= 4), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3, 4]
        assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(top))
        assert sum(math.exp(lp.logprob) for lp in top) <= 1.0 + 1e-5
    assert completion.cumulative_logprob == pytest.approx(
        sum(step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs))
    )


def test_abort_mid_stream_ends_with_abort_and_frees_blocks(llm):
    result = llm.generate_async(PROMPTS[0], greedy(400, ignore_eos=True), streaming=True)
    other = llm.generate_async(PROMPTS[1], greedy(8, ignore_eos=True))
    for update in result:
        if len(update.outputs[0].token_ids) >= 3:
            result.abort()
    final = result.result(timeout=30)
    assert final.outputs[0].finish_reason == "abort"
    assert 3 <= len(final.outputs[0].token_ids) < 400
    assert other.result(timeout=30).outputs[0].finish_reason == "length"  # the other one goes on


async def test_await_and_async_streaming(llm):
    params = greedy(10, ignore_eos=True)
    expected = llm.generate(PROMPTS[2], params)[0].outputs[0]
    awaited = await llm.generate_async(PROMPTS[2], params)
    assert awaited.outputs[0].token_ids == expected.token_ids

    tokens, text = [], ""
    async for update in llm.generate_async(PROMPTS[2], params, streaming=True):
        tokens += update.outputs[0].token_ids_diff
        text += update.outputs[0].text_diff
    assert tokens == expected.token_ids and text == expected.text

    many = await asyncio.gather(*(llm.generate_async(p, params) for p in PROMPTS * 4))
    assert [m.prompt for m in many] == PROMPTS * 4


def test_request_errors_fail_alone_with_a_clear_message(llm):
    vocab = llm.executor.engine.model_config.vocab_size
    good = llm.generate_async(PROMPTS[0], greedy(4))
    bad = llm.generate_async([1, vocab + 10], greedy(4))
    with pytest.raises(RequestError, match=f"token id {vocab + 10}"):
        bad.result(timeout=30)
    with pytest.raises(RequestError):  # the error is sticky
        bad.result(timeout=0)
    assert good.result(timeout=30).finished


async def test_several_consumers_of_one_result_all_wake(llm):
    """Defect 5: a second await / async for on the same result must not replace the first."""
    params = greedy(12, ignore_eos=True)
    result = llm.generate_async(PROMPTS[1], params, streaming=True)

    async def stream() -> list[int]:
        return [t async for update in result for t in update.outputs[0].token_ids_diff]

    awaited, again, streamed, streamed_too = await asyncio.wait_for(
        asyncio.gather(result.aresult(), result.aresult(), stream(), stream()), timeout=60
    )
    assert awaited.outputs[0].token_ids == again.outputs[0].token_ids
    assert len(awaited.outputs[0].token_ids) == 12
    # Each stream sees every token once.
    assert streamed == streamed_too == awaited.outputs[0].token_ids


@pytest.mark.parametrize("length", ["max_model_len", "longer"])
def test_a_prompt_that_leaves_no_room_fails_alone(llm, length):
    """Defect 2: with max_tokens=None the budget is what the model's length leaves; a prompt of
    max_model_len tokens or more leaves nothing and is refused, the engine goes on."""
    limit = llm.limits.max_model_len
    prompt = [5] * (limit if length == "max_model_len" else limit + 40)
    with pytest.raises(RequestError, match=f"maximum context length is {limit}") as refused:
        llm.generate([prompt], SamplingParams(max_tokens=None))
    assert refused.value.code == "too_long" and refused.value.param == "prompt"
    assert llm.check_health()
    assert llm.generate([[5] * (limit - 1)], SamplingParams(max_tokens=None, ignore_eos=True))[0].finished


def test_a_top_k_beyond_64_bits_is_refused_at_the_api(llm):
    """Defect 8: an absurd top_k used to reach the sampler and kill the engine."""
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**64)
    huge = llm.generate(PROMPTS[0], SamplingParams(top_k=2**62, seed=1, max_tokens=3))  # more than the vocab
    assert len(huge[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("executor", ["in-process", "proxy"])
def test_after_shutdown_the_engine_is_unhealthy_and_refuses_work(tiny_model, executor):
    """Defect 3: unhealthy once shutdown starts; the admission state says so too."""
    llm = LLM(tiny_model, executor=executor, kv_cache_blocks=16)
    assert llm.check_health() and llm.executor.admission_state == "running"
    llm.shutdown()
    assert not llm.check_health()
    assert llm.executor.admission_state == "shutdown"
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate_async("hi", greedy(2))


@pytest.mark.parametrize("pause", ["before-registering", "after-registering"])
@pytest.mark.parametrize("shape", [InProcessExecutor, ProxyExecutor])
def test_a_submit_racing_shutdown_is_refused_or_answered(tiny_model, shape, pause):
    """Defect 4: a submit that a shutdown overtakes must not be enqueued and left unanswered.
    The shutdown runs all the way while the submit is held either before it registers its
    result (the shutdown's failing of pending results cannot see it: the check after
    registering must refuse it) or between registering and that check (the shutdown failed
    it, and the check refuses to send it on to a stopped engine)."""
    executor = shape(EngineConfig(model=str(tiny_model), kv_cache_blocks=16), load_tokenizer(tiny_model))
    entered, go_on = threading.Event(), threading.Event()
    submitter_id: list[int] = []

    def hold() -> None:
        entered.set()
        assert go_on.wait(30)

    if pause == "before-registering":
        next_request_id = executor._next_request_id

        def paused_next_request_id() -> int:  # after submit's first check, before it registers
            hold()
            return next_request_id()

        executor._next_request_id = paused_next_request_id
    else:
        raise_if_closed, checks = executor._raise_if_closed, []

        def paused_check() -> None:  # its second call in submit: after registering, before sending
            if threading.get_ident() in submitter_id:
                checks.append(1)
                if len(checks) == 2:
                    hold()
            raise_if_closed()

        executor._raise_if_closed = paused_check
    outcome: dict = {}

    def submit() -> None:
        submitter_id.append(threading.get_ident())
        try:
            outcome["result"] = executor.submit(GenerationRequest([5, 6], greedy(3), streaming=True))
        except Exception as error:
            outcome["error"] = error

    submitter = threading.Thread(target=submit, daemon=True)
    submitter.start()
    assert entered.wait(30)
    executor.shutdown()  # all the way: pending requests failed, the engine stopped
    go_on.set()
    submitter.join(30)
    assert not submitter.is_alive()
    assert set(outcome) == {"error"}, outcome  # refused at once, never sent to a stopped engine
    assert isinstance(outcome["error"], EngineDeadError), outcome["error"]
    assert executor.num_pending == 0


def test_a_request_longer_than_the_pool_is_rejected_at_once(tiny_model):
    with LLM(tiny_model, executor="in-process", kv_cache_blocks=4, kv_block_size=16) as small:
        with pytest.raises(RequestError, match=r"needs 7 blocks .* but the pool holds 4 blocks"):
            small.generate([list(range(3, 13))], SamplingParams(max_tokens=100))
        assert small.generate("ok", greedy(4))[0].finished  # the engine goes on


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("n", 0),
        ("seed", 1.5),
        ("stop", ""),
        ("stop_token_ids", [-1]),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 101.0),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("min_tokens", 17),  # past max_tokens (16)
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {"-1": 1.0}),
        ("logit_bias", {"five": 1.0}),
        ("logit_bias", {True: 1.0}),
        ("logit_bias", {t: 1.0 for t in range(301)}),
        ("logit_bias", [(5, 1.0)]),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})


def test_logit_bias_keys_may_be_json_strings():
    assert SamplingParams(logit_bias={"7": 1, 8: -2.5}).logit_bias == {7: 1.0, 8: -2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None  # no bias: nothing to apply


def test_a_logit_bias_past_the_vocabulary_fails_its_request_alone(llm):
    vocab = llm.executor.engine.model_config.vocab_size
    good = llm.generate_async(PROMPTS[0], greedy(4))
    bad = llm.generate_async(PROMPTS[0], greedy(4, logit_bias={vocab: 5.0}))
    with pytest.raises(RequestError, match=f"logit_bias token id {vocab}") as raised:
        bad.result(timeout=30)
    assert raised.value.param == "logit_bias"
    assert good.result(timeout=30).finished


def test_min_tokens_holds_back_an_eos_the_bias_forces(llm):
    """EOS forced by a bias ends the output at once; min_tokens makes it wait its turn."""
    [eos, *_] = sorted(llm.executor.engine.eos_token_ids)
    [at_once] = llm.generate(PROMPTS[1], greedy(12, logit_bias={eos: 100}))[0].outputs
    [held] = llm.generate(PROMPTS[1], greedy(12, logit_bias={eos: 100}, min_tokens=5))[0].outputs
    assert at_once.token_ids == [eos] and at_once.finish_reason == "stop"
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and eos not in held.token_ids[:5]
    assert held.finish_reason == "stop"


def test_the_same_prompt_again_reports_its_cached_prefix(llm):
    prompt = " ".join(["cached prefix words"] * 20)
    first = llm.generate(prompt, greedy(2), cache_salt="test-cached-tokens")[0]
    again = llm.generate(prompt, greedy(2), cache_salt="test-cached-tokens")[0]
    assert first.num_cached_tokens == 0
    block = llm.executor.engine.kv_cache.block_size
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // block * block > 0


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "at least one token"), ([[1, 2]], "one-dimensional"), ([1, -3], "non-negative")],
)
def test_malformed_prompts_are_refused_at_submit(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate_async(prompt, greedy(4))


@pytest.mark.parametrize("priority", [-0.1, 1.1, float("nan")])
def test_priority_outside_zero_one_is_refused(llm, priority):
    with pytest.raises(ValueError, match="priority"):
        llm.generate_async(PROMPTS[0], greedy(4), priority=priority)
