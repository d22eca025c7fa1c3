"""What a real API server refuses or rewrites, refused and rewritten by the emulator too
(tests/support/api_rules.py), and the operator living with it: names that can never work are
a clear status and Event (not a retry loop), values the server normalises are not patched
forever, a child the server refuses is reported and retried, a worker-only change replaces the
world, and a restart is counted once even when its status write fails."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.operator_runner import running_operator

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"
FAST = {"intervalSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 2}


async def refused(cluster: Cluster, path: str, body: dict[str, Any]) -> str:
    with pytest.raises(AssertionError, match="HTTP 422") as error:
        await cluster.api("POST", path, body)
    return str(error.value)


async def test_the_emulator_refuses_what_an_api_server_refuses(cluster: Cluster) -> None:
    services = "/api/v1/namespaces/default/services"
    message = await refused(cluster, services, {"metadata": {"name": "7days"}, "spec": {}})
    assert 'Service "7days" is invalid: metadata.name' in message and "DNS-1035 label" in message
    await refused(cluster, services, {"metadata": {"name": "a" * 64}, "spec": {}})
    config_maps = "/api/v1/namespaces/default/configmaps"
    message = await refused(cluster, config_maps, {"metadata": {"name": "ok", "labels": {"x": "v" * 64}}})
    assert "must be no more than 63 characters" in message
    await refused(cluster, config_maps, {"metadata": {"name": "Not_A_Name"}})
    pod = {"metadata": {"name": "p"}, "spec": {"hostname": "h" * 64, "containers": []}}
    await refused(cluster, "/api/v1/namespaces/default/pods", pod)
    # What it accepts, it stores as the server does: canonical quantities, no empty env values.
    container = {
        "name": "c",
        "resources": {"requests": {"cpu": "0.5", "memory": "1.5Gi"}},
        "env": [{"name": "EMPTY", "value": ""}],
    }
    await cluster.api(
        "POST",
        "/api/v1/namespaces/default/pods",
        {"metadata": {"name": "p"}, "spec": {"containers": [container]}},
    )
    stored = cluster.get("v1/pods", "p")["spec"]["containers"][0]
    assert stored["resources"]["requests"] == {"cpu": "500m", "memory": "1536Mi"}
    assert stored["env"] == [{"name": "EMPTY"}]


async def test_a_statefulset_name_without_room_for_its_revision_hash_gets_no_pods(
    cluster: Cluster, sim: ClusterSim
) -> None:
    name = "w" * 53  # a fine object name; its pods' controller-revision-hash label would be 64 long
    labels = {"app": "w"}
    sts = {
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "serviceName": "w",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        },
    }
    await cluster.api("POST", "/apis/apps/v1/namespaces/default/statefulsets", sts)
    await wait_for(lambda: sim.failed_creates, 10, "the StatefulSet controller's FailedCreate")
    assert "controller-revision-hash" not in str(cluster.names("v1/pods"))
    assert "must be no more than 63 characters" in sim.failed_creates[0]
    events = [e for e in cluster.objects("v1/events") if e.get("reason") == "FailedCreate"]
    assert events and events[0]["involvedObject"]["name"] == name


async def test_a_name_that_can_never_work_is_degraded_once_not_retried(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    # An API server without the CRD's rules: the operator's own check must catch what the CRD
    # refuses.
    cluster.emulator.validate_cel = False
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name = "a-deployment-name-that-is-just-too-long-for-its-kids"
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(doc))
    invalid_before = REGISTRY.get_sample_value("berth_operator_reconciles_total", {"result": "invalid"}) or 0
    retries_before = REGISTRY.get_sample_value("berth_operator_reconciles_total", {"result": "retry"}) or 0
    async with running_operator(cluster, fleet.resolve):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "long.yaml"))
        status = lambda: (cluster.get(LLMD, name) or {}).get("status") or {}  # noqa: E731
        await wait_for(lambda: status().get("phase") == "Degraded", 10, "Degraded")
        await asyncio.sleep(3)  # time for a retry loop to show itself, if there were one
    degraded = next(c for c in status()["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert f"metadata.name must be at most 47 characters (it has {len(name)})" in degraded["message"]
    invalid = REGISTRY.get_sample_value("berth_operator_reconciles_total", {"result": "invalid"})
    assert invalid == invalid_before + 1
    assert (
        REGISTRY.get_sample_value("berth_operator_reconciles_total", {"result": "retry"}) or 0
    ) == retries_before
    warnings = [e for e in cluster.objects("v1/events") if e.get("reason") == "InvalidSpec"]
    assert len(warnings) == 1
    assert cluster.names("apps/v1/statefulsets") == [] and cluster.names("v1/pods") == []


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_child_the_api_server_refuses_is_reported_and_retried(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    # A 422 (a webhook's verdict, a rule of this cluster's) is shown on the resource, with the
    # server's message, and tried again with backoff: the next try may meet a fixed webhook.
    cluster.emulator.fail_next("PATCH", "statefulsets", status=422)  # the apply that creates it
    async with running_operator(cluster, fleet.resolve):
        await apply_one_world(cluster, tmp_path)
        llmd = cluster.get(LLMD, "llama")
    (message,) = reasons(cluster, "WriteRefused")
    assert message == (
        "create StatefulSet/llama-w0 refused by the API server (HTTP 422): injected failure (test); "
        "retrying in 5s"
    )
    assert not reasons(cluster, "InvalidSpec")
    assert llmd["status"]["observedGeneration"] == llmd["metadata"]["generation"]
    assert "apiErrors" not in world(cluster)  # gone once the retry succeeded
    assert not cluster.emulator.failures


def sts_version(cluster: Cluster) -> str:
    return cluster.get("apps/v1/statefulsets", "llama-w0")["metadata"]["resourceVersion"]


def reasons(cluster: Cluster, reason: str) -> list[str]:
    return [e.get("message", "") for e in cluster.objects("v1/events") if e.get("reason") == reason]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_values_the_server_rewrites_are_not_patched_forever(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(replicas=1, frontends=0, health=FAST)
    doc["spec"]["resources"] = {"requests": {"cpu": "0.5", "memory": "1.5Gi"}}
    doc["spec"]["env"] = [{"name": "EMPTY", "value": ""}]
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))

    # And one rewrite the renderer cannot know about: this "server" pins every image pull policy.
    def pin_pull_policy(plural: str, body: dict[str, Any]) -> None:
        template = (body.get("spec") or {}).get("template") or {}
        for container in (template.get("spec") or {}).get("containers") or []:
            container["imagePullPolicy"] = "Always"

    cluster.emulator.normalizers.append(pin_pull_policy)
    async with running_operator(cluster, fleet.resolve, resync_seconds=0.5):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
        await wait_for(
            lambda: ((cluster.get(LLMD, "llama") or {}).get("status") or {}).get("phase") == "Ready",
            START_TIMEOUT,
            "Ready",
        )
        await wait_for(lambda: reasons(cluster, "PatchNotConverging"), 10, "the PatchNotConverging Event")
        settled = sts_version(cluster)
        await asyncio.sleep(3)  # several resyncs
        assert sts_version(cluster) == settled, "the StatefulSet is still being patched"
    (warning,) = reasons(cluster, "PatchNotConverging")
    assert "StatefulSet/llama-w0" in warning and "imagePullPolicy" in warning
    # The quantities and the empty value were rendered as stored: those never looked like drift.
    assert not any("StatefulSet/llama-w0" in message for message in reasons(cluster, "Updated")[1:])
    assert "ConfigMap" not in str(reasons(cluster, "PatchNotConverging"))


def world(cluster: Cluster) -> dict[str, Any]:
    return (((cluster.get(LLMD, "llama") or {}).get("status") or {}).get("worlds") or [{}])[0]


def uid(cluster: Cluster, name: str) -> str | None:
    return ((cluster.get("v1/pods", name) or {}).get("metadata") or {}).get("uid")


async def apply_one_world(cluster: Cluster, tmp_path: Path, **health: int) -> None:
    """The example, one world, fast polls; returns once it is Ready."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(replicas=1, frontends=0, health={**FAST, **health})
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))
    await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
    await wait_for(lambda: world(cluster).get("phase") == "Ready", START_TIMEOUT, "Ready")


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_worker_only_change_replaces_the_world(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    async with running_operator(cluster, fleet.resolve):
        await apply_one_world(cluster, tmp_path)
        before = {name: uid(cluster, name) for name in ("llama-w0-launcher", "llama-w0-0", "llama-w0-1")}
        patch = {
            "spec": {"resources": {"requests": {"cpu": "6", "memory": "32Gi"}, "limits": {"memory": "48Gi"}}}
        }
        await cluster.kubectl("patch", "llmd", "llama", "--type=merge", "-p", yaml.safe_dump(patch))
        await wait_for(lambda: reasons(cluster, "WorldReplaced"), 20, "the world replaced")
        await wait_for(
            lambda: all(uid(cluster, name) not in (None, old) for name, old in before.items()),
            20,
            "new pods under the same names",
        )
        await wait_for(lambda: world(cluster).get("phase") == "Ready", START_TIMEOUT, "Ready again")
    assert reasons(cluster, "WorldReplaced") == ["world 0 replaced: its worker pod spec changed"]
    worker = cluster.get("v1/pods", "llama-w0-0")["spec"]["containers"][0]
    assert worker["resources"]["requests"]["cpu"] == "6"
    assert world(cluster)["restarts"] == 0  # a spec change spends no restart budget


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_restart_is_counted_once_when_its_status_write_or_its_deletions_fail(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    async with running_operator(cluster, fleet.resolve):
        await apply_one_world(cluster, tmp_path, backoffSeconds=0)
        # The status write that records the restart fails once: no pod may be deleted before it.
        cluster.emulator.fail_next("PATCH", "llmdeployments", "status")
        await fleet.for_pod("llama-w0-launcher").kill_engine()
        await wait_for(lambda: world(cluster).get("restarts") == 1, 30, "the restart recorded")
        await wait_for(lambda: world(cluster).get("phase") == "Ready", START_TIMEOUT, "Ready again")
        assert world(cluster)["lastRestartReason"] == "EngineDead" and not cluster.emulator.failures
        # The next restart's first pod deletion fails: the next round finishes the replacement
        # (the pods are in status with the restart) instead of counting the gone pods as a death.
        cluster.emulator.fail_next("DELETE", "pods")
        await fleet.for_pod("llama-w0-launcher").kill_engine()
        await wait_for(lambda: world(cluster).get("restarts") == 2, 30, "the second restart recorded")
        await wait_for(lambda: world(cluster).get("phase") == "Ready", START_TIMEOUT, "Ready once more")
        await asyncio.sleep(2)  # a double count would show now
    assert world(cluster)["restarts"] == 2 and len(world(cluster)["restartTimes"]) == 2
    assert world(cluster)["lastRestartReason"] == "EngineDead"
    assert fleet.started == ["llama-w0-launcher"] * 3
    restarted = reasons(cluster, "WorldRestarted")
    assert len(restarted) == 2 and all("(EngineDead)" in message for message in restarted)
    assert not cluster.emulator.failures, "the injected failure was never hit"
