"""Never adopt: an object with a child's name that this LLMDeployment does not control (owned by
nobody, or by another LLMDeployment) is left exactly as it is (same resourceVersion), reported
(status.conflicts, condition Ready=False / ConflictingObject naming it, an Event), and the worlds
it does not stand in the way of run. A Secret someone else made is never read: no token from it
reaches any pod (every request to a launcher address is recorded)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from berth.operator import naming
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.kstatus import kstatus
from tests.support.operator_runner import running_operator
from tests.support.recording_proxy import recording

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"
FAST = {"intervalSeconds": 1, "timeoutSeconds": 1}
NS = "/api/v1/namespaces/default"


def manifest(tmp_path: Path, name: str, **spec: Any) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"].update(frontends=0, health=FAST, **spec)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def status(cluster: Cluster, name: str = "llama") -> dict[str, Any]:
    return (cluster.get(LLMD, name) or {}).get("status") or {}


def condition(cluster: Cluster, kind: str) -> dict[str, Any]:
    return next((c for c in status(cluster).get("conditions") or [] if c["type"] == kind), {})


def version(cluster: Cluster, resource: str, name: str) -> str:
    return cluster.get(resource, name)["metadata"]["resourceVersion"]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_objects_it_does_not_control_are_left_alone_and_the_other_worlds_run(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    async with recording(fleet.resolve) as resolver, running_operator(cluster, resolver):
        # Another LLMDeployment (no worlds) whose StatefulSet happens to carry llama-w0's name.
        await cluster.kubectl("apply", "--validate=false", "-f", str(manifest(tmp_path, "other", replicas=0)))
        other = await wait_for(lambda: cluster.get(LLMD, "other"), 10, "the other LLMDeployment")
        other_ref = {
            "apiVersion": "berth.dev/v1alpha1",
            "kind": "LLMDeployment",
            "name": "other",
            "uid": other["metadata"]["uid"],
            "controller": True,
        }
        labels = {naming.DEPLOYMENT: "llama", naming.MANAGED_BY: "berth"}
        sts = {
            "metadata": {"name": "llama-w0", "labels": labels, "ownerReferences": [other_ref]},
            "spec": {
                "replicas": 0,
                "serviceName": "llama-w0",
                "selector": {"matchLabels": {"app": "theirs"}},
                "template": {
                    "metadata": {"labels": {"app": "theirs"}},
                    "spec": {"containers": [{"name": "c", "image": "theirs"}]},
                },
            },
        }
        await cluster.api("POST", "/apis/apps/v1/namespaces/default/statefulsets", sts)
        # A user's Service named like the endpoint, and a user's pod named like world 1's launcher
        # (labelled like one): owned by nobody.
        service = {"metadata": {"name": "llama"}, "spec": {"ports": [{"port": 80}], "selector": {"app": "x"}}}
        await cluster.api("POST", f"{NS}/services", service)
        pod_labels = {**labels, naming.WORLD: "1", naming.ROLE: "launcher"}
        user_pod = {
            "metadata": {"name": "llama-w1-launcher", "labels": pod_labels},
            "spec": {"containers": [{"name": "c", "image": "tenant/image"}]},
        }
        await cluster.api("POST", f"{NS}/pods", user_pod)
        await wait_for(
            lambda: (cluster.get("v1/pods", "llama-w1-launcher") or {}).get("status"), 10, "it runs"
        )
        theirs = {
            ("apps/v1/statefulsets", "llama-w0"): version(cluster, "apps/v1/statefulsets", "llama-w0"),
            ("v1/services", "llama"): version(cluster, "v1/services", "llama"),
            ("v1/pods", "llama-w1-launcher"): version(cluster, "v1/pods", "llama-w1-launcher"),
        }

        await cluster.kubectl("apply", "--validate=false", "-f", str(manifest(tmp_path, "llama", replicas=3)))
        await wait_for(
            lambda: (
                [w.get("phase") for w in status(cluster).get("worlds") or []]
                == ["Blocked", "Blocked", "Ready"]
            ),
            START_TIMEOUT,
            "world 2 Ready, worlds 0 and 1 blocked",
        )
        await wait_for(
            lambda: len(cluster.event_messages("ConflictingObject")) == 3, 10, "an Event per conflict"
        )
        for (resource, name), resource_version in theirs.items():
            assert version(cluster, resource, name) == resource_version, f"{resource}/{name} was written"

        assert kstatus(cluster.get(LLMD, "llama"))[0] == "Failed"  # kstatus: stalled on the conflicts
        ready = condition(cluster, "Ready")
        assert ready["status"] == "False" and ready["reason"] == "ConflictingObject"
        assert (
            f"StatefulSet/llama-w0 exists and is controlled by LLMDeployment/other (uid {other_ref['uid']})"
            in (ready["message"])
        )
        assert "Service/llama exists and is controlled by nobody" in ready["message"]
        assert "Pod/llama-w1-launcher exists and is controlled by nobody" in ready["message"]
        assert status(cluster)["conflicts"] == [
            {"kind": "Pod", "name": "llama-w1-launcher", "owner": "nobody", "world": 1},
            {"kind": "Service", "name": "llama", "owner": "nobody"},
            {
                "kind": "StatefulSet",
                "name": "llama-w0",
                "owner": f"LLMDeployment/other (uid {other_ref['uid']})",
                "world": 0,
            },
        ]
        # World 0 got no launcher (its StatefulSet is not ours); the other LLMDeployment's
        # StatefulSet is not pruned by it either.
        assert cluster.get("v1/pods", "llama-w0-launcher") is None
        assert cluster.get("apps/v1/statefulsets", "llama-w0")["metadata"]["ownerReferences"] == [other_ref]

        # The user's pod was never asked anything; world 2's launcher only ever with its own token.
        token = base64.b64decode(cluster.get("v1/secrets", "llama-admin-token")["data"]["token"]).decode()
        assert resolver.authorizations("llama-w1-launcher") == set()
        assert resolver.authorizations("llama-w2-launcher") <= {None, f"Bearer {token}"}

        # The user removes their Service: the operator makes its own soon after.
        await cluster.api("DELETE", f"{NS}/services/llama")
        await wait_for(
            lambda: (cluster.get("v1/services", "llama") or {}).get("metadata", {}).get("ownerReferences"),
            30,
            "the endpoint Service created once the user's is gone",
        )
        await wait_for(
            lambda: (
                {(c["kind"], c["name"]) for c in status(cluster).get("conflicts") or []}
                == {("StatefulSet", "llama-w0"), ("Pod", "llama-w1-launcher")}
            ),
            10,
            "the Service's conflict resolved",
        )


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_secret_it_did_not_create_is_never_read_or_mounted(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    stolen = "a-token-that-belongs-to-someone-else"
    secret = {
        "metadata": {"name": "llama-admin-token"},
        "type": "Opaque",
        "data": {"token": base64.b64encode(stolen.encode()).decode()},
    }
    await cluster.api("POST", f"{NS}/secrets", secret)
    theirs = version(cluster, "v1/secrets", "llama-admin-token")
    async with recording(fleet.resolve) as resolver, running_operator(cluster, resolver):
        await cluster.kubectl("apply", "--validate=false", "-f", str(manifest(tmp_path, "llama", replicas=1)))
        await wait_for(
            lambda: condition(cluster, "Ready").get("reason") == "ConflictingObject", 15, "the conflict"
        )
        await wait_for(lambda: cluster.event_messages("ConflictingObject"), 10, "the Event")
        assert version(cluster, "v1/secrets", "llama-admin-token") == theirs
        assert (
            "Secret/llama-admin-token exists and is controlled by nobody"
            in condition(cluster, "Ready")["message"]
        )
        # Nothing that would mount it: no StatefulSet, no launcher.
        assert cluster.names("apps/v1/statefulsets") == [] and cluster.names("v1/pods") == []
        assert [w.get("phase") for w in status(cluster)["worlds"]] == ["Blocked"]

        # Once it is gone, the operator makes its own, and only that one's value is ever sent.
        await cluster.api("DELETE", f"{NS}/secrets/llama-admin-token")
        await wait_for(lambda: status(cluster).get("readyReplicas") == 1, START_TIMEOUT, "the world Ready")
    token = base64.b64decode(cluster.get("v1/secrets", "llama-admin-token")["data"]["token"]).decode()
    assert token != stolen
    assert resolver.requests, "the launcher was polled"
    assert resolver.authorizations() <= {None, f"Bearer {token}"}
    assert not any(stolen in str(r.authorization) for r in resolver.requests)
