"""Which terminating pods are on a lost node (operator/disruption.py): by the node's Ready where
the operator may read Nodes, by an overdue deletion where it may not (the namespaced install)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from berth.operator import disruption
from berth.operator.kube import KubeError
from berth.operator.restarts import format_time

NOW = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.timezone.utc)


class Api:
    """The two calls disruption makes, answered from a dict of nodes (403: no right to read)."""

    def __init__(self, nodes: dict[str, Any] | int) -> None:
        self.nodes = nodes
        self.deleted: list[tuple[str, int]] = []

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Any:
        assert (api_version, kind, namespace) == ("v1", "Node", None)
        if isinstance(self.nodes, int):
            raise KubeError(self.nodes, "nodes is forbidden")
        return self.nodes.get(name)

    async def delete(
        self, api_version: str, kind: str, namespace: str, name: str, grace_seconds: int
    ) -> bool:
        self.deleted.append((name, grace_seconds))
        return True


def pod(name: str, node: str, deadline_seconds_ago: float | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "default"}
    if deadline_seconds_ago is not None:
        meta["deletionTimestamp"] = format_time(NOW - dt.timedelta(seconds=deadline_seconds_ago))
    return {"metadata": meta, "spec": {"nodeName": node}}


def ready(status: str) -> dict[str, Any]:
    return {"status": {"conditions": [{"type": "Ready", "status": status}]}}


async def test_a_terminating_pod_is_released_when_its_node_is_not_ready_or_gone() -> None:
    api = Api({"up": ready("True"), "down": ready("Unknown")})
    pods = [pod("a", "up", 5), pod("b", "down", 5), pod("c", "gone", 5), pod("d", "down", None)]
    assert await disruption.release_from_lost_nodes(api, pods, NOW) == ["b", "c"]  # type: ignore[arg-type]
    assert api.deleted == [("b", 0), ("c", 0)]  # d is not being deleted: left alone


async def test_without_the_right_to_read_nodes_an_overdue_deletion_is_the_sign() -> None:
    api = Api(403)
    overdue = disruption.OVERDUE_SECONDS + 1
    pods = [pod("early", "n1", disruption.OVERDUE_SECONDS - 1), pod("late", "n2", overdue)]
    assert await disruption.release_from_lost_nodes(api, pods, NOW) == ["late"]  # type: ignore[arg-type]


async def test_any_other_refusal_is_raised_not_taken_for_a_lost_node() -> None:
    api = Api(500)
    with pytest.raises(KubeError, match="HTTP 500"):
        await disruption.release_from_lost_nodes(api, [pod("a", "n1", 3600)], NOW)  # type: ignore[arg-type]
    assert api.deleted == []


# --- drains: the planner (disruption.plan) -------------------------------------------------


def on_nodes(
    index: int,
    nodes: set[str],
    draining: set[str] = frozenset(),  # type: ignore[assignment]
    ready: bool = True,
    admission: str | None = "running",
    phase: str = "Ready",
    busy: bool = False,
) -> disruption.WorldOnNodes:
    return disruption.WorldOnNodes(
        index=index,
        ready=ready,
        phase=phase,
        admission=admission,
        busy=busy,
        nodes=frozenset(nodes),
        draining=frozenset(draining & nodes),
    )


def test_a_drain_takes_at_most_max_unavailable_worlds_and_parks_each_first() -> None:
    worlds = [on_nodes(0, {"a"}, {"a"}), on_nodes(1, {"a"}, {"a"}), on_nodes(2, {"b"}, {"a"})]
    result = disruption.plan(worlds, [], 1, NOW, 300)
    assert result.orders == [(0, "park", ("a",))]
    assert result.in_flight == [{"world": 0, "step": "parking", "nodes": ["a"], "since": format_time(NOW)}]
    # Two at a time: both worlds on the drained node; world 2 holds nothing there.
    assert [order[:2] for order in disruption.plan(worlds, [], 2, NOW, 300).orders] == [
        (0, "park"),
        (1, "park"),
    ]


def test_a_world_out_of_service_counts_and_one_that_serves_nothing_goes_first_without_a_park() -> None:
    down = on_nodes(1, {"a"}, {"a"}, ready=False, admission=None, phase="Starting")
    result = disruption.plan([on_nodes(0, {"a"}, {"a"}), down], [], 1, NOW, 300)
    # World 1 serves nothing: released at once; it is the one out of service, so world 0 waits.
    assert result.orders == [(1, "release", ("a",))]
    assert result.in_flight[0]["step"] == "evicting"


def test_a_parked_world_is_released_then_replaced_once_its_pods_are_off_the_node() -> None:
    parking = [{"world": 0, "step": "parking", "nodes": ["a"], "since": format_time(NOW)}]
    still = disruption.plan(
        [on_nodes(0, {"a"}, {"a"}, ready=False, admission="parking", busy=True)], parking, 1, NOW, 300
    )
    assert still.orders == [] and still.in_flight == parking  # the drain of its requests goes on
    parked = on_nodes(0, {"a"}, {"a"}, ready=False, admission="parked", phase="Sleeping")
    released = disruption.plan([parked], parking, 1, NOW, 300)
    assert released.orders == [(0, "release", ("a",))]
    assert released.in_flight[0]["step"] == "evicting"
    # The launcher evicted, the worker not yet: wait (the release is repeated for pods not yet labelled).
    waiting = disruption.plan([parked], released.in_flight, 1, NOW, 300)
    assert waiting.orders == [(0, "release", ("a",))]
    # Nothing of the world left on node a (a worker made again on b is the new world's).
    gone = on_nodes(0, {"b"}, ready=False, admission=None, phase="Evicting")
    replaced = disruption.plan([gone], released.in_flight, 1, NOW, 300)
    assert replaced.orders == [(0, "replace", ("a",))] and replaced.in_flight == []
    assert [event[1] for event in replaced.events] == ["WorldEvicted"]


def test_a_released_world_nothing_evicts_is_moved_by_the_operator_and_an_uncordoned_one_woken() -> None:
    since = format_time(NOW - dt.timedelta(seconds=disruption.EVICTION_WAIT_SECONDS + 1))
    evicting = [{"world": 0, "step": "evicting", "nodes": ["a"], "since": since, "evictingSince": since}]
    parked = on_nodes(0, {"a"}, {"a"}, ready=False, admission="parked", phase="Evicting")
    assert disruption.plan([parked], evicting, 1, NOW, 300).orders == [(0, "replace", ("a",))]
    uncordoned = on_nodes(0, {"a"}, ready=False, admission="parked", phase="Evicting")
    result = disruption.plan([uncordoned], evicting, 1, NOW, 300)
    assert result.orders == [(0, "abort", ("a",))] and result.in_flight == []
    parking = [{"world": 0, "step": "parking", "nodes": ["a"], "since": format_time(NOW)}]
    assert disruption.plan([on_nodes(0, {"a"})], parking, 1, NOW, 300).orders == [(0, "abort", ("a",))]
    # Uncordoned once one of its pods was evicted already: the world is broken, so it is replaced.
    broken = disruption.WorldOnNodes(
        0, False, "Evicting", "parked", False, frozenset({"a"}), frozenset(), whole=False
    )
    fresh = [{**evicting[0], "evictingSince": format_time(NOW)}]
    result = disruption.plan([broken], fresh, 1, NOW, 300)
    assert result.orders == [(0, "replace", ("a",))] and "partly evicted" in result.events[0][2]


def test_a_node_is_being_drained_when_cordoned_or_tainted_for_removal() -> None:
    assert disruption.node_draining({"spec": {"unschedulable": True}})
    assert disruption.node_draining({"spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler"}]}})
    assert not disruption.node_draining({"spec": {"taints": [{"key": "nvidia.com/gpu"}]}})
    assert not disruption.node_draining(None)  # gone: a lost node's business, not a drain's
