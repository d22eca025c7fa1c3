"""kmock 0.8's KubernetesEmulator with the fixes a real client needs (PLATFORM-NOTES, plus more).

Fixes from PLATFORM-NOTES: the namespaces path parser, server-side metadata on create (uid,
resourceVersion, creationTimestamp, generation), `/api/v1` discovery's groupVersion, list
responses' kind/apiVersion, 201 on create.

Further gaps found while building the operator's tests, fixed here too:
- `metadata.generateName` is ignored (kopf's Events all use it: the second Event is a 409);
- `metadata.generation` never moves (observedGeneration logic is untestable): bumped when a
  write changes `spec`;
- `resourceVersion` bumped on every write (the spike bumped it on patches only);
- the status subresource is not separate: a main-resource write may change status and a
  `/status` write may change spec; both now behave like the API server's;
- list ignores `labelSelector` (every list returns the whole namespace): filtered here;
- every get, list and watch scans every stored object of every kind, comparing resources
  through a pattern-matching __eq__ (O(objects) per request, O(N^2) for N deployments: the
  benchmark's 100 deployments spent most of their time there): the store keeps an index by
  resource and name as it changes (`IndexedStore`); a named object is one dict lookup, a list
  reads only its resource's keys;
- the scale subresource answers with the object itself (kubectl scale cannot decode it): it
  now speaks autoscaling/v1 Scale through the CRD's paths (.spec.replicas, .status.replicas,
  .status.selector), as `kubectl scale` and an HPA use it;
- every request is matched against each reaction by scanning the whole request history
  (`request in view` iterates every past request through the filters), so each request costs
  O(requests so far): 100 LLMDeployments took minutes. A filter now tests the one request.

And what a real API server does that the operator relies on: custom resources pruned against
the CRD's structural schema and checked by its CEL rules (structural.py, cel_rules.py),
server-side apply with managedFields (server_side_apply.py), a StatefulSet's immutable fields,
admission-style denials of named objects (deny()), and the Eviction subresource with
PodDisruptionBudgets (`disruptions_allowed()`: what a node drain meets).
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import functools
import itertools
import math
import re
import secrets
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import yaml
from kmock._internal import dicts, dsl, enums, parsing, rendering
from kmock._internal.k8s import KubernetesError, KubernetesScaffold

from tests.support import api_rules, cel_rules, server_side_apply, structural

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "llmdeployment.yaml"

_original_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    # kmock 0.8 answers 500 for the cluster-scoped "namespaces" resource itself.
    parts = path.strip("/").split("/")
    if parts[:2] == ["api", "v1"] and parts[2:3] == ["namespaces"] and len(parts) <= 4:
        return parsing.ParsedPath("", "v1", "namespaces", None, parts[3] if len(parts) == 4 else None, None)
    return _original_parse_path(path)


parsing.parse_path = _parse_path

_original_contains = dsl.View.__contains__


def _filter_contains(self: Any, item: Any) -> bool:
    # A filter's requests are its source's requests that pass its criteria: test the one
    # request instead of re-filtering the whole history (same answer, O(1) filter calls).
    if isinstance(item, rendering.Request):
        return bool(self.criteria(item)) and item in self._source
    return _original_contains(self, item)


def _passthrough_contains(self: Any, item: Any) -> bool:
    if isinstance(item, rendering.Request):
        return item in self._source
    return _original_contains(self, item)


def _root_contains(self: Any, item: Any) -> bool:
    # The request being dispatched is the newest one: look from the end.
    if isinstance(item, rendering.Request):
        return any(request is item for request in reversed(self._requests))
    return _original_contains(self, item)


dsl.Filter.__contains__ = _filter_contains
dsl.Priority.__contains__ = _passthrough_contains
dsl.Root.__contains__ = _root_contains

_SELECTOR_TERM = re.compile(
    r"^\s*(?P<neg>!)?(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9_.-]*)|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def _split_selector(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [*terms, current] if current.strip() else terms


@functools.lru_cache(maxsize=4096)
def _selector_terms(selector: str) -> tuple[tuple[str, str, Any], ...]:
    """A selector parsed once: (key, operator, operand) per term. A LIST filters every object of
    its resource with one selector (thousands of objects at a thousand deployments)."""
    terms = []
    for term in _split_selector(selector):
        match = _SELECTOR_TERM.match(term)
        if not match:
            raise ValueError(f"unparsable label selector term {term!r}")
        if match["op"] in ("=", "=="):
            terms.append((match["key"], "=", match["value"]))
        elif match["op"] == "!=":
            terms.append((match["key"], "!=", match["value"]))
        elif match["setop"]:
            values = frozenset(value.strip() for value in match["values"].split(","))
            terms.append((match["key"], match["setop"], values))
        else:
            terms.append((match["key"], "!" if match["neg"] else "exists", None))
    return tuple(terms)


def matches_selector(labels: dict[str, str], selector: str) -> bool:
    """Kubernetes label selector semantics (equality- and set-based)."""
    for key, operator, operand in _selector_terms(selector):
        if operator == "=":
            ok = labels.get(key) == operand
        elif operator == "!=":
            ok = labels.get(key) != operand
        elif operator in ("in", "notin"):
            ok = (labels.get(key) in operand) == (operator == "in") if key in labels else operator == "notin"
        else:
            ok = (key in labels) != (operator == "!")
        if not ok:
            return False
    return True


def matches_label_selector(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels, matchExpressions); an empty one selects everything."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        ok = {
            "In": present and labels[key] in values,
            "NotIn": not present or labels[key] not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]
        if not ok:
            return False
    return True


def _pod_healthy(pod: dict[str, Any]) -> bool:
    """What the disruption controller counts as healthy: Ready and not terminating."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and not pod["metadata"].get("deletionTimestamp")


