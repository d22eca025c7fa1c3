"""Sleep and wakeup in the engine loop, driven one turn at a time: drain, drain timeout and
abort mode; what each level releases; a wakeup that restores, one that swaps in another
revision, one that is refused (the engine stays parked and wakes with what it had), one that
fails (the engine is then dead); and a two-rank world where one rank's outcome decides."""

from __future__ import annotations

import queue
import shutil
import threading
from dataclasses import replace

import pytest
import torch

from berth.engine.config import EngineConfig
from berth.engine.engine_io import GenerationRequest, Sleep, TransitionResult, Wakeup
from berth.engine.models.tiny_model import make_tiny_model
from berth.engine.pyexecutor.py_executor import PyExecutor
from berth.engine.pyexecutor.request_queue import AdmissionState
from berth.engine.sampling_params import SamplingParams
from tests.engine.conftest import poisoned_copy

GREEDY = SamplingParams(temperature=0, max_tokens=6)
ENDLESS = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 140))]


def make_engine(model, **options) -> PyExecutor:
    return PyExecutor.from_config(
        EngineConfig(model=str(model), kv_cache_blocks=64, max_batch_size=8, **options)
    )


def submit(engine: PyExecutor, request_id: int, prompt, params=GREEDY) -> None:
    engine.request_queue.enqueue_request(GenerationRequest(list(prompt), params, request_id=request_id))


def drive(engine: PyExecutor, until, max_turns: int = 2000) -> list:
    responses = []
    for _ in range(max_turns):
        if until():
            return responses
        responses += engine.iterate()
    raise AssertionError(
        f"not done after {max_turns} turns (admission {engine.request_queue.admission_state})"
    )


def generate(engine: PyExecutor, prompts=PROMPTS, first_id: int = 1) -> list[list[int]]:
    for offset, prompt in enumerate(prompts):
        submit(engine, first_id + offset, prompt)
    responses = drive(engine, lambda: not engine.scheduler.has_work() and engine.request_queue.empty())
    by_request = {first_id + i: [] for i in range(len(prompts))}
    for response in responses:
        by_request[response.request_id] += response.token_ids
    return list(by_request.values())


def transition(engine: PyExecutor, control):
    engine.request_queue.enqueue_control(control)
    responses = drive(engine, lambda: bool(engine.finished_transitions))
    return engine.finished_transitions.pop(0), responses


def test_a_drained_sleep_lets_every_request_finish_then_frees_the_kv_cache(tiny_model):
    engine = make_engine(tiny_model)
    for request_id, prompt in enumerate(PROMPTS, 1):
        submit(engine, request_id, prompt)
    engine.iterate()  # they run
    result, responses = transition(engine, Sleep(level=1, drain_timeout=600, transition_id=5))
    finished = [r for r in responses if r.finish_reason is not None]
    assert sorted(r.request_id for r in finished) == [1, 2, 3]
    assert {r.finish_reason for r in finished} <= {"stop", "length"}
    assert result.transition_id == 5 and result.error is None and result.num_aborted == 0
    assert result.admission == "parked" and engine.request_queue.admission_state is AdmissionState.PARKED
    assert result.memory_before.kv_cache_bytes == engine.kv_cache.nbytes > 0
    # Level 1 on a CPU frees the KV cache only: host memory is where the weights live.
    assert result.memory_after.kv_cache_bytes == 0 and not engine.kv_cache.is_allocated
    assert result.memory_after.weight_bytes == result.memory_before.weight_bytes > 0
    assert result.stats.admission == "parked" and result.stats.sleep_level == 1


def test_a_drain_that_outlasts_its_timeout_aborts_the_rest_saying_why(tiny_model):
    engine = make_engine(tiny_model)
    for request_id, prompt in enumerate(PROMPTS, 1):
        submit(engine, request_id, prompt, ENDLESS)
    engine.iterate()
    result, responses = transition(engine, Sleep(level=1, drain_timeout=0))
    ends = [r for r in responses if r.finish_reason is not None]
    assert sorted(r.request_id for r in ends) == [1, 2, 3] and {r.finish_reason for r in ends} == {"abort"}
    assert all("drain timeout (0 s) passed" in r.stop_reason for r in ends)
    assert result.num_aborted == 3 and result.admission == "parked"
    assert engine.kv_cache.pool.num_used == 0 and not engine.scheduler.has_work()


