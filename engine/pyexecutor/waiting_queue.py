"""Waiting-queue policies. An entry is a group: a request's `n` sequences are admitted together."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from berth.engine.pyexecutor.sequence import Sequence

Group = list[Sequence]


class FCFSWaitingQueue:
    """First come, first served; a pushed-back group goes to the front."""

    def __init__(self) -> None:
        self._groups: deque[Group] = deque()

    def append(self, group: Group) -> None:
        self._groups.append(group)

    def prepend(self, group: Group) -> None:
        self._groups.appendleft(group)

    def peek(self) -> Group:
        return self._groups[0]

    def pop(self) -> Group:
        return self._groups.popleft()

    def remove(self, group: Group) -> None:
        self._groups.remove(group)

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(self._groups)


class PriorityWaitingQueue:
    """Highest priority first (priority in [0, 1]); equal priorities stay first come, first served.

    The heap key is (-priority, order). New groups take increasing orders; a pushed-back
    group takes a decreasing negative order, so it is ahead of every peer of its priority
    that has not yet been admitted, and behind higher priorities.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Group]] = []
        self._later = itertools.count()
        self._earlier = itertools.count(-1, -1)

    def append(self, group: Group) -> None:
        heapq.heappush(self._heap, (-group[0].priority, next(self._later), group))

    def prepend(self, group: Group) -> None:
        heapq.heappush(self._heap, (-group[0].priority, next(self._earlier), group))

    def peek(self) -> Group:
        return self._heap[0][2]

    def pop(self) -> Group:
        return heapq.heappop(self._heap)[2]

    def remove(self, group: Group) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not group]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Group]:
        return (entry[2] for entry in sorted(self._heap, key=lambda e: e[:2]))


WaitingQueue = FCFSWaitingQueue | PriorityWaitingQueue


def create_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "fcfs":
        return FCFSWaitingQueue()
    if policy == "priority":
        return PriorityWaitingQueue()
    raise ValueError(f"unknown scheduling policy {policy!r} (fcfs, priority)")