def _scaled(value: int | str, expected: int) -> int:
    """An int-or-percent of a PodDisruptionBudget: a percentage of the expected pods, rounded up."""
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * expected / 100)
    return int(value)


def disruptions_allowed(budget: dict[str, Any], pods: list[dict[str, Any]]) -> int:
    """How many of the pods `budget` selects may be evicted now, computed as the disruption
    controller does: healthy pods (Ready, not terminating) beyond the desired healthy count.
    Expected pods are the pods it selects (the real controller takes percentages and
    maxUnavailable from the pods' controllers' scale; for the pods of one controller that is
    the same number)."""
    spec = budget.get("spec") or {}
    selected = [
        pod
        for pod in pods
        if matches_label_selector(spec.get("selector") or {}, pod["metadata"].get("labels") or {})
    ]
    expected, healthy = len(selected), sum(1 for pod in selected if _pod_healthy(pod))
    if spec.get("maxUnavailable") is not None:
        desired = expected - _scaled(spec["maxUnavailable"], expected)
    else:
        desired = _scaled(spec.get("minAvailable", 1), expected)
    return max(0, healthy - desired)


class IndexedStore(dict):
    """kmock's object store (key: (resource, namespace, name)), indexed as it changes:
    (group, version, plural) -> {(namespace, name): key}, in the store's order. kmock writes its
    store only through `[key] = ...`, `del` and `clear()`; soft deletions keep the key."""

    def __init__(self) -> None:
        super().__init__()
        self.by_resource: dict[tuple[str | None, str | None, str | None], dict[tuple[Any, str], Any]] = {}

    def keys_of(
        self, group: str | None, version: str | None, plural: str | None
    ) -> dict[tuple[Any, str], Any]:
        return self.by_resource.get((group, version, plural), {})

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self:
            resource, namespace, name = key
            self.by_resource.setdefault((resource.group, resource.version, resource.plural), {})[
                namespace, name
            ] = key
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        resource, namespace, name = key
        keys = self.by_resource.get((resource.group, resource.version, resource.plural), {})
        if keys.get((namespace, name)) == key:
            del keys[namespace, name]

    def clear(self) -> None:
        super().clear()
        self.by_resource.clear()


