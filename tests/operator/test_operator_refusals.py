"""Errors are status: a write to one world's child that the API server refuses (here a 403 from
admission on the world's launcher pod) is shown on that world with the server's message and the
time, posted as an Event, retried with backoff, and does not stop the operator from restarting
the other world when its engine dies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.operator_runner import running_operator

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"
DENIED = (
    'pods "llama-w0-launcher" is forbidden: violates PodSecurity "restricted:latest": '
    'allowPrivilegeEscalation != false (container "launcher" must set '
    "securityContext.allowPrivilegeEscalation=false)"
)


def worlds(cluster: Cluster) -> list[dict[str, Any]]:
    return ((cluster.get(LLMD, "llama") or {}).get("status") or {}).get("worlds") or [{}, {}]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_world_whose_pod_is_forbidden_is_reported_and_the_other_world_is_still_restarted(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(frontends=0, health={"intervalSeconds": 1, "timeoutSeconds": 1, "backoffSeconds": 0})
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))
    async with running_operator(cluster, fleet.resolve):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
        await wait_for(
            lambda: [w.get("phase") for w in worlds(cluster)] == ["Ready", "Ready"], START_TIMEOUT, "Ready"
        )

        # Admission now refuses world 0's launcher pod; its engine dies, so the world is restarted
        # and its new launcher refused.
        cluster.emulator.deny("create", "pods", "llama-w0-launcher", DENIED)
        await fleet.for_pod("llama-w0-launcher").kill_engine()
        await wait_for(lambda: worlds(cluster)[0].get("apiErrors"), 30, "world 0's refusal in status")
        (error,) = worlds(cluster)[0]["apiErrors"]
        assert error["object"] == "Pod/llama-w0-launcher" and error["verb"] == "create"
        assert error["code"] == 403 and error["message"] == DENIED and error["time"]
        await wait_for(lambda: cluster.event_messages("WriteRefused"), 10, "the Event")
        assert cluster.event_messages("WriteRefused")[0].startswith(
            f"create Pod/llama-w0-launcher refused by the API server (HTTP 403): {DENIED}; retrying in "
        )

        # The other world's engine dies meanwhile: it is restarted and serves again.
        await fleet.for_pod("llama-w1-launcher").kill_engine()
        await wait_for(lambda: worlds(cluster)[1].get("restarts") == 1, 30, "world 1 restarted")
        await wait_for(
            lambda: worlds(cluster)[1].get("phase") == "Ready", START_TIMEOUT, "world 1 Ready again"
        )
        assert fleet.started.count("llama-w1-launcher") == 2
        # Retried with backoff (the count moves, not on every poll), and still reported.
        await wait_for(
            lambda: (worlds(cluster)[0].get("apiErrors") or [{}])[0].get("retries", 0) >= 2, 30, "a retry"
        )
        assert cluster.get("v1/pods", "llama-w0-launcher") is None

        # Admission lets it through again: the next retry creates it and the world comes back.
        cluster.emulator.allow("create", "pods", "llama-w0-launcher")
        await wait_for(
            lambda: worlds(cluster)[0].get("phase") == "Ready", START_TIMEOUT, "world 0 Ready again"
        )
    assert "apiErrors" not in worlds(cluster)[0]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_an_immutable_statefulset_field_replaces_the_worlds_statefulset_after_a_drain(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(replicas=1, frontends=0, health={"intervalSeconds": 1, "timeoutSeconds": 1})
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))
    async with running_operator(cluster, fleet.resolve, resync_seconds=0.5):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
        await wait_for(lambda: worlds(cluster)[0].get("phase") == "Ready", START_TIMEOUT, "Ready")
        old = cluster.get("apps/v1/statefulsets", "llama-w0")["metadata"]["uid"]
        # The StatefulSet as an older operator made it: a field the API server never lets change.
        cluster.emulator.objects["apps/v1/statefulsets", "default", "llama-w0"].patch(
            {"spec": {"podManagementPolicy": "OrderedReady"}}
        )

        def replaced() -> bool:
            sts = cluster.get("apps/v1/statefulsets", "llama-w0") or {}
            return (
                sts.get("metadata", {}).get("uid") not in (None, old)
                and worlds(cluster)[0].get("phase") == "Ready"
            )

        try:
            await wait_for(replaced, START_TIMEOUT, "a new StatefulSet and the world Ready on it")
        except AssertionError as error:
            raise AssertionError(
                f"{error}; status: {(cluster.get(LLMD, 'llama') or {}).get('status')}; "
                f"events: {[(e['reason'], e.get('message')) for e in cluster.objects('v1/events')]}"
            ) from None
    (refused,) = cluster.event_messages("WriteRefused")
    assert refused.startswith("apply StatefulSet/llama-w0 refused by the API server (HTTP 422): ")
    assert (
        "updates to statefulset spec for fields other than" in refused and "replacing the world's" in refused
    )
    assert cluster.get("apps/v1/statefulsets", "llama-w0")["spec"]["podManagementPolicy"] == "Parallel"
    # Drained first (sleep in drain mode for the rollout), then replaced, not restarted.
    assert any("(rollout)" in message for message in cluster.event_messages("WorldAsleep"))
    assert cluster.event_messages("WorldReplaced") == [
        "world 0 replaced: its StatefulSet's immutable fields changed"
    ]
    assert fleet.started == ["llama-w0-launcher"] * 2
    assert worlds(cluster)[0]["restarts"] == 0 and "apiErrors" not in worlds(cluster)[0]
