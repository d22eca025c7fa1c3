"""Server-side apply for the emulator, for the shapes the operator and kubectl send.

What the API server does (kubernetes.io "Server-Side Apply"; sigs.k8s.io/structured-merge-diff):
every write records which field manager set which fields (`metadata.managedFields`, FieldsV1);
an apply (`PATCH`, `application/apply-patch+yaml`, `?fieldManager=M[&force=true]`) makes M own
exactly the fields of its configuration, merges it into the object (maps by key, lists that are
maps by their keys, atomic lists and scalars replaced), and removes the fields M applied last time
and no longer applies unless another manager owns them too. A field another manager owns with a
different value is a conflict (409) unless `force`, which takes it over.

Lists: for built-in kinds, by the field's name as the Kubernetes API types declare them (the
keys below, every other list atomic); for custom resources, the CRD's `x-kubernetes-list-type`.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

Path = tuple[Any, ...]  # field names, and ("k", ((key, value), ...)) for a list item
ListKeys = Callable[[tuple[str, ...]], "tuple[str, ...] | None"]

# Lists of the built-in kinds that are maps (patchMergeKey / listMapKeys of k8s.io/api).
BUILTIN_LIST_KEYS = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "imagePullSecrets": ("name",),
    "volumeMounts": ("mountPath",),
    "ownerReferences": ("uid",),
    "conditions": ("type",),
}


def builtin_list_keys(names: tuple[str, ...]) -> tuple[str, ...] | None:
    """Keys of a built-in kind's list at a field path ("[]" for list items), None if atomic."""
    last = names[-1] if names else ""
    if last == "ports":
        # A container's ports are keyed by containerPort, a Service's by port.
        return ("containerPort",) if "containers" in names or "initContainers" in names else ("port",)
    return BUILTIN_LIST_KEYS.get(last)


def _names(path: Path) -> tuple[str, ...]:
    return tuple("[]" if isinstance(part, tuple) else part for part in path)


def _item_id(item: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, tuple[tuple[str, Any], ...]]:
    return ("k", tuple((key, item.get(key)) for key in keys))


def field_paths(value: Any, list_keys: ListKeys, prefix: Path = ()) -> Iterator[Path]:
    """The leaf fields a configuration sets (list items of map lists also as themselves)."""
    if isinstance(value, Mapping) and value:
        for key, sub in value.items():
            yield from field_paths(sub, list_keys, (*prefix, key))
    elif isinstance(value, list) and value and (keys := list_keys(_names(prefix))):
        for item in value:
            ident = _item_id(item, keys)
            yield (*prefix, ident)
            for key, sub in item.items():
                yield from field_paths(sub, list_keys, (*prefix, ident, key))
    else:
        yield prefix


def value_at(obj: Any, path: Path) -> Any:
    """The value at `path`, or `...` when absent."""
    for part in path:
        if isinstance(part, tuple):
            keys = dict(part[1])
            if not isinstance(obj, list):
                return ...
            obj = next(
                (
                    item
                    for item in obj
                    if isinstance(item, Mapping) and all(item.get(k) == v for k, v in keys.items())
                ),
                ...,
            )
        elif isinstance(obj, Mapping) and part in obj:
            obj = obj[part]
        else:
            return ...
        if obj is ...:
            return ...
    return obj


def remove_path(obj: Any, path: Path) -> None:
    """Delete the field (or list item) at `path`, and parents it leaves empty."""
    parents = []
    node = obj
    for part in path[:-1]:
        parents.append(node)
        node = value_at(node, (part,))
        if node is ...:
            return
    last = path[-1]
    if isinstance(last, tuple):
        keys = dict(last[1])
        if isinstance(node, list):
            node[:] = [item for item in node if not all(item.get(k) == v for k, v in keys.items())]
    elif isinstance(node, dict):
        node.pop(last, None)
    # Parents emptied by the removal go too (a nodeSelector whose last key went).
    for depth in range(len(path) - 1, 0, -1):
        holder, part = parents[depth - 1], path[depth - 1]
        child = value_at(holder, (part,))
        if child in ({}, []) and not isinstance(part, tuple) and isinstance(holder, dict):
            holder.pop(part, None)
        else:
            break


def merge(live: Any, config: Any, list_keys: ListKeys, prefix: Path = ()) -> Any:
    """The configuration merged into the live value: maps by key, map lists by their keys."""
    if isinstance(live, Mapping) and isinstance(config, Mapping):
        result = dict(live)
        for key, sub in config.items():
            result[key] = (
                merge(live[key], sub, list_keys, (*prefix, key)) if key in live else copy.deepcopy(sub)
            )
        return result
    keys = list_keys(_names(prefix)) if isinstance(config, list) else None
    if isinstance(live, list) and keys:
        result = list(live)
        for item in config:
            ident = _item_id(item, keys)
            at = next((i for i, have in enumerate(result) if _item_id(have, keys) == ident), None)
            if at is None:
                result.append(copy.deepcopy(item))
            else:
                result[at] = merge(result[at], item, list_keys, (*prefix, ident))
        return result
    return copy.deepcopy(config)


def changed_paths(before: Any, after: Any, list_keys: ListKeys) -> tuple[set[Path], set[Path]]:
    """(set or changed, removed) leaf paths between two versions of an object."""
    old = {path: value_at(before, path) for path in field_paths(before, list_keys)}
    new = {path: value_at(after, path) for path in field_paths(after, list_keys)}
    changed = {path for path, value in new.items() if old.get(path, ...) != value}
    return changed, set(old) - set(new)


# --- managedFields (FieldsV1) ------------------------------------------------------------------


