"""One source of truth for the API: crds/llmdeployment.yaml is what `berth operator crd` generates
from the operator's models, and the emulator, pruning like a real API server, keeps every field of
those models (spec and status) and loses whatever the schema forgets."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from berth.operator.crd import render_yaml
from berth.operator.crd_status import LLMDeploymentStatus
from tests.support import structural
from tests.support.cluster import Cluster
from tests.support.full_llmd import (
    STATUS,
    document_paths,
    full_object,
    full_objects,
    model_paths,
    with_refused_fields,
)

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "llmdeployment.yaml"
SCHEMA = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
LLMDS = "/apis/berth.dev/v1alpha1/namespaces/default/llmdeployments"
KEY = ("berth.dev", "v1alpha1", "llmdeployments")


def test_the_committed_crd_is_the_generated_one() -> None:
    generated = subprocess.run(
        [str(Path(sys.executable).with_name("berth")), "operator", "crd"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert generated == render_yaml()
    assert CRD_FILE.read_text() == generated, (
        "crds/llmdeployment.yaml differs from the models: run `berth operator crd > crds/llmdeployment.yaml`"
    )


def test_the_full_object_sets_every_field_of_the_models() -> None:
    # The round trip below proves something only if the document it sends uses every field.
    documents = [*full_objects(), with_refused_fields()]
    missing = set(model_paths()) - set().union(*(document_paths(doc) for doc in documents))
    assert not missing, f"tests/support/full_llmd.py does not set {sorted(missing)}"
    LLMDeploymentStatus.model_validate(STATUS)  # and it is a status the operator could write


async def round_trip(cluster: Cluster, document: dict[str, Any]) -> dict[str, Any]:
    """Create the object, write its status through the status subresource, read it back."""
    body = copy.deepcopy(document)
    status = body.pop("status")
    await cluster.api("POST", LLMDS, body)
    name = body["metadata"]["name"]
    await cluster.api("PATCH", f"{LLMDS}/{name}/status", {"status": status})
    return await cluster.api("GET", f"{LLMDS}/{name}")


async def test_every_field_of_spec_and_status_survives_the_pruning_emulator(cluster: Cluster) -> None:
    for document in full_objects():
        stored = await round_trip(cluster, document)
        assert stored["spec"] == document["spec"]
        assert stored["status"] == document["status"]
    assert cluster.emulator.pruned == []


async def test_a_field_missing_from_the_schema_is_lost_on_the_round_trip(cluster: Cluster) -> None:
    # The drift the generated CRD prevents: a schema without status.rollout (the hand-written
    # CRD had none) loses the rollout's memory on every write.
    schema = copy.deepcopy(SCHEMA)
    del schema["properties"]["status"]["properties"]["rollout"]
    cluster.emulator.schemas[KEY] = schema
    stored = await round_trip(cluster, full_object())
    assert "rollout" not in stored["status"]
    assert [(plural, name, path) for plural, name, path, _ in cluster.emulator.pruned] == [
        ("llmdeployments", "llama", "status.rollout")
    ]


def schema_fields(schema: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every declared property path of a schema (list items as "[]")."""
    found = []
    for key, sub in (schema.get("properties") or {}).items():
        if not path and key in structural.ROOT_FIELDS:
            continue
        found.append((*path, key))
        found += schema_fields(sub, (*path, key))
    if isinstance(schema.get("items"), dict):
        found += schema_fields(schema["items"], (*path, "[]"))
    return found


def without(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    schema = copy.deepcopy(schema)
    node = schema
    for part in path[:-1]:
        node = node["items"] if part == "[]" else node["properties"][part]
    del node["properties"][path[-1]]
    return schema


@pytest.mark.parametrize("path", schema_fields(SCHEMA), ids=".".join)
def test_removing_any_field_from_the_schema_fails_the_round_trip(path: tuple[str, ...]) -> None:
    # What the emulator does to each write (structural.prune), for every field of the schema:
    # none can go missing without the round trip above noticing.
    schema = without(SCHEMA, path)
    lost = []
    for document in [*full_objects(), with_refused_fields()]:
        kept = copy.deepcopy(document)
        structural.prune(schema, kept, root=True)
        lost.append(kept != document)
    assert any(lost)