class Emulator(kmock.KubernetesEmulator):
    """Import and use as `@pytest.mark.kmock(cls=Emulator)` or directly with `kmock.Server`."""

    _resource_versions = itertools.count(1)
    # plural -> seconds a create of that resource takes (to stop an operator half-way).
    slow_creates: dict[str, float] = {}  # noqa: RUF012  (replaced per instance by tests)

    def _has_status_subresource(self, resource: Any) -> bool:
        try:
            return "status" in self.resources[resource].subresources
        except KeyError:
            return False

    def _stored(self, request: Any) -> dict[str, Any] | None:
        """The stored object a request names, a copy of its own."""
        stored = self._peek(request)
        return None if stored is None else copy.deepcopy(stored)

    def _peek(self, request: Any) -> dict[str, Any] | None:
        """The stored object a request names, not copied: to read, never to change. (A pod with
        its managed fields takes a millisecond or two to copy; a write used to copy it 4 times.)"""
        try:
            obj = self.objects[request.resource, request.namespace, request.name]
        except KeyError:
            return None
        return None if obj.deleted else obj.raw

    def _KubernetesEmulator__get_objs(self, request: Any, strict: bool) -> list[Any]:
        # Same answer as kmock's own scan (see the module docstring), by key and by index.
        store = self._objects._objects
        wanted = request.resource
        keys = store.keys_of(wanted.group, wanted.version, wanted.plural)
        if request.name is not None and (strict or request.namespace is not None):
            key = keys.get((request.namespace, request.name))
            return [] if key is None else [store[key]]
        found = [
            store[key]
            for (namespace, name), key in keys.items()
            if (namespace == request.namespace or (not strict and request.namespace is None))
            and (request.name is None or name == request.name)
        ]
        selector = (request.params or {}).get("labelSelector")
        if not selector:
            return found
        # Filtered here, before kmock renders each object it answers with (kmock itself ignores
        # label selectors): a LIST renders only what it returns.
        return [
            obj
            for obj in found
            if not obj.deleted and matches_selector(obj.raw.get("metadata", {}).get("labels") or {}, selector)
        ]

    def _get_resources(self) -> list[Any]:
        # The declared resources (the scaffold's), plus those of stored objects (kmock's rule).
        resources = set(KubernetesScaffold._get_resources(self))
        resources.update(
            next(iter(keys.values()))[0] for keys in self._objects._objects.by_resource.values() if keys
        )
        return list(resources)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # The array is a frozen attrs class: its (still empty) dict is swapped the way attrs allows.
        object.__setattr__(self._objects, "_objects", IndexedStore())
        # Set per instance: tests arm them.
        self.slow_creates = {}
        self.failures: list[tuple[str, str, str | None, int]] = []  # (method, plural, subresource, status)
        self.denials: dict[tuple[str, str, str | None], tuple[int, str]] = {}  # see deny()
        self.deletions = 0  # DELETE requests received (the simulated garbage collector's cue)
        self.evictions: list[tuple[str, int]] = []  # (pod, status) of every eviction answered 201 or 429
        # RBAC for the operator's requests: f(request) -> None (allowed) or the 403's message
        # (tests/support/rbac.py); None lets every request through.
        self.authorizer: Callable[[Any], str | None] | None = None
        self.operator_agents: tuple[str, ...] = ()  # the User-Agent prefixes the authorizer judges
        self.forbidden: list[str] = []  # the messages of the 403s the authorizer answered
        # Extra rewrites a test wants the "server" to make: f(plural, body) on creates and patches.
        self.normalizers: list[Callable[[str, dict[str, Any]], None]] = []
        # (group, version, plural) -> the custom resource's structural schema (declare_resources).
        self.schemas: dict[tuple[str, str, str], dict[str, Any]] = {}
        # The schema's CEL rules run on every write of a custom resource; False plays an API
        # server without them (an older CRD, or none), which the operator must survive too.
        self.validate_cel = True
        self.rule_errors: list[str] = []  # rules that did not compile or evaluate (a broken CRD)
        # Fields the "server" dropped because the schema does not declare them, as
        # (plural, name, path, User-Agent): a real server drops them without a word.
        self.pruned: list[tuple[str, str, str, str]] = []

    def _schema(self, request: Any) -> dict[str, Any] | None:
        resource = request.resource
        return self.schemas.get((resource.group, resource.version, resource.plural))

    def _cel_response(self, request: Any, obj: dict[str, Any]) -> Any | None:
        """422 with the rules' messages when `obj` breaks one of its CRD's CEL rules."""
        schema = self._schema(request)
        if schema is None or not self.validate_cel:
            return None
        try:
            messages = cel_rules.violations(schema, obj)
        except cel_rules.RuleError as error:
            self.rule_errors.append(str(error))
            return _status_response(500, "InternalError", str(error))
        if not messages:
            return None
        info = self.resources.get(request.resource) or kmock.ResourceInfo()
        kind = f"{info.kind}.{request.resource.group}"
        name = (obj.get("metadata") or {}).get("name") or request.name
        listed = messages[0] if len(messages) == 1 else "[" + ", ".join(messages) + "]"
        return _status_response(422, "Invalid", f'{kind} "{name}" is invalid: {listed}')

    def _prune(self, request: Any) -> None:
        """Drop what the custom resource's schema does not declare, as the API server does. A
        merge patch is pruned like the object it is merged into (the stored object is pruned
        already, so the result is the same)."""
        schema = self._schema(request)
        if schema is None or not isinstance(request.data, dict):
            return
        name = (request.data.get("metadata") or {}).get("name") or request.name or ""
        agent = request.headers.get("User-Agent", "")
        for path in structural.prune(schema, request.data, root=True):
            self.pruned.append((request.resource.plural, name, path, agent))

    def deny(self, verb: str, plural: str, name: str, message: str, status: int = 403) -> None:
        """Refuse every `verb` (create, update, delete) of the object `name` until `allow()`, as an
        admission plugin or a webhook would (Pod Security, a ResourceQuota, a policy engine)."""
        self.denials[verb, plural, name] = (status, message)

    def allow(self, verb: str, plural: str, name: str) -> None:
        self.denials.pop((verb, plural, name), None)

    def _denied(self, request: Any) -> tuple[int, str] | None:
        verb = {
            enums.action.CREATE: "create",
            enums.action.UPDATE: "update",
            enums.action.DELETE: "delete",
        }.get(request.action)
        if verb is None or request.resource is None or request.subresource is not None:
            return None
        name = request.name
        if verb == "create" and isinstance(request.data, dict):
            name = (request.data.get("metadata") or {}).get("name")
        return self.denials.get((verb, request.resource.plural, name))

    def fail_next(self, method: str, plural: str, subresource: str | None = None, status: int = 500) -> None:
        """The next matching request fails with `status` (an API server having a bad moment)."""
        self.failures.append((method.upper(), plural, subresource, status))

    def _injected_failure(self, request: Any) -> int | None:
        for index, (method, plural, subresource, status) in enumerate(self.failures):
            if (
                request.method.value.upper() == method
                and request.resource.plural == plural
                and request.subresource == subresource
            ):
                del self.failures[index]
                return status
        return None

    def _list_keys(self, request: Any) -> server_side_apply.ListKeys:
        schema = self._schema(request)
        if schema is None:
            return server_side_apply.builtin_list_keys
        return lambda names: structural.list_map_keys(schema, names)

    @staticmethod
    def _field_manager(request: Any) -> str:
        # The API server's default: the client's user agent up to its first "/".
        return (request.params or {}).get("fieldManager") or request.headers.get("User-Agent", "").split("/")[
            0
        ]

    def _record_update(self, request: Any) -> None:
        """managedFields for a create, update or merge patch of the main resource."""
        if request.subresource is not None or not isinstance(request.data, dict):
            return
        before = self._stored(request) if request.action == enums.action.UPDATE else None
        if request.action == enums.action.UPDATE and before is None:
            return
        after = dicts.patch_dict(before, request.data) if before is not None else copy.deepcopy(request.data)
        after = copy.deepcopy(dict(after))
        server_side_apply.record_update(
            before, after, self._field_manager(request), None, self._list_keys(request)
        )
        request.data.setdefault("metadata", {})["managedFields"] = after["metadata"]["managedFields"]

    async def _apply(self, request: Any) -> Any:
        """Server-side apply (server_side_apply.py): create or merge, with managedFields."""
        config = request.data if isinstance(request.data, dict) else yaml.safe_load(request.text or "{}")
        params = request.params or {}
        manager = params.get("fieldManager")
        plural = request.resource.plural or ""
        if not manager:
            return await _status_response(422, "Invalid", "fieldManager is required for apply requests")(
                request
            )
        if not isinstance(config, dict):
            return await _status_response(400, "BadRequest", "the apply configuration is not an object")(
                request
            )
        config.setdefault("metadata", {}).setdefault("name", request.name)
        if request.namespace:
            config["metadata"].setdefault("namespace", request.namespace)
        stored = self._stored(request)
        denial = self.denials.get(("create" if stored is None else "update", plural, request.name))
        if denial is not None:
            return await _denial_response(*denial)(request)
        problems = api_rules.problems(plural, config, creating=stored is None)
        schema = self._schema(request)
        if schema is not None:
            for path in structural.prune(schema, config, root=True):
                self.pruned.append((plural, request.name or "", path, request.headers.get("User-Agent", "")))
        api_rules.normalize(config)
        for normalizer in self.normalizers:
            normalizer(plural, config)
        try:
            result = server_side_apply.apply(
                stored, config, manager, params.get("force") == "true", self._list_keys(request)
            )
        except server_side_apply.ApplyConflict as conflict:
            return await _status_response(409, "Conflict", str(conflict))(request)
        if stored is not None:
            problems += api_rules.update_problems(plural, stored, result)
        refusal = self._cel_response(request, result)
        if refusal is not None:
            return await refusal(request)
        if problems:
            kind = (self.resources.get(request.resource) or kmock.ResourceInfo()).kind or plural
            message = f'{kind} "{request.name}" is invalid: ' + "; ".join(problems)
            return await _status_response(422, "Invalid", message)(request)
        key = (request.resource, request.namespace, request.name)
        if stored is None and self.slow_creates.get(plural):
            await asyncio.sleep(self.slow_creates[plural])
        async with self._lock:
            if stored is None:
                create = type("Create", (), {"data": result, "namespace": request.namespace})()
                self._stamp_create(create)
                if key in self._objects:
                    self._objects[key].create(result)
                else:
                    self._objects[key] = result
                raw = copy.deepcopy(self._objects[key].raw)
                await self._buses[request.resource].put({"type": "ADDED", "object": raw})
                return await kmock.Response(status=201, payload=raw)(request)
            if server_side_apply.same_fields(stored, result):
                return await kmock.Response(status=200, payload=stored)(request)
            meta = result["metadata"]
            if result.get("spec") != stored.get("spec"):
                meta["generation"] = int(stored["metadata"].get("generation", 1)) + 1
            meta["resourceVersion"] = str(next(self._resource_versions))
            self._objects[key].patch(server_side_apply.merge_patch_between(stored, result))
            raw = copy.deepcopy(self._objects[key].raw)
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return await kmock.Response(status=200, payload=raw)(request)

    def _unauthorized(self, request: Any) -> str | None:
        agent = request.headers.get("User-Agent", "")
        if self.authorizer is None or not agent.startswith(self.operator_agents):
            return None
        return self.authorizer(request)

    def _stale_write(self, request: Any) -> str | None:
        """A write that names a resourceVersion other than the stored one: a real server's
        optimistic concurrency (a Lease taken over between a read and a write is refused); a
        DELETE whose precondition names another object's uid (one of the same name since)."""
        if request.action == enums.action.DELETE and isinstance(request.data, dict):
            uid = (request.data.get("preconditions") or {}).get("uid")
            stored = self._peek(request)
            if uid is None or stored is None or stored["metadata"].get("uid") == uid:
                return None
            return (
                f"Precondition failed: UID in precondition: {uid}, UID in object meta: "
                f"{stored['metadata'].get('uid')}"
            )
        if request.action != enums.action.UPDATE or not isinstance(request.data, dict):
            return None
        given = (request.data.get("metadata") or {}).get("resourceVersion")
        stored = self._peek(request)
        if given is None or stored is None or str(given) == stored["metadata"].get("resourceVersion"):
            return None
        return (
            f'Operation cannot be fulfilled on {request.resource.plural} "{request.name}": the object '
            "has been modified; please apply your changes to the latest version and try again"
        )

    async def _handle(self, request: Any) -> Any:
        if request.action == enums.action.DELETE:
            self.deletions += 1
        refusal = self._unauthorized(request)
        if refusal is not None:
            self.forbidden.append(refusal)
            return await _status_response(403, "Forbidden", refusal)(request)
        if request.resource is not None:
            stale = self._stale_write(request)
            if stale is not None:
                return await _status_response(409, "Conflict", stale)(request)
            status = self._injected_failure(request)
            if status is not None:
                return await _status_response(status, "InternalError", "injected failure (test)")(request)
            if request.resource.plural == "pods" and request.subresource == "eviction":
                return await self._evict(request)
            content_type = request.headers.get("Content-Type", "")
            if request.method.value.upper() == "PATCH" and content_type.startswith("application/apply-patch"):
                return await self._apply(request)
            denial = self._denied(request)
            if denial is not None:
                return await _denial_response(*denial)(request)
        if request.resource is not None and isinstance(request.data, dict):
            plural = request.resource.plural or ""
            if request.action in (enums.action.CREATE, enums.action.UPDATE) and request.subresource is None:
                problems = api_rules.problems(
                    plural, request.data, creating=request.action == enums.action.CREATE
                )
                # Read only: a merge patch copies what it changes (copy-on-write).
                stored = self._peek(request) if request.action == enums.action.UPDATE else None
                if stored is not None and request.subresource is None:
                    problems += api_rules.update_problems(
                        plural, stored, dicts.patch_dict(stored, request.data)
                    )
                if problems:
                    kind = (self.resources.get(request.resource) or kmock.ResourceInfo()).kind or plural
                    name = (request.data.get("metadata") or {}).get("name") or request.name
                    message = f'{kind} "{name}" is invalid: ' + "; ".join(problems)
                    return await _status_response(422, "Invalid", message)(request)
                api_rules.normalize(request.data)
                for normalizer in self.normalizers:
                    normalizer(plural, request.data)
            if request.action in (enums.action.CREATE, enums.action.UPDATE):
                self._prune(request)
                if request.subresource is None and isinstance(request.data, dict):
                    stored = self._peek(request) if request.action == enums.action.UPDATE else None
                    result = dicts.patch_dict(stored, request.data) if stored is not None else request.data
                    refusal = self._cel_response(request, dict(result))
                    if refusal is not None:
                        return await refusal(request)
                self._record_update(request)
            if request.action == enums.action.CREATE:
                self._stamp_create(request)
                delay = self.slow_creates.get(plural)
                if delay:
                    await asyncio.sleep(delay)
            elif request.action == enums.action.UPDATE:
                self._stamp_update(request)
        if request.resource is not None and request.subresource == "scale":
            return await self._scale(request)
        if (
            request.action == enums.action.DELETE
            and request.resource is not None
            and request.resource.plural == "pods"
        ):
            response = await self._delete_pod(request)
            if response is not None:
                return response
        return await super()._handle(request)

    async def _scale(self, request: Any) -> Any:
        """GET / PATCH / PUT of `.../scale` for a custom resource (specReplicasPath .spec.replicas)."""
        try:
            stored = self.objects[request.resource, request.namespace, request.name]
        except KeyError:
            stored = None
        if stored is None or stored.deleted:
            return await _status_response(404, "NotFound", f"{request.name} not found")(request)
        if request.method.value.upper() in ("PATCH", "PUT"):
            replicas = (
                ((request.data or {}).get("spec") or {}).get("replicas")
                if isinstance(request.data, dict)
                else None
            )
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                return await _status_response(
                    422, "Invalid", "spec.replicas: must be a non-negative integer"
                )(request)
            async with self._lock:
                raw = stored.raw
                if (raw.get("spec") or {}).get("replicas") != replicas:
                    generation = int(raw["metadata"].get("generation", 1)) + 1
                    stored.patch(
                        {
                            "spec": {"replicas": replicas},
                            "metadata": {
                                "generation": generation,
                                "resourceVersion": str(next(self._resource_versions)),
                            },
                        }
                    )
                    await self._buses[request.resource].put(
                        {"type": "MODIFIED", "object": copy.deepcopy(stored.raw)}
                    )
        raw = stored.raw
        scale = {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                key: raw["metadata"].get(key) for key in ("name", "namespace", "uid", "resourceVersion")
            },
            "spec": {"replicas": (raw.get("spec") or {}).get("replicas", 0)},
            "status": {
                "replicas": (raw.get("status") or {}).get("replicas", 0),
                "selector": (raw.get("status") or {}).get("selector", ""),
            },
        }
        return await kmock.Response(status=200, payload=scale)(request)

    async def _evict(self, request: Any) -> Any:
        """POST pods/NAME/eviction (policy/v1 Eviction), as the API server answers it: 429 while a
        PodDisruptionBudget selecting the pod allows no disruption, else the pod's graceful
        deletion. A pod that is not running (Pending, Succeeded, Failed) or already terminating
        ignores the budgets; `deleteOptions.preconditions.uid` naming another pod is a 409."""
        if request.method.value.upper() != "POST":
            return await _status_response(405, "MethodNotAllowed", "the eviction subresource takes POST")(
                request
            )
        pod = self._stored(request)
        if pod is None:
            return await _status_response(404, "NotFound", f'pods "{request.name}" not found')(request)
        body = request.data if isinstance(request.data, dict) else {}
        options = body.get("deleteOptions") or {}
        uid = (options.get("preconditions") or {}).get("uid")
        if uid and uid != pod["metadata"].get("uid"):
            stored_uid = pod["metadata"].get("uid")
            message = f"Precondition failed: UID in precondition: {uid}, UID in object meta: {stored_uid}"
            return await _status_response(409, "Conflict", message)(request)
        running = (pod.get("status") or {}).get("phase") not in ("Pending", "Succeeded", "Failed")
        if running and not pod["metadata"].get("deletionTimestamp"):
            labels = pod["metadata"].get("labels") or {}
            budgets = [
                budget
                for budget in self._live("policy", "poddisruptionbudgets", request.namespace)
                if matches_label_selector((budget.get("spec") or {}).get("selector") or {}, labels)
            ]
            if len(budgets) > 1:
                message = "This pod has more than one PodDisruptionBudget, "
                message += "which the eviction subresource does not support."
                return await _status_response(500, "InternalError", message)(request)
            if budgets and disruptions_allowed(budgets[0], self._live("", "pods", request.namespace)) < 1:
                self.evictions.append((request.name, 429))
                message = "Cannot evict pod as it would violate the pod's disruption budget."
                return await _status_response(429, "TooManyRequests", message)(request)
        deletion = type(
            "Deletion",
            (),
            {
                "resource": request.resource,
                "namespace": request.namespace,
                "name": request.name,
                "data": {key: value for key, value in options.items() if key == "gracePeriodSeconds"},
                "params": {},
            },
        )()
        if await self._delete_pod(deletion) is None:  # not bound to a node: gone at once
            async with self._lock:
                stored = self.objects[request.resource, request.namespace, request.name]
                raw = copy.deepcopy(stored.raw)
                stored.delete()
                await self._buses[request.resource].put({"type": "DELETED", "object": raw})
        self.evictions.append((request.name, 201))
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        return await kmock.Response(status=201, payload=status)(request)

    def _live(self, group: str, plural: str, namespace: str | None) -> list[dict[str, Any]]:
        """The stored objects of one resource in a namespace (not deleted)."""
        store = self._objects._objects
        return [
            copy.deepcopy(store[key].raw)
            for (ns, _), key in store.keys_of(group, "v1", plural).items()
            if ns == namespace and not store[key].deleted
        ]

    async def _delete_pod(self, request: Any) -> Any:
        """Graceful deletion, as the API server does it for a pod bound to a node: the first
        DELETE only sets deletionTimestamp (+ the grace period); the kubelet stops the pod and
        confirms with gracePeriodSeconds=0, which removes it. Unbound pods go at once."""
        key = (request.resource, request.namespace, request.name)
        try:
            stored = self.objects[key]
        except KeyError:
            return None
        if stored.deleted:
            return None
        raw = copy.deepcopy(stored.raw)
        options = request.data if isinstance(request.data, dict) else {}
        grace = options.get("gracePeriodSeconds", (request.params or {}).get("gracePeriodSeconds"))
        bound = bool((raw.get("spec") or {}).get("nodeName"))
        if not bound or (grace is not None and int(grace) == 0):
            if raw["metadata"].get("deletionTimestamp") and not raw["metadata"].get("finalizers"):
                # kmock keeps an object already marked for deletion: remove it here.
                async with self._lock:
                    stored.delete()
                    await self._buses[request.resource].put({"type": "DELETED", "object": raw})
                return await kmock.Response(status=200, payload=raw)(request)
            return None
        if not raw["metadata"].get("deletionTimestamp"):
            if grace is None:
                grace = (raw.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
            stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            async with self._lock:
                stored.patch(
                    {
                        "metadata": {
                            "deletionTimestamp": stamp,
                            "deletionGracePeriodSeconds": int(grace),
                            "resourceVersion": str(next(self._resource_versions)),
                        }
                    }
                )
                raw = copy.deepcopy(stored.raw)
                await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return await kmock.Response(status=200, payload=raw)(request)

    def _stamp_create(self, request: Any) -> None:
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["generation"] = 1
        if request.namespace and "namespace" not in meta:
            meta["namespace"] = request.namespace
        meta["resourceVersion"] = str(next(self._resource_versions))

    def _stamp_update(self, request: Any) -> None:
        current = self._stored(request)
        if current is None:
            return  # kmock answers 404 itself
        patch = request.data
        if self._has_status_subresource(request.resource):
            # The API server keeps spec and status apart: /status writes only status, the
            # main resource never status.
            if request.subresource == "status":
                for key in [key for key in patch if key not in ("status", "metadata")]:
                    del patch[key]
            elif request.subresource is None:
                patch.pop("status", None)
        merged = dicts.patch_dict(current, patch)
        meta = patch.setdefault("metadata", {}) if isinstance(patch.get("metadata", {}), dict) else None
        if meta is None:
            return
        if merged.get("spec") != current.get("spec"):
            meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
        meta["resourceVersion"] = str(next(self._resource_versions))

    async def _render_error(self, exc: Exception) -> Any:
        # A 404 or 409 is an answer, not a fault: a real API server sends no traceback with it
        # (kmock formats one for every error: at 1,000 deployments, a tenth of its time). Faults
        # of the emulator itself (500s) keep theirs.
        if isinstance(exc, KubernetesError) and exc.status < 500:
            return aiohttp.web.json_response(
                {
                    "apiVersion": "v1",
                    "kind": "Status",
                    "metadata": {},
                    "code": exc.status,
                    "status": "Failure",
                    "reason": exc.reason or type(exc).__name__,
                    "message": exc.message or repr(exc),
                    "details": exc.details or {},
                },
                status=exc.status,
            )
        return await super()._render_error(exc)

    async def _serve_version(self, request: Any) -> Any:
        doc = await super()._serve_version(request)
        # /api/v1 discovery says groupVersion "/v1"; kubectl then finds no core kinds.
        if doc.get("groupVersion", "").startswith("/"):
            doc["groupVersion"] = doc["groupVersion"][1:]
        return doc

    async def _serve_create(self, request: Any) -> Any:
        return kmock.Response(status=201, payload=await super()._serve_create(request))

    async def _serve_list(self, request: Any) -> Any:
        doc = await super()._serve_list(request)
        resource = request.resource
        info = self.resources.get(resource)
        kind = info.kind if info is not None and info.kind else (resource.plural or "").capitalize()
        doc.setdefault(
            "apiVersion", f"{resource.group}/{resource.version}" if resource.group else resource.version
        )
        doc.setdefault("kind", f"{kind}List")
        return doc


def _denial_response(status: int, message: str) -> Any:
    return _status_response(status, "Forbidden" if status == 403 else "Invalid", message)


def _status_response(status: int, reason: str, message: str) -> Any:
    return kmock.Response(
        status=status,
        payload={
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": status,
        },
    )


def declare_resources(emulator: kmock.KubernetesEmulator, namespaces: tuple[str, ...] = ("default",)) -> None:
    """The built-in kinds, the LLMDeployment CRD's resource, and the given namespaces."""
    emulator.resources.load_bundled()
    emulator.resources["berth.dev/v1alpha1/llmdeployments"] = kmock.ResourceInfo(
        kind="LLMDeployment",
        singular="llmdeployment",
        namespaced=True,
        shortnames={"llmd"},
        categories={"all", "berth"},
        subresources={"status", "scale"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    )
    for group, version, plural, _, schema in structural.crd_schemas(CRD_FILE):
        emulator.schemas[group, version, plural] = schema
    for namespace in namespaces:
        emulator.objects["v1/namespaces", None, namespace] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace, "uid": str(uuid.uuid4())},
        }
