"""What a real API server does with a custom resource's structural schema, for the emulator.

- pruning: every field the schema does not declare is dropped, silently, on create, update,
  patch and status writes (kubernetes.io: "Field pruning"), except below a node with
  `x-kubernetes-preserve-unknown-fields: true`; `metadata`, `apiVersion` and `kind` at the root
  are the server's own;
- list types: which lists are maps keyed by some fields (`x-kubernetes-list-type: map`), for
  server-side apply.

Written from the Kubernetes documentation, not from the operator's generator (operator/crd.py):
the emulator must not share a mistake with the code it tests.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT_FIELDS = ("apiVersion", "kind", "metadata")


def crd_schemas(path: Path) -> Iterator[tuple[str, str, str, str, dict[str, Any]]]:
    """(group, version, plural, kind, openAPIV3Schema) of every served version in a CRD file."""
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc["spec"]
        for version in spec["versions"]:
            if version.get("served"):
                yield (
                    spec["group"],
                    version["name"],
                    spec["names"]["plural"],
                    spec["names"]["kind"],
                    version["schema"]["openAPIV3Schema"],
                )


def prune(schema: Mapping[str, Any], value: Any, path: str = "", *, root: bool = False) -> list[str]:
    """Drop from `value` (in place) what `schema` does not declare; returns the dropped paths."""
    dropped: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties")
        additional = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
        for key in list(value):
            where = f"{path}.{key}" if path else key
            if root and key in ROOT_FIELDS:
                continue
            if properties is not None and key in properties:
                dropped += prune(properties[key], value[key], where)
            elif isinstance(additional, Mapping):
                dropped += prune(additional, value[key], where)
            elif not preserve:
                del value[key]
                dropped.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            dropped += prune(schema["items"], item, f"{path}[{index}]")
    return dropped


def node_at(schema: Mapping[str, Any], path: tuple[str, ...]) -> Mapping[str, Any] | None:
    """The schema node of a field path (list items are entered with the segment "[]")."""
    node: Mapping[str, Any] | None = schema
    for part in path:
        if node is None:
            return None
        if part == "[]":
            node = node.get("items")
        elif part in (node.get("properties") or {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), Mapping):
            node = node["additionalProperties"]
        else:
            return None
    return node


def list_map_keys(schema: Mapping[str, Any], path: tuple[str, ...]) -> tuple[str, ...] | None:
    """The keys of a `x-kubernetes-list-type: map` list at `path`, None for any other list."""
    node = node_at(schema, path)
    if node is not None and node.get("x-kubernetes-list-type") == "map":
        return tuple(node.get("x-kubernetes-list-map-keys") or ())
    return None
