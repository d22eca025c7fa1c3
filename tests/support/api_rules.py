"""What a real API server refuses or rewrites, for the emulator (kube_emulator.py).

The operator depends on these, so the emulator must not be kinder than a cluster:
- object names: DNS-1123 subdomains, and DNS-1035 labels for Services (their name becomes a DNS
  label); a pod's `hostname` and `subdomain`: DNS-1123 labels;
- label keys and values (values at most 63 characters), on objects and on pod templates;
- quantities must be quantities, and are stored in canonical form (`0.5` → `500m`; computed by
  tests/support/quantities.py, not by the operator's own function) and empty env values are dropped
  (`{"name": X, "value": ""}` is stored as `{"name": X}`): a client that compares what it sent
  with what it reads sees a difference.
The messages follow the API server's (k8s.io/apimachinery/pkg/util/validation).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from tests.support.quantities import canonical, is_quantity

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
# Kinds whose name is a DNS-1035 label rather than a DNS-1123 subdomain.
DNS1035_NAMED = {"services"}
DNS1123_LABEL_NAMED = {"namespaces"}


def _label_problem(value: str, max_length: int = 63) -> str | None:
    if len(value) > max_length:
        return f"must be no more than {max_length} characters"
    if not DNS1123_LABEL.match(value):
        return (
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
            "and must start and end with an alphanumeric character"
        )
    return None


def name_problem(plural: str, name: str) -> str | None:
    if plural in DNS1035_NAMED:
        if len(name) > 63:
            return "must be no more than 63 characters"
        if not DNS1035_LABEL.match(name):
            return (
                "a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
                "start with an alphabetic character, and end with an alphanumeric character"
            )
        return None
    if plural in DNS1123_LABEL_NAMED:
        return _label_problem(name)
    if len(name) > 253:
        return "must be no more than 253 characters"
    if not DNS1123_SUBDOMAIN.match(name):
        return (
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' "
            "or '.', and must start and end with an alphanumeric character"
        )
    return None


def label_problems(labels: dict[str, Any], where: str) -> Iterator[str]:
    for key, value in (labels or {}).items():
        prefix, _, label_name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix))) or (
            len(label_name) > 63 or not LABEL_NAME.match(label_name)
        ):
            yield f"{where}: Invalid value: {key!r}: name part must be a valid label key"
        if value is None:
            continue  # a merge patch removing the label
        value = str(value)
        if len(value) > 63:
            yield f"{where}: Invalid value: {value!r}: must be no more than 63 characters"
        elif not LABEL_VALUE.match(value):
            yield (
                f"{where}: Invalid value: {value!r}: a valid label must be an empty string or consist of "
                "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
                "character"
            )


def _pod_specs(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    if "containers" in spec:
        yield "spec", spec
    template = spec.get("template")
    if isinstance(template, dict) and isinstance(template.get("spec"), dict):
        yield "spec.template.spec", template["spec"]


def problems(plural: str, obj: dict[str, Any], *, creating: bool) -> list[str]:
    """Every reason a real API server would answer 422 to this create (or merge patch)."""
    found: list[str] = []
    meta = obj.get("metadata") or {}
    if creating and meta.get("name") and (problem := name_problem(plural, meta["name"])):
        found.append(f"metadata.name: Invalid value: {meta['name']!r}: {problem}")
    found += label_problems(meta.get("labels") or {}, "metadata.labels")
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    template = spec.get("template") if isinstance(spec.get("template"), dict) else None
    if template is not None:
        found += label_problems(
            (template.get("metadata") or {}).get("labels") or {}, "spec.template.metadata.labels"
        )
    for where, pod_spec in _pod_specs(obj):
        for index, container in enumerate(pod_spec.get("containers") or []):
            for part in ("requests", "limits"):
                for key, value in ((container.get("resources") or {}).get(part) or {}).items():
                    if value is not None and not is_quantity(value):
                        found.append(
                            f"{where}.containers[{index}].resources.{part}[{key}]: Invalid value: {value!r}: "
                            "quantities must match the regular expression "
                            "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
                        )
        for field in ("hostname", "subdomain"):
            if pod_spec.get(field) and (problem := _label_problem(str(pod_spec[field]))):
                found.append(f"{where}.{field}: Invalid value: {pod_spec[field]!r}: {problem}")
    return found


# What a StatefulSet update may change (k8s.io/kubernetes pkg/apis/apps/validation).
STATEFULSET_MUTABLE = (
    "replicas",
    "ordinals",
    "template",
    "updateStrategy",
    "persistentVolumeClaimRetentionPolicy",
    "minReadySeconds",
)
STATEFULSET_IMMUTABLE_MESSAGE = (
    "spec: Forbidden: updates to statefulset spec for fields other than 'replicas', 'ordinals', "
    "'template', 'updateStrategy', 'persistentVolumeClaimRetentionPolicy' and 'minReadySeconds' "
    "are forbidden"
)


def update_problems(plural: str, stored: dict[str, Any], updated: dict[str, Any]) -> list[str]:
    """Why the API server refuses to turn `stored` into `updated` (fields that never change)."""
    if plural != "statefulsets":
        return []
    before, after = stored.get("spec") or {}, updated.get("spec") or {}
    fixed = (set(before) | set(after)) - set(STATEFULSET_MUTABLE)
    if any(before.get(key) != after.get(key) for key in fixed):
        return [STATEFULSET_IMMUTABLE_MESSAGE]
    return []


def normalize(obj: dict[str, Any]) -> None:
    """Rewrite `obj` (a create body or a merge patch) the way the API server stores it."""
    for _, pod_spec in _pod_specs(obj):
        for container in [*(pod_spec.get("containers") or []), *(pod_spec.get("initContainers") or [])]:
            for part in ("requests", "limits"):
                quantities = (container.get("resources") or {}).get(part)
                if isinstance(quantities, dict):
                    for key, value in quantities.items():
                        quantities[key] = canonical(value)
            for var in container.get("env") or []:
                if var.get("value") == "":
                    del var["value"]  # omitempty: the stored object has no value at all
