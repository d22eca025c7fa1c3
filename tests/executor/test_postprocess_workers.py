"""Postprocess workers (`num_postprocess_workers=N`): the text of every output (detokenization,
stop strings, decoded logprobs) is made in N processes instead of the proxy's, and is the same;
the death of one is the engine's death, told to every pending request at once."""

from __future__ import annotations

import os
import signal

import pytest

from berth.engine import LLM, SamplingParams
from berth.engine.engine_io import TransitionError
from berth.engine.executor import EngineDeadError
from tests.support.engine_processes import (
    POSTPROCESS_MODULE,
    call_with_timeout,
    pid_alive,
    wait_until,
    worker_pids,
)
from tests.support.model_revisions import reversed_vocabulary

ENGINE_OPTIONS = {"max_batch_size": 16, "kv_cache_blocks": 256, "kv_block_size": 16}
PROMPTS = ["Once upon a time there", "Paris is the capital of"]
# Every kind of postprocessing: logprobs with alternatives, stop strings (kept in the text or
# not, matched across token boundaries), n > 1, special tokens kept, no text at all.
REQUEST_KINDS = [
    SamplingParams(temperature=0, max_tokens=24, logprobs=3),
    SamplingParams(temperature=0, max_tokens=32, stop=["e ", "o"], include_stop_str_in_output=True),
    SamplingParams(temperature=0, max_tokens=32, stop=[" t", "ll"], logprobs=1),
    SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=20, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0, max_tokens=16, skip_special_tokens=False, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=8, detokenize=False, logprobs=2),
]


def outputs_of(llm: LLM) -> list:
    """Every request of the set, one at a time (so each runs alone and its logprobs are the
    same to the bit), streamed and not; then all at once, streamed."""
    seen = []
    for params in REQUEST_KINDS:
        for prompt in PROMPTS:
            seen.append(llm.generate(prompt, params)[0])
            result = llm.generate_async(prompt, params, streaming=True)
            streamed = [("", [])] * params.n  # what the stream's diffs add up to, per sequence
            for update in result:
                streamed = [
                    (t + o.text_diff, i + o.token_ids_diff) for (t, i), o in zip(streamed, update.outputs)
                ]
            seen.append((streamed, result.result(timeout=30)))
    together = [llm.generate_async(p, REQUEST_KINDS[1], streaming=True) for p in PROMPTS * 4]
    seen += [call_with_timeout(lambda r=r: r.result(timeout=60), 70) for r in together]
    return [_comparable(output) for output in seen]


def _comparable(item) -> object:
    if isinstance(item, tuple):
        return (item[0], _comparable(item[1]))
    item.request_id = None  # the one field that differs (each engine counts its own)
    return item


@pytest.mark.slow  # worker and postprocess processes started, slept and woken
def test_outputs_are_the_same_with_postprocess_workers(tiny_model):
    with LLM(tiny_model, **ENGINE_OPTIONS) as llm:
        in_the_proxy = outputs_of(llm)
    with LLM(tiny_model, num_postprocess_workers=2, **ENGINE_OPTIONS) as llm:
        assert len(worker_pids(module=POSTPROCESS_MODULE)) == 2
        in_workers = outputs_of(llm)
    assert len(in_workers) == len(in_the_proxy)
    for expected, got in zip(in_the_proxy, in_workers):
        assert got == expected
    stopped = [
        o for o in in_the_proxy if not isinstance(o, tuple) and o.outputs[0].stop_reason in ("e ", "o")
    ]
    assert stopped, "the set must include outputs ended by a stop string"


def test_a_postprocess_worker_killed_fails_every_pending_request_with_its_cause(tiny_model):
    llm = LLM(tiny_model, num_postprocess_workers=2, **ENGINE_OPTIONS)
    try:
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        results = [llm.generate_async(f"prompt {i}", long, streaming=i % 2 == 0) for i in range(8)]
        call_with_timeout(lambda: next(iter(results[0])), 30)  # the engine is running them
        worker = llm.executor.engine_pid
        postprocess = worker_pids(module=POSTPROCESS_MODULE)
        assert len(postprocess) == 2
        os.kill(postprocess[1], signal.SIGKILL)
        for result in results:
            with pytest.raises(
                EngineDeadError, match=r"postprocess worker \d \(pid \d+\) was killed by signal 9"
            ):
                call_with_timeout(lambda r=result: r.result(timeout=10), 12)
        assert not llm.check_health()
        with pytest.raises(EngineDeadError):
            llm.generate_async("after", long)
        # The world is over: nothing of it goes on holding the model.
        assert wait_until(lambda: not pid_alive(worker) and not worker_pids(module=POSTPROCESS_MODULE), 10)
    finally:
        call_with_timeout(llm.shutdown, 15)


def test_postprocess_workers_need_the_proxy(tiny_model):
    with pytest.raises(ValueError, match="proxy"):
        LLM(tiny_model, executor="in-process", num_postprocess_workers=2)
    with pytest.raises(ValueError, match="num_postprocess_workers"):
        LLM(tiny_model, num_postprocess_workers=-1)


