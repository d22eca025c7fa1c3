"""The memory of conflicts and refused writes (operator/child_problems.py): one Event per new
problem, exponential backoff for retries, nothing to busy-wait on once a retry is due."""

from __future__ import annotations

import datetime as dt

from berth.operator.child_problems import ChildProblems, ConflictingObject, RefusedWrite

NOW = dt.datetime(2026, 12, 5, tzinfo=dt.timezone.utc)
FORBIDDEN = RefusedWrite("Pod/llama-w0-launcher", "create", 403, "forbidden by policy", 0)


def test_a_refusal_backs_off_exponentially_and_is_reported_once_per_message() -> None:
    problems = ChildProblems()
    assert len(problems.refused(FORBIDDEN, NOW)) == 1
    delays = []
    for step in range(8):
        now = NOW + dt.timedelta(seconds=step)
        assert problems.refused(FORBIDDEN, now) == [] or step == 0  # the same message: no new Event
        delays.append((problems.refusals[FORBIDDEN.ref].next_retry - now).total_seconds())
    assert delays == [10, 20, 40, 80, 160, 300, 300, 300]
    assert problems.waiting(FORBIDDEN.ref, NOW + dt.timedelta(seconds=8))
    assert problems.world_errors(0)[0]["retries"] == 9 and problems.deployment_errors() == []
    changed = RefusedWrite(FORBIDDEN.ref, "create", 403, "another policy", 0)
    assert len(problems.refused(changed, NOW)) == 1
    problems.succeeded(FORBIDDEN.ref)
    assert problems.world_errors(0) == []


def test_a_due_retry_is_no_reason_to_poll_at_once() -> None:
    problems = ChildProblems()
    problems.refused(FORBIDDEN, NOW)
    assert problems.seconds_until_retry(NOW) == 5
    assert problems.seconds_until_retry(NOW + dt.timedelta(seconds=6)) is None  # due: its round retries it
    assert not problems.reconcile_due(NOW + dt.timedelta(seconds=6))  # pods are the health loop's
    problems.forget_worlds_from(0)
    assert problems.refusals == {}


def test_conflicts_are_replaced_by_each_full_reconcile_and_reported_once() -> None:
    problems = ChildProblems()
    service = ConflictingObject("Service", "llama", "nobody", None)
    secret = ConflictingObject("Secret", "llama-ssh", "nobody", None)
    assert [event[1] for event in problems.set_conflicts([service])] == ["ConflictingObject"]
    assert problems.set_conflicts([service]) == []
    assert problems.world_conflicts(3) == []  # the endpoint Service blocks no world
    problems.set_conflicts([service, secret])
    assert problems.world_conflicts(3) == [secret]  # every pod mounts the Secrets
    problems.set_conflicts([])
    assert problems.conflicts_status() == []
