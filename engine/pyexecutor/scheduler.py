"""Which sequences run in the next step, and how many of their tokens.

Budgets per step: `max_batch_size` running sequences and `max_num_tokens` tokens. Running
sequences go first, most important first (arrival order, or priority then arrival); each
takes the tokens it has not computed yet, up to the budget left (chunked prefill). When the
KV pool cannot hold a running sequence's next tokens, the least important running sequence
is preempted (its blocks freed, recomputed later) until it can. Waiting groups are admitted
only in steps without preemption, whole or not at all.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from berth.engine.pyexecutor.kv_cache import KVCacheManager
from berth.engine.pyexecutor.llm_request import LlmRequest, RequestState
from berth.engine.pyexecutor.waiting_queue import Group, WaitingQueue, create_waiting_queue


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[LlmRequest, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[LlmRequest] = field(default_factory=list)

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
    ) -> None:
        self.kv_cache = kv_cache
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: WaitingQueue = create_waiting_queue(policy)
        self.running: list[LlmRequest] = []  # most important first
        self._by_priority = policy == "priority"

    def _importance(self, request: LlmRequest) -> tuple[float, int]:
        """Sort key: smaller is more important (scheduled first, preempted last)."""
        return (-request.priority if self._by_priority else 0.0, request.arrival_order)

    @property
    def num_waiting(self) -> int:
        return sum(len(group) for group in self.waiting)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def add(self, group: Group) -> None:
        self.waiting.append(list(group))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.state is RequestState.WAITING:
                continue  # preempted earlier in this step
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, num_new, out):
                continue
            out.scheduled.append((request, num_new))
            budget -= num_new
        if not out.preempted:
            self._admit_waiting(out, budget)
        now = time.time()
        for request, _ in out.scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return out

    def _make_room(self, request: LlmRequest, num_new: int, out: SchedulerOutput) -> bool:
        """Preempts the least important running sequences until `request` fits; False if it was
        itself preempted."""
        while not self.kv_cache.try_allocate(request, num_new):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while len(self.waiting) and budget > 0:
            group = self.waiting.peek()
            if len(self.running) + len(group) > self.max_batch_size:
                return
            plan, left = [], budget
            for request in group:
                num_new = min(request.num_tokens, left)
                if not self.enable_chunked_prefill and num_new < request.num_tokens:
                    num_new = 0  # the whole prompt or nothing: wait for a step with room
                plan.append((request, num_new))
                left -= num_new
            if left == budget:
                return
            blocks = sum(self.kv_cache.new_blocks_needed(r, n) for r, n in plan)
            if blocks > self.kv_cache.pool.num_free:
                return
            self.waiting.pop()
            for request, num_new in plan:
                self.kv_cache.try_allocate(request, num_new)
                request.state = RequestState.CONTEXT_IN_PROGRESS
                bisect.insort(self.running, request, key=self._importance)
                if num_new:
                    out.scheduled.append((request, num_new))
            budget = left

    def preempt(self, request: LlmRequest) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.reset_for_recompute()
        self.waiting.prepend([request])

    def remove(self, request: LlmRequest) -> None:
        """Takes a finished or aborted sequence out of the running set or the waiting queue."""
        if request in self.running:
            self.running.remove(request)
        else:
            for group in self.waiting:
                if request in group:
                    group.remove(request)
                    if not group:
                        self.waiting.remove(group)
                    break
        self.kv_cache.free(request)
