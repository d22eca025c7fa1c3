"""The API server's RBAC authorizer, for the operator's requests in tests: the shipped Roles,
ClusterRoles and their bindings (manifests/) decide, as a real server's would, whether the
operator's ServiceAccount may make a request; a request they do not allow is answered 403.

Only the operator's own requests are judged (its User-Agents: kopf's and berth's client); the
test's kubectl and simulated controllers act as cluster admins. Discovery (no resource) is
allowed, as `system:discovery` allows it to every authenticated user.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Request method + kmock action -> the RBAC verb.
VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete"}


@dataclass(frozen=True)
class Attributes:
    """What RBAC judges a request by."""

    group: str
    resource: str  # plural, with "/subresource"
    verb: str
    namespace: str | None
    name: str | None = None


def attributes(request: Any) -> Attributes | None:
    """The RBAC attributes of a kmock request (None: no resource, i.e. discovery)."""
    if request.resource is None or not request.resource.plural:
        return None
    action = str(request.action.value if hasattr(request.action, "value") else request.action)
    method = request.method.value.upper()
    verb = {"PATCH": "patch", "PUT": "update"}.get(method) or VERBS.get(action.upper(), action.lower())
    resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
    return Attributes(request.resource.group or "", resource, verb, request.namespace, request.name)


def _allows(rule: dict[str, Any], wanted: Attributes) -> bool:
    def has(values: Iterable[str], value: str) -> bool:
        values = list(values)
        return "*" in values or value in values

    names = rule.get("resourceNames")
    return (
        has(rule.get("apiGroups", []), wanted.group)
        and has(rule.get("resources", []), wanted.resource)
        and has(rule.get("verbs", []), wanted.verb)
        and (not names or wanted.name in names)
    )


@dataclass
class Authorizer:
    """RBAC for one ServiceAccount over a set of manifests."""

    documents: list[dict[str, Any]]
    service_account: str = "berth-operator"
    account_namespace: str = "berth-system"

    @classmethod
    def from_files(cls, *paths: Path, **kwargs: Any) -> Authorizer:
        docs = [doc for path in paths for doc in yaml.safe_load_all(path.read_text()) if doc]
        return cls(docs, **kwargs)

    def _kind(self, kind: str) -> list[dict[str, Any]]:
        return [doc for doc in self.documents if doc.get("kind") == kind]

    def _binds_us(self, binding: dict[str, Any]) -> bool:
        for subject in binding.get("subjects") or []:
            namespace = subject.get("namespace") or binding["metadata"].get("namespace")
            if (
                subject.get("kind") == "ServiceAccount"
                and subject.get("name") == self.service_account
                and namespace == self.account_namespace
            ):
                return True
        return False

    def _role(self, kind: str, name: str, namespace: str | None) -> dict[str, Any] | None:
        return next(
            (
                doc
                for doc in self._kind(kind)
                if doc["metadata"]["name"] == name
                and (kind == "ClusterRole" or doc["metadata"].get("namespace") == namespace)
            ),
            None,
        )

    def rules_for(self, namespace: str | None) -> list[dict[str, Any]]:
        """The rules that apply to a request in `namespace` (None: cluster-scoped or across all
        namespaces): ClusterRoleBindings' everywhere, RoleBindings' in their namespace only."""
        rules: list[dict[str, Any]] = []
        for binding in self._kind("ClusterRoleBinding"):
            if self._binds_us(binding):
                role = self._role("ClusterRole", binding["roleRef"]["name"], None)
                rules += (role or {}).get("rules") or []
        if namespace is not None:
            for binding in self._kind("RoleBinding"):
                if binding["metadata"].get("namespace") == namespace and self._binds_us(binding):
                    ref = binding["roleRef"]
                    role = self._role(ref["kind"], ref["name"], namespace)
                    rules += (role or {}).get("rules") or []
        return rules

    def allows(self, wanted: Attributes) -> bool:
        return any(_allows(rule, wanted) for rule in self.rules_for(wanted.namespace))

    def granted(self, namespace: str | None) -> set[tuple[str, str, str]]:
        """Every (group, resource, verb) the rules grant in `namespace`."""
        return {
            (group, resource, verb)
            for rule in self.rules_for(namespace)
            for group in rule.get("apiGroups", [])
            for resource in rule.get("resources", [])
            for verb in rule.get("verbs", [])
        }

    def refusal(self, request: Any) -> str | None:
        """None when allowed; else the API server's message for the 403."""
        wanted = attributes(request)
        if wanted is None or self.allows(wanted):
            return None
        where = f' in the namespace "{wanted.namespace}"' if wanted.namespace else " at the cluster scope"
        resource, _, sub = wanted.resource.partition("/")
        return (
            f"{resource}{'/' + sub if sub else ''} is forbidden: User "
            f'"system:serviceaccount:{self.account_namespace}:{self.service_account}" cannot '
            f'{wanted.verb} resource "{wanted.resource}" in API group "{wanted.group}"{where}'
        )
