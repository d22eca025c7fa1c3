"""A stalled engine is a dead engine: a worker stopped with SIGSTOP (alive, silent) or a rank of a
tensor-parallel world that stops answering its collectives is declared dead within the stall
timeout, every pending request gets `EngineDeadError`, and the engine stays dead when the
process resumes. An engine that is only slow to answer (non-streamed requests, no response for
many steps) keeps reporting its steps and is not taken for stalled."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time

import pytest

from berth.engine import LLM, SamplingParams
from berth.engine.executor import EngineDeadError
from berth.engine.executor.errors import EngineStalledError
from berth.engine.models.tiny_model import make_tiny_model
from tests.support.engine_processes import call_with_timeout, no_world_outlives, pid_alive, wait_until
from tests.support.hung_file import HungFile

STALL_TIMEOUT = 3.0
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
ENGINE = {"max_batch_size": 8, "kv_cache_blocks": 256, "stall_timeout": STALL_TIMEOUT}


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the stalled world may have been killed
        os.kill(pid, signal.SIGCONT)


def stop_mid_batch(llm: LLM, pid: int) -> tuple[list, float]:
    """Starts a batch (one streamed request shows it runs), then stops `pid`."""
    results = [llm.generate_async([5 + i] * (3 + i), LONG, streaming=i == 0) for i in range(4)]
    first = iter(results[0])
    call_with_timeout(lambda: next(first), 60)
    assert wait_until(lambda: llm.executor.stats.num_steps > 1, 30), "the first step is done"
    os.kill(pid, signal.SIGSTOP)
    return results, time.monotonic()


def expect_dead_within(result, stopped_at: float, bound: float) -> float:
    with pytest.raises(EngineDeadError, match="stalled"):
        result.result(timeout=bound + 10)
    return time.monotonic() - stopped_at


def test_a_stopped_worker_is_declared_stalled_and_stays_dead(tiny_model):
    llm = LLM(tiny_model, executor="proxy", **ENGINE)
    pid = llm.executor.engine_pid
    try:
        results, stopped_at = stop_mid_batch(llm, pid)
        waits = [
            call_with_timeout(lambda r=r: expect_dead_within(r, stopped_at, STALL_TIMEOUT), 30)
            for r in results
        ]
        # The watchdog checks twice a second at most: timeout + its interval + the machine's noise.
        assert max(waits) < STALL_TIMEOUT + 5, waits
        error = llm.executor.fatal_error
        assert isinstance(error, EngineStalledError)
        message = str(error)
        assert f"no step completed in {STALL_TIMEOUT:g} s" in message
        assert "requests running" in message and "the last step ended at" in message
        assert f"rank 0 (pid {pid}) is stopped (SIGSTOP)" in message
        resume(pid)
        for _ in range(5):  # sticky: a resumed engine is not trusted again
            assert not llm.check_health()
            time.sleep(0.2)
        assert llm.executor.admission_state == "failed"
        with pytest.raises(EngineDeadError):
            llm.generate_async([5, 6], LONG)
    finally:
        resume(pid)
        llm.shutdown()


@pytest.mark.slow  # waits out a stall deadline
def test_an_engine_that_answers_nobody_for_a_while_is_not_stalled(tmp_path):
    """Non-streamed requests get nothing until they finish; the engine's heartbeats carry its
    steps meanwhile, so a batch that runs for many stall timeouts lives. The batch is long
    enough (3000 steps, seconds on any machine: 1500 ended in 0.9 s on a quiet one) to need them:
    nothing answers anyone for longer than the stall timeout, and every check below runs on every
    machine. The waits are long: beside busy processes 3000 steps of 8 sequences took minutes."""
    timeout, tokens = 1.0, 3000
    model = make_tiny_model(tmp_path / "long", max_position_embeddings=tokens + 16)
    engine = ENGINE | {"stall_timeout": timeout, "kv_cache_blocks": 8 * (tokens + 16) // 16}
    with LLM(model, executor="proxy", **engine) as llm:
        many = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        results = [llm.generate_async([7 + i] * 4, many) for i in range(8)]  # one batch, no preemption
        started = time.monotonic()
        steps_seen = {llm.executor.stats.num_steps}
        while not any(result.finished for result in results) and time.monotonic() - started < 120:
            steps_seen.add(llm.executor.stats.num_steps)
            time.sleep(0.05)
        unanswered = time.monotonic() - started
        outputs = [call_with_timeout(lambda r=r: r.result(timeout=120), 130) for r in results]
        assert llm.check_health(), llm.executor.fatal_error
    assert all(len(output.outputs[0].token_ids) == tokens for output in outputs)
    assert unanswered > timeout, f"answered after {unanswered:.1f} s: too soon to need a heartbeat"
    assert len(steps_seen) > 2, steps_seen  # the steps were heard while nobody was answered


def test_a_stopped_follower_rank_stalls_its_world_and_is_named(tiny_model):
    llm = LLM(tiny_model, tensor_parallel_size=2, **ENGINE)
    (identity,) = llm.executor.identities
    ranks = {rank: pid for rank, pid, _ in identity.world}
    try:
        results, stopped_at = stop_mid_batch(llm, ranks[1])
        waits = [
            call_with_timeout(lambda r=r: expect_dead_within(r, stopped_at, STALL_TIMEOUT), 30)
            for r in results
        ]
        assert max(waits) < STALL_TIMEOUT + 5, waits
        message = str(llm.executor.fatal_error)
        assert message.startswith("stalled:"), message
        assert f"rank 1 (pid {ranks[1]}) is stopped (SIGSTOP)" in message
        resume(ranks[1])
        assert not llm.check_health()
    finally:
        resume(ranks[1])
        llm.shutdown()
    no_world_outlives()


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_wakeup_whose_weights_never_open_is_declared_stalled_at_its_deadline(
    tiny_model, tmp_path, tensor_parallel_size
):
    """A level-2 wakeup reloads the weights; opening them never returns (`HungFile`: a hung
    mount). An engine in a transition has no requests to stall on: the transition's own
    deadline kills it, names it, and the world (every rank) is killed."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    deadline = 3.0
    llm = LLM(model, tensor_parallel_size=tensor_parallel_size, transition_timeout=deadline, **ENGINE)
    ranks = [pid for _, pid, _ in llm.executor.ranks]
    try:
        assert llm.sleep(level=2).admission == "parked"
        with HungFile(model / "model.safetensors"):
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match="stalled"):
                call_with_timeout(llm.wake_up, deadline + 30)
            took = time.monotonic() - started
            assert deadline <= took < deadline + 5, took
            message = str(llm.executor.fatal_error)
            assert isinstance(llm.executor.fatal_error, EngineStalledError), message
            assert message.startswith(f"stalled: the wakeup did not complete in {deadline:g} s"), message
            assert all(f"(pid {pid} " in message for pid in ranks), message
            assert wait_until(lambda: not any(pid_alive(pid) for pid in ranks), 10), "a rank outlived it"
            assert not llm.check_health()
    finally:
        llm.shutdown()
    no_world_outlives()


