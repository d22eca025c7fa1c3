"""The autoscaling examples: an LLMDeployment with spec.autoscaling (checked with every other
example by test_operator_crd_schema.py), and the alternatives, an HPA and a KEDA ScaledObject
driving the LLMDeployment's scale subresource, which build with `kubectl kustomize` and come
with the Argo CD Application that lets them own spec.replicas."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import ApiClient

from berth.operator.crd import custom_resource_definition

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"


def build(folder: Path) -> dict[str, dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(folder)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out) if doc}


@pytest.mark.parametrize(
    ("folder", "scaler"),
    [("autoscaling-hpa", "HorizontalPodAutoscaler"), ("autoscaling-keda", "ScaledObject")],
)
def test_the_scaler_targets_the_scale_subresource_of_the_deployment_it_ships_with(
    folder: str, scaler: str
) -> None:
    built = build(EXAMPLES / folder)
    assert set(built) == {"LLMDeployment", scaler}
    llmd = built["LLMDeployment"]
    target = built[scaler]["spec"]["scaleTargetRef"]
    assert target == {
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "LLMDeployment",
        "name": llmd["metadata"]["name"],
    }
    assert built[scaler]["metadata"]["namespace"] == llmd["metadata"]["namespace"]
    # One scaler per deployment: the operator's own autoscaling stays off.
    assert "autoscaling" not in llmd["spec"]
    # What the scaler writes and reads: the CRD's scale subresource.
    version = custom_resource_definition()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_the_hpa_is_a_valid_autoscaling_v2_object() -> None:
    hpa = build(EXAMPLES / "autoscaling-hpa")["HorizontalPodAutoscaler"]
    client = ApiClient()
    parsed = client.deserialize(json.dumps(hpa), "V2HorizontalPodAutoscaler", "application/json")
    # Nothing the official client does not know (a misspelt field would be dropped here).
    assert client.sanitize_for_serialization(parsed) == hpa
    assert parsed.spec.min_replicas == 1 and parsed.spec.max_replicas == 4


@pytest.mark.parametrize("folder", ["autoscaling-hpa", "autoscaling-keda"])
def test_argo_cd_leaves_replicas_to_the_scaler(folder: str) -> None:
    application = yaml.safe_load((EXAMPLES / folder / "argocd-application.yaml").read_text())
    assert application["spec"]["source"]["path"] == f"manifests/examples/{folder}"
    assert {"group": "berth.dev", "kind": "LLMDeployment", "jsonPointers": ["/spec/replicas"]} in application[
        "spec"
    ]["ignoreDifferences"]
    assert "RespectIgnoreDifferences=true" in application["spec"]["syncPolicy"]["syncOptions"]