def test_abort_mode_aborts_at_once(tiny_model):
    engine = make_engine(tiny_model)
    for request_id, prompt in enumerate(PROMPTS, 1):
        submit(engine, request_id, prompt, ENDLESS)
    engine.iterate()
    engine.request_queue.enqueue_control(Sleep(level=1, mode="abort", drain_timeout=600))
    responses = engine.iterate()  # the turn that takes it up aborts: no waiting for the 600 s drain
    assert {r.request_id for r in responses if r.finish_reason == "abort"} == {1, 2, 3}
    assert all("mode abort" in r.stop_reason for r in responses if r.finish_reason)
    assert engine.iterate() == []  # the next one ends the drain: nothing is left
    assert not engine.finished_transitions  # memory goes in a turn of its own, after the responses
    assert engine.iterate() == []  # and the one after it parks
    assert engine.finished_transitions.pop().num_aborted == 3


@pytest.mark.parametrize("level", [1, 2])
def test_a_wakeup_restores_the_engine_and_its_greedy_outputs(tiny_model, level):
    engine = make_engine(tiny_model)
    before = generate(engine)
    slept, _ = transition(engine, Sleep(level=level))
    if level == 2:  # the weights are dropped: nothing holds them any more
        assert engine.model_runner.model is None and slept.memory_after.weight_bytes == 0
    woken, _ = transition(engine, Wakeup())
    assert woken.admission == "running" and woken.error is None
    assert woken.memory_after.kv_cache_bytes > 0 and woken.memory_after.weight_bytes > 0
    assert engine.kv_cache.pool.num_cached == 0  # the cache's contents went with its memory
    assert generate(engine, first_id=10) == before
    assert woken.stats.transitions == {"parking": 1, "parked": 1, "waking": 1, "running": 1}


def test_a_new_revision_serves_after_wakeup_from_an_empty_prefix_cache(tiny_model, tmp_path):
    other = tmp_path / "seed-7"
    make_tiny_model(other, seed=7)
    engine = make_engine(tiny_model)
    first = engine.memory.revision
    generate(engine)  # caches the prompts' blocks under the first model's weights
    expected = generate(make_engine(other))
    transition(engine, Sleep(level=1))
    woken, _ = transition(engine, Wakeup(model=str(other)))
    assert woken.model_revision.path == str(other)
    assert woken.model_revision.digest != first.digest  # same config and file sizes, other weights
    hits = engine.kv_cache.prefix_cache_hits
    assert generate(engine, first_id=20) == expected  # not the first model's cached keys and values
    assert engine.kv_cache.prefix_cache_hits == hits
    assert engine.memory.revision.path == str(other) and engine.config.model == str(tiny_model)


def test_a_revision_of_other_shapes_is_refused_and_the_engine_can_wake_with_its_own(tiny_model, tmp_path):
    narrow = tmp_path / "narrow"
    make_tiny_model(narrow, hidden_size=32, seed=3)
    engine = make_engine(tiny_model)
    before = generate(engine)
    revision = engine.memory.revision
    for level in (1, 2):
        transition(engine, Sleep(level=level))
        for bad in (narrow, tmp_path / "missing"):
            refused, _ = transition(engine, Wakeup(model=str(bad)))
            assert refused.error.code == "invalid_model" and refused.admission == "parked"
            assert "still parked" in str(refused.error)
            assert engine.request_queue.admission_state is AdmissionState.PARKED
        assert "hidden_size 32 (serving: 64)" in str(transition_error(engine, narrow))
        woken, _ = transition(engine, Wakeup())
        assert woken.admission == "running" and woken.model_revision == revision
        assert generate(engine, first_id=level * 10) == before