def to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in paths:
        node = tree
        for part in path:
            if isinstance(part, tuple):
                key = "k:" + json.dumps(dict(part[1]), separators=(",", ":"), sort_keys=True)
            else:
                key = f"f:{part}"
            node = node.setdefault(key, {})
        if path and isinstance(path[-1], tuple):
            node["."] = {}
    return tree


def from_fields_v1(tree: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    paths: set[Path] = set()
    for key, sub in tree.items():
        if key == ".":
            paths.add(prefix)
            continue
        kind, _, rest = key.partition(":")
        part: Any = ("k", tuple(sorted(json.loads(rest).items()))) if kind == "k" else rest
        if sub:
            paths |= from_fields_v1(sub, (*prefix, part))
        else:
            paths.add((*prefix, part))
    return paths


def _canonical(path: Path) -> Path:
    # Item keys in a stable order, whatever order a configuration listed them in.
    return tuple(("k", tuple(sorted(part[1]))) if isinstance(part, tuple) else part for part in path)


Managers = dict[tuple[str, str, str | None], set[Path]]  # (manager, operation, subresource) -> fields


def read_managers(obj: Mapping[str, Any]) -> Managers:
    managers: Managers = {}
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        key = (entry.get("manager", ""), entry.get("operation", "Update"), entry.get("subresource"))
        managers[key] = from_fields_v1(entry.get("fieldsV1") or {})
    return managers


def write_managers(managers: Managers, api_version: str) -> list[dict[str, Any]]:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    entries = []
    for (manager, operation, subresource), paths in managers.items():
        if not paths:
            continue
        entry: dict[str, Any] = {
            "manager": manager,
            "operation": operation,
            "apiVersion": api_version,
            "time": now,
            "fieldsType": "FieldsV1",
            "fieldsV1": to_fields_v1(paths),
        }
        if subresource:
            entry["subresource"] = subresource
        entries.append(entry)
    return entries


# Fields no manager owns: the server's own bookkeeping.
UNOWNED_METADATA = {
    "managedFields",
    "resourceVersion",
    "uid",
    "creationTimestamp",
    "generation",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "selfLink",
}


def _owned(paths: Iterator[Path] | set[Path]) -> set[Path]:
    return {
        _canonical(path)
        for path in paths
        if path[:1] not in (("apiVersion",), ("kind",), ("status",))
        and not (path[:1] == ("metadata",) and len(path) > 1 and path[1] in UNOWNED_METADATA)
    }


class ApplyConflict(Exception):
    def __init__(self, conflicts: list[tuple[str, Path]]) -> None:
        self.conflicts = conflicts
        described = "; ".join(f'conflict with "{manager}": .{_dotted(path)}' for manager, path in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {described}")


def _dotted(path: Path) -> str:
    return ".".join(
        f"[{','.join(f'{k}={v}' for k, v in part[1])}]" if isinstance(part, tuple) else str(part)
        for part in path
    )


def apply(
    live: dict[str, Any] | None, config: Mapping[str, Any], manager: str, force: bool, list_keys: ListKeys
) -> dict[str, Any]:
    """The object after `manager` applies `config` to `live` (None: it does not exist yet)."""
    config = {key: value for key, value in config.items() if key != "status"}
    mine = _owned(field_paths(config, list_keys))
    if live is None:
        result = copy.deepcopy(dict(config))
        managers: Managers = {}
    else:
        result = copy.deepcopy(live)
        managers = read_managers(live)
    me = (manager, "Apply", None)
    others = {key: paths for key, paths in managers.items() if key != me}
    conflicts = [
        (key[0], path)
        for key, paths in others.items()
        for path in mine & paths
        if key[2] is None and value_at(result, path) != value_at(config, path)
    ]
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    # Forced: the fields in conflict change hands.
    for key in others:
        if key[2] is None:
            others[key] = others[key] - {path for owner, path in conflicts if owner == key[0]}
    owned_by_others = set().union(*others.values()) if others else set()
    for path in sorted(managers.get(me, set()) - mine - owned_by_others, key=len, reverse=True):
        if not any(other[: len(path)] == path for other in owned_by_others):
            remove_path(result, path)
    if live is not None:
        result = merge(result, config, list_keys)
    managers = {**others, me: mine}
    result.setdefault("metadata", {})["managedFields"] = write_managers(
        managers, config.get("apiVersion", "")
    )
    return result


def record_update(
    before: Mapping[str, Any] | None,
    after: dict[str, Any],
    manager: str,
    subresource: str | None,
    list_keys: ListKeys,
) -> None:
    """A create, update or merge patch by `manager`: it owns what it set or changed, no one owns
    what it removed (written into `after`'s managedFields)."""
    managers = read_managers(before or {})
    changed, removed = changed_paths(before or {}, after, list_keys)
    changed, removed = _owned(changed), {_canonical(path) for path in removed}
    me = (manager, "Update", subresource)
    for key in managers:
        managers[key] = managers[key] - removed - (changed if key != me else set())
    managers[me] = (managers.get(me, set()) | changed) - removed
    after.setdefault("metadata", {})["managedFields"] = write_managers(managers, after.get("apiVersion", ""))


def merge_patch_between(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns `before` into `after`."""
    patch: dict[str, Any] = {key: None for key in before if key not in after}
    for key, value in after.items():
        old = before.get(key, ...)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            if old != value:
                patch[key] = merge_patch_between(old, value)
        elif old != value:
            patch[key] = copy.deepcopy(value)
    return patch


def same_fields(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """True when an apply changed nothing: the same object and the same owners (times aside)."""

    def bare(obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = {key: value for key, value in (obj.get("metadata") or {}).items() if key != "managedFields"}
        return {**obj, "metadata": meta}

    return bare(before) == bare(after) and read_managers(before) == read_managers(after)
