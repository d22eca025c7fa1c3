"""Kubernetes API access for the operator: plain dicts in and out, asyncio, one client.

The operator builds manifests as dicts (render.py) and compares them with what the API holds,
so typed models would only be converted back and forth. This wraps the async half of the
official client (`kubernetes.aio`) for its configuration loading (kubeconfig, in-cluster
service account, exec plugins), authentication and connection pool, and speaks the REST paths
of the handful of kinds the operator owns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import aiohttp
from kubernetes.aio import client as aio_client
from kubernetes.aio import config as aio_config

# kind -> plural of every kind the operator touches (the API is addressed by plural).
PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Event": "events",
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "NetworkPolicy": "networkpolicies",
    "LLMDeployment": "llmdeployments",
    "PodGroup": "podgroups",  # scheduler-plugins' and Volcano's (operator/gang.py)
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Node": "nodes",
    "PersistentVolumeClaim": "persistentvolumeclaims",  # the model volume's (operator/model_volume.py)
}

MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply (JSON is YAML)
FIELD_MANAGER = "berth-operator"


class KubeError(Exception):
    """A failed API call, with the server's status code and message."""

    def __init__(self, status: int, message: str, *, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}".strip())
        self.status = status
        self.message = message


class NotFound(KubeError):
    pass


class Unreachable(KubeError):
    """No HTTP answer at all (connection refused, reset, timed out)."""


class Conflict(KubeError):
    pass


def resource_path(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a collection or an object: /api/v1/... for core, /apis/G/V/... otherwise."""
    try:
        plural = PLURALS[kind]
    except KeyError:
        raise ValueError(f"kind {kind!r} is not one the operator manages ({', '.join(PLURALS)})") from None
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    if name:
        path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
    return path


def label_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def has_labels(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    own = obj.get("metadata", {}).get("labels") or {}
    return all(own.get(key) == value for key, value in labels.items())


class Kube:
    """Async CRUD on manifests as dicts. Missing objects read as None / False, not exceptions."""

    USER_AGENT = "berth-operator"

    def __init__(self, api_client: aio_client.ApiClient) -> None:
        self._api = api_client
        self._api.user_agent = self.USER_AGENT

    @classmethod
    async def connect(cls, kubeconfig: str | None = None) -> Kube:
        """In-cluster service account inside a pod, else a kubeconfig ($KUBECONFIG, ~/.kube/config)."""
        configuration = aio_client.Configuration()
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            aio_config.load_incluster_config(client_configuration=configuration)
        else:
            # The path is resolved now, not at import time (the client's own default is frozen
            # when its module is imported, which is too early for tests and for --kubeconfig).
            path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
            await aio_config.load_kube_config(config_file=path, client_configuration=configuration)
        return cls(aio_client.ApiClient(configuration))

    async def close(self) -> None:
        await self._api.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        serialized = await self._api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list(query.items()) if query else None,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = await self._api.call_api(*serialized)
            raw = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unreachable(0, f"{type(exc).__name__}: {exc}", method=method, path=path) from exc
        if not 200 <= response.status < 300:
            try:
                message = json.loads(raw).get("message") or raw.decode(errors="replace")
            except (ValueError, AttributeError):
                message = raw.decode(errors="replace")
            error = {404: NotFound, 409: Conflict}.get(response.status, KubeError)
            raise error(response.status, message, method=method, path=path)
        return json.loads(raw) if raw else None

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", resource_path(api_version, kind, namespace, name))
        except NotFound:
            return None

    async def list(
        self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        result = await self.request(
            "GET",
            resource_path(api_version, kind, namespace),
            query={"labelSelector": label_selector(labels)},
        )
        # Filter again on our side: the server's selector is the fast path, never the guarantee
        # that the caller sees only its own objects (kmock's emulator ignores selectors).
        return [item for item in result.get("items", []) if has_labels(item, labels)]

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return await self.request("POST", path, obj)

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        # JSON merge patch, not strategic merge: lists in the patch replace the live lists,
        # so the operator's desired containers/ports/ownerReferences are exactly what remains.
        path = resource_path(api_version, kind, namespace, name, subresource)
        return await self.request("PATCH", path, patch, content_type=MERGE_PATCH)

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply under the operator's field manager: the object ends up with exactly
        the fields `obj` sets among those the operator applied before (a field it no longer
        renders is removed), other managers' fields untouched. `force`: the operator's own
        fields are the operator's, whoever changed them since."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        query = {"fieldManager": FIELD_MANAGER, "force": "true"}
        return await self.request("PATCH", path, obj, query=query, content_type=APPLY_PATCH)

    async def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        grace_seconds: int | None = None,
        uid: str | None = None,
    ) -> bool:
        """Delete with background propagation (dependents go through the garbage collector);
        `grace_seconds` overrides a pod's termination grace period (0: at once, no kubelet asked).
        `uid`: only that object (a precondition): one of the same name made since is left alone.
        False when there was nothing (of that uid) to delete."""
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
        }
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", resource_path(api_version, kind, namespace, name), body)
        except NotFound:
            return False
        except Conflict:
            if uid is None:
                raise
            return False  # the precondition failed: the name is another object's now
        return True
