"""A loop trusts the watches' view of its pods only once it shows the loop's own writes
(operator/watched.py): until then its rounds list from the API server."""

from __future__ import annotations

from typing import Any

from berth.operator.watched import EXPECTATION_TTL, Expectations


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pod(name: str, uid: str, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": uid}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-05T12:00:00Z"
    return {"metadata": meta}


def test_a_deleted_pod_is_expected_gone_or_terminating_before_the_view_is_trusted() -> None:
    expected = Expectations()
    assert expected.met_by([pod("w-0", "a")])
    expected.deleted("a")
    assert not expected.met_by([pod("w-0", "a")])  # the watch has not delivered the deletion yet
    assert expected.met_by([pod("w-0", "a", terminating=True)])
    expected.deleted("b")
    assert expected.met_by([pod("w-0", "c")])  # gone; its successor under the same name is new


def test_a_created_pod_is_expected_present_and_not_the_one_it_replaces() -> None:
    expected = Expectations()
    expected.deleted("old")
    expected.created("launcher")
    assert not expected.met_by([pod("launcher", "old")])  # the stale one still shows
    assert not expected.met_by([])  # the old one gone, the new one not yet there
    assert expected.met_by([pod("launcher", "new")])
    assert expected.met_by([])  # met once: forgotten, not expected again


def test_a_write_the_watches_never_show_stops_counting_after_its_ttl() -> None:
    clock = Clock()
    expected = Expectations(clock)
    expected.created("launcher")  # e.g. deleted by someone else before the watch saw it
    assert not expected.met_by([])
    clock.now += EXPECTATION_TTL + 1
    assert expected.met_by([])