def transition_error(engine: PyExecutor, model) -> Exception:
    refused, _ = transition(engine, Wakeup(model=str(model)))
    return refused.error


def test_a_wakeup_that_cannot_restore_the_engine_leaves_it_failed(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    engine = make_engine(model)
    transition(engine, Sleep(level=2))
    (model / "model.safetensors").unlink()  # the weights to reload are gone
    engine.request_queue.enqueue_control(Wakeup())
    with pytest.raises(RuntimeError, match="wakeup failed: rank 0: FileNotFoundError"):
        drive(engine, lambda: False)
    assert engine.request_queue.admission_state is AdmissionState.FAILED


def test_a_wakeup_with_poisoned_weights_fails_its_check_and_the_engine(tiny_model, tmp_path):
    """Weights that load (right names, shapes, dtypes) but hold NaN: the one-token check after
    the wakeup finds the logits not finite, and the engine is FAILED instead of serving NaN."""
    poisoned = poisoned_copy(tiny_model, tmp_path / "poisoned")
    engine = make_engine(tiny_model)
    transition(engine, Sleep(level=1))
    engine.request_queue.enqueue_control(Wakeup(model=str(poisoned)))
    with pytest.raises(RuntimeError, match="wakeup failed its check: the model's logits are not finite"):
        drive(engine, lambda: False)
    assert engine.request_queue.admission_state is AdmissionState.FAILED


def test_a_shutdown_during_a_drain_ends_the_sleep(tiny_model):
    engine = make_engine(tiny_model)
    submit(engine, 1, PROMPTS[0], ENDLESS)
    engine.iterate()
    engine.request_queue.enqueue_control(Sleep(drain_timeout=600))
    engine.iterate()
    engine.request_queue.enqueue_shutdown()
    responses = drive(engine, lambda: bool(engine.finished_transitions))
    assert [r.finish_reason for r in responses if r.finish_reason] == ["abort"]
    refused = engine.finished_transitions.pop()
    assert refused.error is not None and "shutting down" in str(refused.error)
    assert engine.kv_cache.is_allocated  # nothing was released for a sleep that never came


# ---- a world of two ranks: rank 0 decides from every rank's outcome ------------------------------


class TwoRankWorld(PyExecutor):
    """Rank 0 of a two-rank world whose rank 1 is another engine in this process: every memory
    action runs on both, as a TP world's broadcast will make it (see `memory_actions`)."""

    follower: PyExecutor

    def memory_actions(self, action):
        return [self.memory.apply(action), replace(self.follower.memory.apply(action), rank=1)]


def two_rank_world(leader_model, follower_model) -> TwoRankWorld:
    world = TwoRankWorld.from_config(EngineConfig(model=str(leader_model), kv_cache_blocks=64))
    world.follower = make_engine(follower_model)
    return world


@pytest.mark.slow  # sleep and wakeup cycles of a real engine
def test_a_revision_one_rank_cannot_load_is_refused_on_every_rank(tiny_model, tiny_qwen2, tmp_path):
    other = tmp_path / "seed-7"
    make_tiny_model(other, seed=7)
    world = two_rank_world(tiny_model, tiny_qwen2)  # `other` fits rank 0's model, not rank 1's
    transition(world, Sleep(level=2))
    refused, _ = transition(world, Wakeup(model=str(other)))
    assert refused.error.code == "invalid_model" and "rank 1: ValueError" in str(refused.error)
    assert "rank 0" not in str(refused.error)
    # Rank 0 staged the new weights and dropped them again: neither rank serves anything new.
    assert world.model_runner.model is None and world.follower.model_runner.model is None
    assert world.memory.revision.path == str(tiny_model)
    woken, _ = transition(world, Wakeup())
    assert woken.admission == "running"
    assert world.kv_cache.is_allocated and world.follower.kv_cache.is_allocated
    assert world.model_runner.model is not None and world.follower.model_runner.model is not None


def test_one_rank_failing_to_release_fails_the_world(tiny_model):
    world = two_rank_world(tiny_model, tiny_model)
    submit(world.follower, 1, PROMPTS[0], ENDLESS)
    world.follower.iterate()  # rank 1 holds KV blocks: it cannot free its cache
    world.request_queue.enqueue_control(Sleep(level=1))
    with pytest.raises(RuntimeError, match="could not release memory for a sleep: rank 1: RuntimeError"):
        drive(world, lambda: False)
    assert world.request_queue.admission_state is AdmissionState.FAILED


def test_moving_weights_keeps_every_module_on_its_tensors_and_a_tied_head_tied(tiny_model):
    """The level-1 offload's mechanics (to host memory and back on a GPU), run here CPU to CPU."""
    from berth.engine.models.loader import load_model
    from berth.engine.pyexecutor.sleep import move_weights, tensor_bytes

    model = load_model(tiny_model)
    parameters = [id(p) for p in model.parameters()]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    move_weights(model, torch.device("cpu"))
    assert [id(p) for p in model.parameters()] == parameters
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    parameters_bytes = sum(p.nbytes for p in model.parameters())
    packed_bytes = sum(m.packed.nbytes for m in model.modules() if getattr(m, "packed", None) is not None)
    expected = parameters_bytes + packed_bytes + model.rope_cache.nbytes
    assert tensor_bytes(model, torch.device("cpu")) == expected
    assert tensor_bytes(model, torch.device("cuda")) == 0  # nothing of it is on a GPU


def test_every_state_a_transition_reaches_goes_out_in_the_stats(tiny_model):
    """What the proxy and attach frontends follow: the stats after each turn show parking,
    parked, waking (before the restore starts, however long it takes) and running, in order,
    and each transition's result comes after the stats of the turn that ended it."""
    engine = PyExecutor.launch(EngineConfig(model=str(tiny_model), kv_cache_blocks=64))
    out: queue.SimpleQueue = queue.SimpleQueue()
    engine.start(
        on_responses=lambda responses, stats: out.put(stats.admission),
        on_fatal=out.put,
        on_transition=out.put,
    )
    try:
        seen = []
        for control in (Sleep(level=2, transition_id=1), Wakeup(transition_id=2)):
            engine.request_queue.enqueue_control(control)
            while not isinstance(item := out.get(timeout=60), TransitionResult):
                assert isinstance(item, str), item
                seen.append(item)
            seen.append(f"result {item.admission}")
        assert seen == ["parking", "parked", "result parked", "waking", "running", "result running"]
    finally:
        engine.request_queue.enqueue_shutdown()
        assert engine.join(30)


def test_a_drains_last_responses_go_out_before_memory_is_released(tiny_model):
    """The release that follows a drain may take seconds (a GPU's weight offload): the drain's
    last tokens must not wait for it. Here the release blocks until the client has seen its
    request finish: it never sees that if the responses are held back behind the release."""
    from berth.engine import LLM
    from berth.engine.pyexecutor.sleep import ReleaseMemory

    with LLM(tiny_model, executor="in-process", kv_cache_blocks=64, max_batch_size=8) as llm:
        memory = llm.executor.engine.memory
        real_apply = memory.apply
        client_saw_the_end = threading.Event()
        release_waited: list[bool] = []

        def slow_release(action):
            if isinstance(action, ReleaseMemory):
                release_waited.append(client_saw_the_end.wait(10))
            return real_apply(action)

        memory.apply = slow_release  # instance attribute: this engine's release only
        result = llm.generate_async(PROMPTS[0], replace(ENDLESS, max_tokens=40), streaming=True)
        stream = iter(result)
        next(stream)  # running
        sleeping = threading.Thread(target=lambda: sleeping.outcome.append(llm.sleep(timeout=30)))
        sleeping.outcome = []
        sleeping.start()
        for output in stream:  # ends when the drain's last response arrives
            last = output
        assert last.outputs[0].finish_reason == "length"
        client_saw_the_end.set()
        sleeping.join(30)
        assert release_waited == [True], "the memory release began before the drain's last response went out"
        assert sleeping.outcome[0].admission == "parked"
        llm.wake_up()
