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
