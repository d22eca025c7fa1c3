"""Reading a world's engine: `GET /health`, `GET /ready` and `GET /admin/state` on its launcher.

The launcher's address comes from one replaceable function (`AddressResolver`): in a cluster
it is the pod IP with the engine port and the admin port (the admin routes listen on a port of
their own that no Service exposes); tests map a launcher pod to a real server on 127.0.0.1.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import httpx

from berth.operator import naming


class Address(NamedTuple):
    """Where an engine answers: its public port (OpenAI API and probes) and its admin port."""

    host: str
    port: int
    admin_port: int | None = None  # None: the admin routes answer on `port` (no --admin-port)

    @property
    def admin(self) -> Address:
        return Address(self.host, self.admin_port or self.port)


AddressResolver = Callable[[Mapping[str, Any]], "Awaitable[tuple | None] | tuple | None"]


def pod_address(pod: Mapping[str, Any]) -> Address | None:
    """The default resolver: the pod's IP, the engine port and the admin port (None until the
    pod has an IP)."""
    ip = (pod.get("status") or {}).get("podIP")
    return Address(ip, naming.ENGINE_PORT, naming.ADMIN_PORT) if ip else None


async def resolve(resolver: AddressResolver, pod: Mapping[str, Any]) -> Address | None:
    """The resolver's answer as an Address (a resolver may answer a plain (host, port): an
    engine serving its admin routes on its public port)."""
    address = resolver(pod)
    if inspect.isawaitable(address):
        address = await address
    return Address(*address) if address is not None else None


@dataclass(frozen=True)
class Probe:
    """One poll of an engine. status: alive (200), dead (engine_dead), unreachable (no answer)."""

    status: Literal["alive", "dead", "unreachable"]
    ready: bool = False
    admission: str | None = None
    error: str | None = None
    death: str | None = None  # a dead engine's reason: "stalled" (alive, no progress) or "died"
    loading: str | None = None  # while the engine loads: how far it has come, in words
    seconds: float = 0.0
    # From /admin/state (None without the admin token, or when it did not answer).
    model_revision: str | None = None  # "PATH@DIGEST"
    model_label: str | None = None  # the name its weights were loaded under (spec.model.revision)
    sleep_level: int | None = None
    load: EngineLoad | None = None  # what autoscaling reads


@dataclass(frozen=True)
class EngineLoad:
    """An engine's load, from /admin/state."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    computed_tokens: int = 0  # prefill and decode tokens run since the engine started

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> EngineLoad:
        def number(key: str, kind: type) -> Any:
            value = state.get(key)
            return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else kind()

        return cls(
            number("num_running", int),
            number("num_waiting", int),
            number("kv_cache_usage", float),
            number("num_computed_tokens", int),
        )


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def base_url(address: Address) -> str:
    """http://HOST:PORT, with an IPv6 pod IP in brackets (http://[fd00::5]:8000)."""
    host, port = address[:2]
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def admin_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def revision_text(revision: Any) -> str | None:
    """The engine's `model_revision` ({path, digest}) as one string, the digest shortened."""
    if not isinstance(revision, Mapping) or not revision.get("path"):
        return None
    return f"{revision['path']}@{str(revision.get('digest') or '')[:19]}"


def revision_label(revision: Any) -> str | None:
    label = revision.get("label") if isinstance(revision, Mapping) else None
    return label if isinstance(label, str) and label else None


async def probe(
    client: httpx.AsyncClient, address: Address, timeout: float, admin_token: str | None = None
) -> Probe:
    """Poll /health, then /ready (and /admin/state with a token) when alive. Never raises:
    every failure is a Probe."""
    base = base_url(address)
    started = time.perf_counter()
    try:
        health = await client.get(f"{base}/health", timeout=timeout)
        body = _json(health)
        if health.status_code != 200:
            if body.get("engine_dead"):
                error = str(body.get("error") or "engine reported dead without an error text")
                death = str(body.get("reason") or "died")
                return Probe("dead", error=error, death=death, seconds=time.perf_counter() - started)
            return Probe(
                "unreachable",
                error=f"/health answered HTTP {health.status_code}",
                seconds=time.perf_counter() - started,
            )
        ready = await client.get(f"{base}/ready", timeout=timeout)
        ready_body = _json(ready)
        admission = ready_body.get("admission") or ("running" if ready.status_code == 200 else None)
        loading = ready_body.get("loading") if isinstance(ready_body.get("loading"), dict) else None
        revision, label, level, load = None, None, None, None
        if admin_token:
            # Details only: readiness stays the engine's own /ready answer (what the kubelet sees).
            state = await client.get(
                f"{base_url(address.admin)}/admin/state", headers=admin_headers(admin_token), timeout=timeout
            )
            if state.status_code == 200:
                body = _json(state)
                revision = revision_text(body.get("model_revision"))
                label = revision_label(body.get("model_revision"))
                level = body.get("sleep_level") if isinstance(body.get("sleep_level"), int) else None
                load = EngineLoad.of(body)
        return Probe(
            "alive",
            ready=ready.status_code == 200,
            admission=admission,
            loading=f"{loading.get('message')} ({loading.get('seconds')} s)" if loading else None,
            seconds=time.perf_counter() - started,
            model_revision=revision,
            model_label=label,
            sleep_level=level,
            load=load,
        )
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        # InvalidURL is no HTTPError: an address that cannot be a URL must not end the daemon.
        return Probe(
            "unreachable", error=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - started
        )
