"""Secrets stay in Secrets: the API key a user keeps in a Secret (spec.env valueFrom) and the
credentials the operator generates (engine key, admin token, SSH key pair) reach pods only as
references (`valueFrom.secretKeyRef`, Secret volumes). No value is in any container's command or
arguments, in any other object the cluster holds (pods, their templates, Events, the
LLMDeployment's status), or in any line the operator logs, at any level."""

from __future__ import annotations

import base64
import json
import logging
import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

from berth.operator import naming, render
from tests.support.cluster import Cluster, ClusterSim, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet
from tests.support.operator_runner import running_operator

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"


def decoded(secret: dict[str, Any]) -> list[str]:
    """Every value of a Secret, decoded and as stored (base64), and each line of a multi-line one
    (a private key's body), so that a value found in part is found too."""
    values = []
    for stored in (secret.get("data") or {}).values():
        text = base64.b64decode(stored).decode()
        values += [
            stored,
            text,
            *(line for line in text.splitlines() if len(line) >= 16 and "PRIVATE" not in line),
        ]
    return values


def containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def test_spec_env_from_a_secret_is_rendered_as_a_reference() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = render.LLMDeploymentSpec.model_validate(doc["spec"])
    owner = render.Owner("llama", "default", "uid-1")
    api_key = {
        "name": "BERTH_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "llama-api-key", "key": "key"}},
    }
    pods = [render.launcher_pod_spec(owner, spec, 0), render.worker_pod_spec(owner, spec, 0)]
    for pod in pods:
        assert api_key in pod["containers"][0]["env"]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_no_secret_value_reaches_a_pod_spec_an_object_or_a_log_line(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    api_key = f"api-key-{secrets.token_hex(16)}"
    await cluster.api(
        "POST",
        "/api/v1/namespaces/default/secrets",
        {"metadata": {"name": "llama-api-key"}, "data": {"key": base64.b64encode(api_key.encode()).decode()}},
    )
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(replicas=1, health={"intervalSeconds": 1, "timeoutSeconds": 1})
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))

    def phase() -> str:
        return ((cluster.get(LLMD, "llama") or {}).get("status") or {}).get("phase", "")

    async with running_operator(cluster, fleet.resolve):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
        await wait_for(lambda: phase() == "Ready", START_TIMEOUT, "Ready")

    generated = [
        naming.engine_key_secret("llama"),
        naming.admin_token_secret("llama"),
        naming.ssh_secret("llama"),
    ]
    values = [api_key]
    for name in generated:
        secret = cluster.get("v1/secrets", name)
        assert secret is not None, name
        values += decoded(secret)

    pod_specs = [pod["spec"] for pod in cluster.objects("v1/pods")]
    pod_specs += [owner["spec"]["template"]["spec"] for owner in cluster.objects("apps/v1/statefulsets")]
    pod_specs += [owner["spec"]["template"]["spec"] for owner in cluster.objects("apps/v1/deployments")]
    assert {"llama-w0-launcher", "llama-w0-0", "llama-w0-1"} <= set(cluster.names("v1/pods"))
    for pod_spec in pod_specs:
        for container in containers(pod_spec):
            argv = " ".join([*container.get("command", []), *container.get("args", [])])
            assert not [value for value in values if value in argv], container["name"]

    # Nowhere but in the Secrets: not in a pod's env or annotations, an Event, the status.
    for resource, _, obj in cluster.all_live():
        if resource.plural != "secrets":
            text = json.dumps(obj)
            assert not [value for value in values if value in text], (
                resource.plural,
                obj["metadata"]["name"],
            )

    assert len(caplog.records) > 20  # the operator did log: its debug lines included
    logged = "\n".join(record.getMessage() for record in caplog.records) + caplog.text
    assert not any(value in logged for value in values), "the operator logged a secret value"
