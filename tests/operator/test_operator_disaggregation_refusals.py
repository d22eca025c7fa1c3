"""A disaggregated deployment with something it cannot be combined with is refused with the
reason: by the CRD's rules at `kubectl apply`, and, on an API server without them, by the
operator (Degraded / InvalidSpec, nothing built). (The example itself is accepted:
test_operator_crd_schema.py; rendered and run: test_e2e_disaggregated.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.cluster import Cluster, wait_for
from tests.support.operator_runner import running_operator

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment-disaggregated.yaml"
FRONTENDS = "frontends: not with disaggregation (the router is the endpoint"


def with_frontends(tmp_path: Path) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["frontends"] = 1
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def test_the_crds_rules_refuse_it_at_apply(cluster: Cluster, tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"frontends: not with disaggregation"):
        await cluster.kubectl("apply", "--validate=false", "-f", str(with_frontends(tmp_path)))
    assert cluster.names(LLMD) == []


async def test_without_the_rules_the_operator_refuses_it_and_builds_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.emulator.validate_cel = False  # an API server without the CRD's rules
    async with running_operator(cluster):
        await cluster.kubectl("apply", "--validate=false", "-f", str(with_frontends(tmp_path)))

        def degraded() -> dict:
            status = (cluster.get(LLMD, "llama-split") or {}).get("status") or {}
            return next((c for c in status.get("conditions") or [] if c["type"] == "Degraded"), {})

        await wait_for(lambda: degraded().get("reason") == "InvalidSpec", 15, "Degraded: InvalidSpec")
    assert FRONTENDS in degraded()["message"]
    for resource in ("v1/pods", "apps/v1/statefulsets", "apps/v1/deployments"):
        assert cluster.names(resource) == [], resource
