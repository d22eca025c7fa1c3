"""Which sequences run in the next step, and how many of their tokens.

Budgets per step: `max_batch_size` running sequences and `max_num_tokens` tokens. Running
sequences go first, most important first (arrival order, or priority then arrival); each
takes the tokens it has not computed yet, up to the budget left (chunked prefill; without
it, all of them or none this step). When the KV pool cannot hold a running sequence's next
tokens, the least important running sequence is preempted (its blocks freed, recomputed
later) until it can. Waiting groups are admitted only in steps without preemption, and not
while an enqueue window (`enqueue_window.py`) holds them.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from berth.engine.pyexecutor.enqueue_window import EnqueueWindow
from berth.engine.pyexecutor.kv_cache import KVCacheManager
from berth.engine.pyexecutor.sequence import Sequence, SequenceState
from berth.engine.pyexecutor.waiting_queue import Group, WaitingQueue, create_waiting_queue


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_batch_size: int,
        max_num_tokens: int,
        policy: str = "fcfs",
        enable_chunked_prefill: bool = True,
        window: EnqueueWindow | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: WaitingQueue = create_waiting_queue(policy)
        self.running: list[Sequence] = []  # most important first
        # Sequences that hold blocks and wait for something outside (their KV from another engine).
        self.pending: set[Sequence] = set()
        self._by_priority = policy == "priority"
        self.window = window

    def _importance(self, sequence: Sequence) -> tuple[float, int]:
        """Sort key: smaller is more important (scheduled first, preempted last)."""
        return (-sequence.priority if self._by_priority else 0.0, sequence.arrival_order)

    @property
    def num_waiting(self) -> int:
        return sum(len(group) for group in self.waiting)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.pending)

    def add(self, group: Group) -> None:
        if self.window is not None and not len(self.waiting):
            self.window.open()  # only a request nothing waits ahead of opens one
        self.waiting.append(list(group))

    def add_running(self, sequence: Sequence) -> None:
        """A sequence whose prompt is computed already (its KV came from another engine)."""
        bisect.insort(self.running, sequence, key=self._importance)

    def seconds_to_wait(self) -> float | None:
        """How long the loop may wait for new requests before stepping: 0 when something can step
        now, until the enqueue window closes when it holds every sequence there is, None when
        there is nothing to step (no sequence, or only pending ones)."""
        if self.running:
            return 0.0
        if len(self.waiting):
            return self.window.seconds_left() if self.window is not None else 0.0
        return None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_tokens
        for sequence in list(self.running):
            if budget == 0:
                break
            if sequence.state is SequenceState.WAITING:
                continue  # preempted earlier in this step
            num_new = self._tokens_to_compute(sequence, sequence.num_computed_tokens, budget)
            if num_new == 0 or not self._make_room(sequence, num_new, out):
                continue
            out.scheduled.append((sequence, num_new))
            budget -= num_new
        if not out.preempted and not self._window_holds():
            self._admit_waiting(out, budget)
        now = time.time()
        for sequence, _ in out.scheduled:
            if sequence.first_scheduled_time is None:
                sequence.first_scheduled_time = now
        return out

    def _window_holds(self) -> bool:
        if self.window is None or not self.window.is_open:
            return False
        held = [sequence for group in self.waiting for sequence in group]
        if not held:  # aborted while held
            self.window.close()
            return False
        tokens = sum(s.num_tokens - s.num_computed_tokens for s in held) + len(self.running)
        return self.window.holds(len(self.running) + len(held), tokens)

    def _tokens_to_compute(self, sequence: Sequence, num_computed: int, budget: int) -> int:
        """How many of the sequence's uncomputed tokens this step takes: all of them if the budget
        allows, else as many as it allows (chunked prefill) or none (without chunking, a step
        holds a whole sequence: the engine's max_num_tokens is at least max_model_len)."""
        remaining = sequence.num_tokens - num_computed
        if remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill else 0

    def _make_room(self, sequence: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Preempts the least important running sequences until `sequence` fits; False if it was
        itself preempted."""
        while not self.kv_cache.try_allocate(sequence, num_new):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is sequence:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admits waiting groups, first in line first, while seats, tokens and blocks allow.

        A group's sequences take their seats together, or none does. Each starts from its cached
        prefix (so an `n > 1` request's later sequences reuse the blocks of the prompt its
        first one is computing). The first must get the blocks of its first chunk now, or the
        group waits; the others take theirs now if the pool has them, else in later steps like
        any running sequence. So a group never waits for a pool its sequences could fill one
        after the other.
        """
        kv = self.kv_cache
        while len(self.waiting) and budget > 0:
            group = self.waiting.peek()
            if len(self.running) + len(group) > self.max_batch_size:
                return
            for index, sequence in enumerate(group):
                prefix = kv.cached_prefix(sequence)
                num_new = self._tokens_to_compute(sequence, len(prefix) * kv.block_size, budget)
                if kv.free_blocks_to_admit(prefix, num_new) > kv.pool.num_free or num_new == 0:
                    if index == 0:
                        return  # nothing taken yet: the whole group waits for room
                    num_new = 0
                    if kv.free_blocks_to_admit(prefix, 0) > kv.pool.num_free:
                        prefix = []
                if index == 0:
                    self.waiting.pop()
                kv.admit(sequence, prefix)
                kv.try_allocate(sequence, num_new)  # fits: checked above
                sequence.state = SequenceState.CONTEXT_IN_PROGRESS
                bisect.insort(self.running, sequence, key=self._importance)
                if num_new:
                    out.scheduled.append((sequence, num_new))
                    budget -= num_new

    def preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self.kv_cache.free(sequence)
        sequence.reset_for_recompute()
        self.waiting.prepend([sequence])

    def remove(self, sequence: Sequence) -> None:
        """Takes a finished or aborted sequence out of the running set or the waiting queue."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.pending:
            self.pending.discard(sequence)
        else:
            for group in self.waiting:
                if sequence in group:
                    group.remove(sequence)
                    if not group:
                        self.waiting.remove(group)
                    break
        self.kv_cache.free(sequence)