def test_the_worker_killed_takes_its_postprocess_workers_with_it(tiny_model):
    llm = LLM(tiny_model, num_postprocess_workers=2, **ENGINE_OPTIONS)
    try:
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        results = [llm.generate_async(f"prompt {i}", long, streaming=True) for i in range(4)]
        call_with_timeout(lambda: next(iter(results[0])), 30)
        os.kill(llm.executor.engine_pid, signal.SIGKILL)
        for result in results:
            with pytest.raises(EngineDeadError, match=r"worker process \d+ was killed by signal 9"):
                call_with_timeout(lambda r=result: r.result(timeout=10), 12)
        # Before any shutdown: nothing of the dead world waits on.
        assert wait_until(lambda: not worker_pids(module=POSTPROCESS_MODULE), 10)
    finally:
        call_with_timeout(llm.shutdown, 15)


@pytest.mark.slow  # worker and postprocess processes started, slept and woken
def test_sleep_and_wakeup_pass_through_postprocess_workers_after_the_responses_before_them(tiny_model):
    """A transition's result goes down every lane behind the responses the engine sent first: a
    drain's sleep returns only once every request it drained, on either worker, has ended."""
    with LLM(tiny_model, num_postprocess_workers=2, **ENGINE_OPTIONS) as llm:
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        before = llm.generate(PROMPTS[0], params)[0].outputs[0].text
        results = [llm.generate_async(f"drained {i}", params, streaming=True) for i in range(4)]
        call_with_timeout(lambda: next(iter(results[0])), 30)  # the engine is running them
        slept = call_with_timeout(lambda: llm.sleep(1, "drain"), 120)
        assert slept.admission == "parked" and slept.num_aborted == 0
        assert all(result.finished for result in results)  # both lanes' last words came first
        for result in results:
            output = result.result(timeout=0)
            assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == 48
        assert llm.admission_state == "parked"
        woken = call_with_timeout(llm.wake_up, 120)
        assert woken.admission == "running"
        assert llm.generate(PROMPTS[0], params)[0].outputs[0].text == before


# Long enough that the drained requests still run when the sleep starts.
DRAINED = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
SWAPPED = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SWAP_PROMPTS = ("rivers and stars", "bread in the rain", "owls over glass", "maps of engines")


def texts_of(model, params: SamplingParams) -> dict[str, str]:
    """What `model` answers to each of SWAP_PROMPTS, detokenized in the caller's process."""
    with LLM(model, executor="in-process", **ENGINE_OPTIONS) as reference:
        outputs = reference.generate(list(SWAP_PROMPTS), params)
    return {prompt: output.outputs[0].text for prompt, output in zip(SWAP_PROMPTS, outputs)}


@pytest.mark.slow  # worker and postprocess processes started, slept and woken
def test_a_wakeup_with_another_tokenizer_swaps_it_in_every_postprocess_worker(tiny_model, tmp_path):
    """A revision with another vocabulary (its ids read as other words to the first one's
    tokenizer): the requests the sleep drains end with the tokenizer they began with; after the
    wakeup every output, whichever worker carries it, is the revision's own (its tokenizer in,
    its weights, its tokenizer out); a wakeup the engine refuses leaves every worker the
    tokenizer it had; and a swap back serves the first revision's texts again."""
    revision = reversed_vocabulary(tiny_model, 7, tmp_path / "revision")
    misfit = reversed_vocabulary(tiny_model, 7, tmp_path / "misfit", hidden_size=96)
    texts = {model: texts_of(model, SWAPPED) for model in (tiny_model, revision)}
    assert all(texts[revision][p] != texts[tiny_model][p] for p in SWAP_PROMPTS)  # they tell apart
    drained_texts = texts_of(tiny_model, DRAINED)

    def served() -> dict[str, str]:
        outputs = call_with_timeout(lambda: llm.generate(list(SWAP_PROMPTS), SWAPPED), 60)
        return {prompt: output.outputs[0].text for prompt, output in zip(SWAP_PROMPTS, outputs)}

    with LLM(tiny_model, num_postprocess_workers=2, **ENGINE_OPTIONS) as llm:
        workers = worker_pids(module=POSTPROCESS_MODULE)
        assert len(workers) == 2
        assert served() == texts[tiny_model]
        drained = [llm.generate_async(p, DRAINED, streaming=True) for p in SWAP_PROMPTS]
        call_with_timeout(lambda: next(iter(drained[0])), 30)  # the engine is running them
        slept = call_with_timeout(lambda: llm.sleep(2, "drain"), 120)
        assert slept.num_aborted == 0
        assert {p: r.result(timeout=0).outputs[0].text for p, r in zip(SWAP_PROMPTS, drained)} == (
            drained_texts
        )
        assert call_with_timeout(lambda: llm.wake_up(revision), 120).admission == "running"
        assert served() == texts[revision]
        # Refused (other shapes): the engine stays parked with its weights, every worker with its
        # tokenizer, and the plain wakeup after it serves the revision as before.
        call_with_timeout(lambda: llm.sleep(2), 120)
        with pytest.raises(TransitionError) as refused:
            call_with_timeout(lambda: llm.wake_up(misfit), 120)
        assert refused.value.code == "invalid_model" and llm.admission_state == "parked"
        assert call_with_timeout(llm.wake_up, 120).admission == "running"
        assert served() == texts[revision]
        call_with_timeout(lambda: llm.sleep(2), 120)
        assert call_with_timeout(lambda: llm.wake_up(tiny_model), 120).admission == "running"
        assert served() == texts[tiny_model]
        # The same processes all along: swapped in place, not restarted.
        assert worker_pids(module=POSTPROCESS_MODULE) == workers
