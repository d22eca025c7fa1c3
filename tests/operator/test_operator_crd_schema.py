"""The LLMDeployment CRD (crds/llmdeployment.yaml, generated from the operator's models): its
OpenAPI schema accepts every example and rejects bad documents with the expected messages.

No real API server ever compiled this CRD here. The schema's structure is checked with
`jsonschema`; its `x-kubernetes-validations` CEL rules are compiled and run by a CEL
implementation from PyPI (cel-python, tests/support/cel_rules.py) after the CRD's defaults are
applied, as the API server does, and the emulator runs them on every LLMDeployment the other
tests create. What cel-python cannot show is a rule that only the API server's CEL environment
(its cost limits, its Kubernetes extension libraries) would refuse.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from berth.operator.crd_model import InvalidSpec, parse_spec
from tests.support import cel_rules
from tests.support.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "llmdeployment.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))


# --- the API server's behaviour, as far as these tests need it ------------------------------


def to_json_schema(node: Any) -> Any:
    """OpenAPI v3 (Kubernetes flavour) → JSON Schema: `nullable` becomes a type union."""
    if isinstance(node, dict):
        converted = {key: to_json_schema(value) for key, value in node.items()}
        if converted.pop("nullable", False) and "type" in converted:
            converted["type"] = [converted["type"], "null"]
        return converted
    if isinstance(node, list):
        return [to_json_schema(item) for item in node]
    return node


VALIDATOR = jsonschema.Draft7Validator(to_json_schema(SCHEMA))


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: a missing property with a default gets it, inside present objects."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def rule_sites(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, rule) for every x-kubernetes-validations rule; `[]` marks list items."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for key, sub in (schema.get("properties") or {}).items():
        yield from rule_sites(sub, f"{path}.{key}" if path else key)
    if "items" in schema:
        yield from rule_sites(schema["items"], f"{path}[]")


def values_at(doc: Any, path: str) -> Iterator[Any]:
    """The values a rule at `path` sees (nothing when the field is absent, like CEL rules)."""
    if not path:
        yield doc
        return
    head, _, rest = path.partition(".")
    is_list = head.endswith("[]")
    key = head.removesuffix("[]")
    if not isinstance(doc, dict) or key not in doc:
        return
    items = doc[key] if is_list else [doc[key]]
    for item in items:
        yield from values_at(item, rest)


def list_map_keys(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, list[str]]]:
    if schema.get("x-kubernetes-list-type") == "map":
        yield path, schema["x-kubernetes-list-map-keys"]
    for key, sub in (schema.get("properties") or {}).items():
        yield from list_map_keys(sub, f"{path}.{key}" if path else key)


def api_server_errors(document: dict[str, Any]) -> list[str]:
    """Every message a real API server would answer a create of `document` with."""
    messages = [error.message for error in VALIDATOR.iter_errors(document)]
    if messages:
        return messages  # CEL rules run only on schema-valid objects
    messages += cel_rules.violations(SCHEMA, document)
    defaulted = apply_defaults(SCHEMA, copy.deepcopy(document))
    for path, keys in list_map_keys(SCHEMA):
        for items in values_at(defaulted, path):
            identities = [tuple(item.get(key) for key in keys) for item in items]
            if len(identities) != len(set(identities)):
                messages.append(f"{path}: duplicate entries for list-map keys {keys}")
    return messages


# --- the documents ---------------------------------------------------------------------------


def minimal() -> dict[str, Any]:
    return {
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "m"},
        "spec": {"model": {"path": "/models/m"}, "image": "berth:1"},
    }


def with_spec(**changes: Any) -> dict[str, Any]:
    doc = minimal()
    doc["spec"].update(changes)
    return doc


def without(field: str) -> dict[str, Any]:
    doc = minimal()
    del doc["spec"][field]
    return doc


BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "no spec",
        {"apiVersion": "berth.dev/v1alpha1", "kind": "LLMDeployment", "metadata": {}},
        "'spec' is a required property",
    ),
    ("no image", without("image"), "'image' is a required property"),
    ("no model", without("model"), "'model' is a required property"),
    ("empty model path", with_spec(model={"path": ""}), "'' should be non-empty"),
    ("negative replicas", with_spec(replicas=-1), "-1 is less than the minimum of 0"),
    ("replicas as text", with_spec(replicas="two"), "'two' is not of type 'integer'"),
    ("zero tensor parallel", with_spec(tensorParallelSize=0), "0 is less than the minimum of 1"),
    (
        "unknown pull policy",
        with_spec(imagePullPolicy="Sometimes"),
        "'Sometimes' is not one of ['Always', 'IfNotPresent', 'Never']",
    ),
    (
        "tp not a multiple of gpus",
        with_spec(tensorParallelSize=3, gpusPerNode=2),
        "tensorParallelSize must be a multiple of gpusPerNode (a world is tensorParallelSize / gpusPerNode "
        "worker pods with gpusPerNode GPUs each)",
    ),
    (
        "a template overriding the engine's command",
        with_spec(launcher={"template": {"spec": {"containers": [{"name": "launcher", "command": ["sh"]}]}}}),
        "a pod template may not set a container's command, args, image, ports",
    ),
    ("quantity not a quantity", with_spec(resources={"limits": {"memory": "lots"}}), "'lots' does not match"),
    (
        "an env value and a valueFrom",
        with_spec(
            env=[{"name": "K", "value": "x", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]
        ),
        "an env variable takes value or valueFrom, not both",
    ),
    (
        "an env valueFrom with two sources",
        with_spec(
            env=[
                {
                    "name": "K",
                    "valueFrom": {
                        "secretKeyRef": {"name": "s", "key": "k"},
                        "configMapKeyRef": {"name": "c", "key": "k"},
                    },
                }
            ]
        ),
        "valueFrom takes exactly one of secretKeyRef and configMapKeyRef",
    ),
    ("an env valueFrom with no source", with_spec(env=[{"name": "K", "valueFrom": {}}]), "exactly one of"),
    (
        "an env variable berth sets",
        with_spec(
            env=[{"name": "BERTH_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
        ),
        "env may not set BERTH_ADMIN_TOKEN, BERTH_ENGINE_KEY, BERTH_WORLD: berth sets them",
    ),
    (
        "gpus in resources",
        with_spec(resources={"limits": {"nvidia.com/gpu": 2}}),
        "do not set nvidia.com/gpu in resources: the operator requests gpusPerNode GPUs per worker pod",
    ),
    (
        "model path outside the volume",
        with_spec(
            model={"path": "/data/m", "volume": {"mountPath": "/models", "hostPath": {"path": "/srv"}}}
        ),
        "model.path must lie under model.volume.mountPath",
    ),
    (
        "two volume sources",
        with_spec(
            model={
                "path": "/models/m",
                "volume": {
                    "mountPath": "/models",
                    "hostPath": {"path": "/srv"},
                    "persistentVolumeClaim": {"claimName": "c"},
                },
            }
        ),
        "model.volume needs exactly one of persistentVolumeClaim, hostPath, nfs",
    ),
    (
        "engineArgs sets a managed flag",
        with_spec(engineArgs=["--max-num-seqs=8", "--admin-port=9000"]),
        "engineArgs must not set --hostfile, --tensor-parallel-size, --gpus-per-node, --host, --port, "
        "--admin-port, --served-model-name, --attach, --role or --kv-transfer-endpoint: "
        "the operator sets them from the spec",
    ),
    (
        "engineArgs sets a disaggregated role",
        with_spec(engineArgs=["--role=context"]),
        "engineArgs must not set",
    ),
    (
        "disaggregation with replicas that are not the pools'",
        with_spec(replicas=3, disaggregation={"context": {"replicas": 1}}),
        "replicas conflicts with disaggregation: the worlds are the pools'",
    ),
    (
        "disaggregation with a pool that does not fill whole nodes",
        with_spec(gpusPerNode=2, disaggregation={"generation": {"tensorParallelSize": 3}}),
        "disaggregation.POOL.tensorParallelSize must be a multiple of gpusPerNode",
    ),
    (
        "disaggregation with a deployment-wide tensorParallelSize",
        with_spec(tensorParallelSize=2, gpusPerNode=1, disaggregation={}),
        "tensorParallelSize: not with disaggregation (each pool has its own: "
        "disaggregation.POOL.tensorParallelSize)",
    ),
    (
        "disaggregation with frontends",
        with_spec(frontends=1, disaggregation={}),
        "frontends: not with disaggregation (the router is the endpoint)",
    ),
    (
        "disaggregation with autoscaling",
        with_spec(autoscaling={"maxReplicas": 2, "target": 4}, disaggregation={}),
        "autoscaling: not with disaggregation yet",
    ),
    ("bad env name", with_spec(env=[{"name": "1BAD", "value": "x"}]), "'1BAD' does not match"),
    ("sleep level 3", with_spec(sleep={"sleeping": True, "level": 3}), "3 is not one of [1, 2]"),
    (
        "a revision with a space",
        with_spec(model={"path": "/models/m", "revision": "v 2"}),
        "'v 2' does not match",
    ),
    (
        "cron that is not cron",
        with_spec(sleepSchedules=[{"name": "night", "cron": "every day", "action": "Sleep"}]),
        "'every day' does not match",
    ),
    (
        "unknown schedule action",
        with_spec(sleepSchedules=[{"name": "night", "cron": "0 22 * * *", "action": "Nap"}]),
        "'Nap' is not one of ['Sleep', 'Wake']",
    ),
    (
        "duplicate schedule names",
        with_spec(
            sleepSchedules=[
                {"name": "night", "cron": "0 22 * * *", "action": "Sleep"},
                {"name": "night", "cron": "0 6 * * *", "action": "Wake"},
            ]
        ),
        "duplicate entries for list-map keys ['name']",
    ),
    (
        "timeout longer than interval",
        with_spec(health={"intervalSeconds": 5, "timeoutSeconds": 10}),
        "health.timeoutSeconds must not exceed health.intervalSeconds",
    ),
    (
        "backoff cap below backoff",
        with_spec(health={"backoffSeconds": 60, "maxBackoffSeconds": 30}),
        "health.maxBackoffSeconds must be at least health.backoffSeconds",
    ),
    (
        "Exists toleration with a value",
        with_spec(tolerations=[{"key": "gpu", "operator": "Exists", "value": "yes"}]),
        "a toleration with operator Exists must not set value",
    ),
    (
        "service port out of range",
        with_spec(service={"port": 70000}),
        "70000 is greater than the maximum of 65535",
    ),
    ("unknown service type", with_spec(service={"type": "Ingress"}), "'Ingress' is not one of"),
    (
        "autoscaling bounds crossed",
        with_spec(autoscaling={"minReplicas": 3, "maxReplicas": 2, "target": 4}),
        "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
    ),
    (
        "KV cache target above a whole cache",
        with_spec(autoscaling={"maxReplicas": 2, "metric": "kvCacheUsage", "target": 80}),
        "autoscaling.target of kvCacheUsage is a fraction of the KV cache",
    ),
    (
        "idle release without idle sleep",
        with_spec(autoscaling={"maxReplicas": 2, "target": 4, "idle": {"releaseAfterSeconds": 60}}),
        "idle.releaseAfterSeconds counts from the idle sleep",
    ),
    (
        "autoscaling target zero",
        with_spec(autoscaling={"maxReplicas": 2, "target": 0}),
        "0 is less than or equal to the minimum of 0",
    ),
    (
        "name too long for its children",
        {**minimal(), "metadata": {"name": "a" * 48}},
        "metadata.name must be at most 47 characters",
    ),
    (
        "name that is no Service name",
        {**minimal(), "metadata": {"name": "7-llama"}},
        "metadata.name must be a DNS-1035 label",
    ),
]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_accepted(path: Path) -> None:
    document = yaml.safe_load(path.read_text())
    assert api_server_errors(document) == []
    parse_spec(apply_defaults(SCHEMA, copy.deepcopy(document))["spec"])  # and the operator agrees


@pytest.mark.parametrize(("what", "document", "expected"), BAD, ids=[case[0] for case in BAD])
def test_bad_documents_are_rejected_with_the_expected_message(
    what: str, document: dict, expected: str
) -> None:
    errors = api_server_errors(document)
    assert any(expected in message for message in errors), errors
    # The operator's own model refuses the same spec (defence when a server did not validate).
    with pytest.raises(InvalidSpec):
        parse_spec(document.get("spec"), (document.get("metadata") or {}).get("name"))


def test_every_cel_rule_compiles_and_has_a_message() -> None:
    rules = list(rule_sites(SCHEMA))
    assert len(rules) == 24  # the container-template rule once per role
    for _, rule in rules:
        cel_rules.program(rule["rule"])  # raises RuleError when cel-python cannot compile it
        assert rule.get("message"), f"rule without a message: {rule['rule']}"


async def test_the_emulator_refuses_what_the_rules_refuse(cluster: Cluster, tmp_path: Path) -> None:
    # kubectl apply of a spec that only a CEL rule refuses: the "API server" answers 422.
    document = with_spec(tensorParallelSize=3, gpusPerNode=2)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(document))
    with pytest.raises(AssertionError, match="tensorParallelSize must be a multiple of gpusPerNode"):
        await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "bad.yaml"))
    assert cluster.get("berth.dev/v1alpha1/llmdeployments", "m") is None


def test_defaults_agree_with_the_operators_model() -> None:
    document = with_spec(health={}, sleep={}, rollout={}, service={}, resources={}, launcherResources={})
    defaulted = apply_defaults(SCHEMA, copy.deepcopy(document))["spec"]
    assert defaulted["replicas"] == 1 and defaulted["health"]["intervalSeconds"] == 10
    assert parse_spec(defaulted) == parse_spec(document["spec"])


def walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}" if path else key)
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def test_every_field_is_documented_and_structural() -> None:
    for path, node in walk(SCHEMA):
        if path.endswith("{}"):
            continue  # map values are described by their map
        assert node.get("description"), f"{path or '<root>'} has no description"
        if path:
            assert (
                "type" in node
                or node.get("x-kubernetes-int-or-string")
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), f"{path} has no type (not a structural schema)"


def test_subresources_and_names() -> None:
    assert CRD["metadata"]["name"] == "llmdeployments.berth.dev"
    assert CRD["spec"]["names"]["shortNames"] == ["llmd"]
    assert CRD["spec"]["scope"] == "Namespaced"
    assert VERSION["name"] == "v1alpha1" and VERSION["served"] and VERSION["storage"]
    assert VERSION["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }


def test_printer_columns_point_at_real_fields() -> None:
    columns = {column["name"]: column["jsonPath"] for column in VERSION["additionalPrinterColumns"]}
    assert list(columns)[:4] == ["Model", "Ready", "Phase", "Sleeping"] and "Age" in columns
    for name, json_path in columns.items():
        if name == "Age":
            continue
        node = SCHEMA
        for part in re.sub(r"\[\?.*?\]", "[]", json_path).strip(".").split("."):
            key = part.removesuffix("[]")
            node = node["properties"][key]
            if part.endswith("[]"):
                node = node["items"]
        assert node.get("type") == "string" or name == "Sleeping", name