def test_stall_timeouts_are_checked_and_the_first_step_gets_longer():
    from berth.engine import EngineConfig

    config = EngineConfig(model="m", stall_timeout=10)
    assert (config.first_step_bound, config.collective_timeout) == (50, 5)
    assert EngineConfig(model="m", stall_timeout=10, first_step_timeout=7).first_step_bound == 7
    for bad in ({"stall_timeout": 0}, {"stall_timeout": True}, {"first_step_timeout": -1}):
        with pytest.raises(ValueError, match="must be a positive number of seconds"):
            EngineConfig(model="m", **bad)


@pytest.mark.slow  # waits out a stall deadline
def test_the_first_step_after_load_gets_the_longer_bound(tiny_model):
    """A worker stopped before its first step: silent for three stall timeouts, it is still given
    the first step's bound, and is declared stalled only past it, saying which bound it broke."""
    first_step = 6.0
    llm = LLM(
        tiny_model, executor="proxy", **(ENGINE | {"stall_timeout": 1.0, "first_step_timeout": first_step})
    )
    pid = llm.executor.engine_pid
    try:
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        result = llm.generate_async([5, 6, 7], LONG)
        time.sleep(3.0)
        assert llm.check_health(), llm.executor.fatal_error
        waited = call_with_timeout(lambda: expect_dead_within(result, stopped_at, first_step), 30)
        assert first_step - 0.5 <= waited < first_step + 5, waited
        message = str(llm.executor.fatal_error)
        assert message.startswith(
            f"stalled: the first step after load or wakeup did not complete in {first_step:g} s"
        )
    finally:
        resume(pid)
        llm.shutdown()


@pytest.mark.parametrize("executor", ["proxy", "in-process"])
def test_a_load_reports_its_progress_and_checks_the_model_before_it_serves(tiny_model, executor):
    seen: list = []
    with LLM(tiny_model, executor=executor, kv_cache_blocks=64, on_progress=seen.append) as llm:
        steps = [progress.step for progress in seen]
        (output,) = llm.generate([[5, 6]], SamplingParams(max_tokens=2))
        assert output.outputs[0].token_ids
    # Weights first (bytes read, up to all of them), then the profiled step, then one token.
    first = steps.index("loading weights")
    assert steps[first:] == ["loading weights"] * (len(steps) - first - 2) + [
        "sizing the KV cache",
        "checking the model",
    ]
    weights = [progress for progress in seen if progress.step == "loading weights"]
    assert weights[-1].done == weights[-1].total > 0 and weights[-1].fraction == 1.0


def test_weights_that_give_no_finite_logits_never_serve(tiny_model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    poisoned = tmp_path / "poisoned"
    shutil.copytree(tiny_model, poisoned)
    weights = load_file(poisoned / "model.safetensors")
    name = next(key for key in weights if key.endswith("self_attn.o_proj.weight"))
    weights[name][:, 0] = float("inf")
    save_file(weights, poisoned / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="failed its check after loading: the model's logits are not fin"):
        LLM(poisoned, executor="in-process", kv_cache_blocks=64)


def test_a_clock_stepped_back_does_not_make_fresh_stats_look_stale(tiny_model, monkeypatch):
    """Stats are ordered by their sequence number, not the wall clock: with the clock stepped
    back an hour mid-batch (an NTP correction), the engine's next snapshots are still the latest,
    its steps are heard and it is not taken for stalled. In one process, so that the engine's
    clock is the one stepped (the wall clock of this process only: the machine's is left alone)."""
    with LLM(tiny_model, executor="in-process", **(ENGINE | {"stall_timeout": 1.0})) as llm:
        many = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        result = llm.generate_async([5, 6, 7], many, streaming=True)
        stream = iter(result)
        call_with_timeout(lambda: next(stream), 60)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 3600)
        stepped = llm.executor.stats.num_steps
        assert wait_until(lambda: llm.executor.stats.num_steps >= stepped + 10, 10), llm.executor.stats
        output = call_with_timeout(lambda: result.result(timeout=60), 70)
        assert len(output.outputs[0].token_ids) == 1000
        assert llm.check_health(), llm.executor.fatal_error
