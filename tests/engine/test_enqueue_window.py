"""The enqueue window (`--batch-wait-timeout-ms`, `--batch-wait-max-tokens-ratio`): off by
default; holds new requests until the batch fills, the token ratio is reached or the timeout
passes, never longer; running sequences keep stepping meanwhile."""

from __future__ import annotations

import threading

import pytest
import torch

from berth.engine.config import EngineConfig
from berth.engine.executor import GenerationRequest
from berth.engine.pyexecutor.enqueue_window import EnqueueWindow
from berth.engine.pyexecutor.kv_cache import KVCacheManager
from berth.engine.pyexecutor.py_executor import PyExecutor
from berth.engine.pyexecutor.scheduler import Scheduler
from berth.engine.pyexecutor.sequence import Sequence, SequenceState
from berth.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(clock: Clock, timeout: float = 0.05, max_batch_size: int = 4, ratio: float = 0.0):
    kv = KVCacheManager(64, 4, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    window = EnqueueWindow(timeout, max_batch_size=max_batch_size, max_tokens=ratio * 64, clock=clock)
    return Scheduler(kv, max_batch_size=max_batch_size, max_num_tokens=64, window=window)


def group(num_prompt_tokens: int = 3, n: int = 1) -> list[Sequence]:
    members: list[Sequence] = []
    for index in range(n):
        members.append(
            Sequence(
                1, index, list(range(1, num_prompt_tokens + 1)), GREEDY, priority=0.5, max_tokens=4,
                arrival_time=0.0, group=members,
            )
        )  # fmt: skip
    return members


def scheduled(scheduler: Scheduler) -> list[Sequence]:
    return [sequence for sequence, _ in scheduler.schedule().scheduled]


def test_off_by_default_admits_at_once():
    kv = KVCacheManager(64, 4, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    scheduler = Scheduler(kv, max_batch_size=4, max_num_tokens=64)
    scheduler.add(group())
    assert len(scheduled(scheduler)) == 1
    assert EngineConfig(model="m").batch_wait_timeout_ms == 0


def test_a_lone_request_waits_out_the_timeout_and_never_longer():
    clock = Clock()
    scheduler = make_scheduler(clock, timeout=0.05)
    scheduler.add(first := group())
    assert scheduled(scheduler) == []
    assert scheduler.seconds_to_wait() == pytest.approx(0.05)
    clock.now += 0.03
    scheduler.add(second := group())  # joins the open window, which keeps its deadline
    assert scheduled(scheduler) == []
    assert scheduler.seconds_to_wait() == pytest.approx(0.02)
    clock.now += 0.02  # exactly the timeout after the first arrival
    assert scheduled(scheduler) == first + second
    assert scheduler.seconds_to_wait() == 0


def test_a_full_batch_closes_the_window_before_the_timeout():
    clock = Clock()
    scheduler = make_scheduler(clock, timeout=10.0, max_batch_size=4)
    scheduler.add(group(n=2))
    scheduler.add(group())
    assert scheduled(scheduler) == []
    scheduler.add(group())  # 4 sequences: the batch is full
    assert len(scheduled(scheduler)) == 4
    assert clock.now == 100.0


def test_the_token_ratio_closes_the_window_before_the_timeout():
    clock = Clock()
    scheduler = make_scheduler(clock, timeout=10.0, max_batch_size=8, ratio=0.5)  # 32 of 64 tokens
    scheduler.add(group(num_prompt_tokens=20))
    assert scheduled(scheduler) == []
    scheduler.add(group(num_prompt_tokens=12))
    assert [s.num_prompt_tokens for s in scheduled(scheduler)] == [20, 12]


def test_running_sequences_keep_stepping_while_the_window_holds_new_ones():
    clock = Clock()
    scheduler = make_scheduler(clock, timeout=0.05, max_batch_size=4)
    scheduler.add(running := group())
    clock.now += 0.05
    assert scheduled(scheduler) == running
    running[0].num_computed_tokens = running[0].num_tokens
    running[0].token_ids.append(7)  # now decoding
    scheduler.add(new := group())
    for _ in range(3):
        assert scheduled(scheduler) == running  # decode goes on; the new one is held
        running[0].num_computed_tokens = running[0].num_tokens
        running[0].token_ids.append(7)
    assert scheduler.seconds_to_wait() == 0  # something runs: the loop does not block
    clock.now += 0.05
    assert scheduled(scheduler) == running + new


def test_a_request_left_waiting_for_room_does_not_reopen_the_window():
    clock = Clock()
    scheduler = make_scheduler(clock, timeout=0.05, max_batch_size=1)
    scheduler.add(first := group())
    assert scheduled(scheduler) == first  # a full batch of one: no wait
    scheduler.add(second := group())  # no seat: waits for one, the window stays shut
    assert scheduled(scheduler) == first
    scheduler.remove(first[0])
    scheduler.add(third := group())  # behind `second`: opens nothing either
    assert scheduled(scheduler) == second
    assert third[0].state is SequenceState.WAITING


def test_the_engine_loop_blocks_in_the_window_and_starts_the_batch_together(tiny_model):
    """Through the real loop: a lone request is held (the loop blocks, it does not spin) until
    two more arrive and fill the batch; the three prefill in one step."""
    engine = PyExecutor.from_config(
        EngineConfig(model=str(tiny_model), max_batch_size=3, kv_cache_blocks=32, batch_wait_timeout_ms=1000)
    )

    def submit(request_id: int) -> None:
        request = GenerationRequest([5, 6, 7], GREEDY)
        request.request_id = request_id
        engine.request_queue.enqueue_request(request)

    submit(1)
    assert engine.iterate() == [] and engine.num_steps == 0  # held
    late = threading.Timer(0.05, lambda: (submit(2), submit(3)))
    late.start()
    for _ in range(10):  # each turn blocks until a late one arrives (or the window closes)
        engine.iterate()
        if engine.num_steps:
            break
    late.join()
    assert engine.num_steps == 1
    assert sorted(len(s.token_ids) for g in engine._active.values() for s in g) == [4, 4, 4]
    while engine.scheduler.has_work():
        engine.iterate()
    assert engine.kv_cache.pool.num_used == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_wait_timeout_ms": -1}, "batch_wait_timeout_ms must be in"),
        ({"batch_wait_timeout_ms": 5000}, "batch_wait_timeout_ms must be in"),
        ({"batch_wait_timeout_ms": 600, "stall_timeout": 1.0}, "under half the stall timeout"),
        ({"batch_wait_timeout_ms": 10, "batch_wait_max_tokens_ratio": 1.5}, "ratio must be in"),
        ({"batch_wait_max_tokens_ratio": 0.5}, "needs batch_wait_timeout_ms > 0"),
    ],
)
def test_bad_window_settings_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **options)
