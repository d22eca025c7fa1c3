"""Reading a world's engine: `GET /health` and `GET /ready` on its launcher.

The launcher's address comes from one replaceable function (`AddressResolver`): in a cluster
it is the pod IP and the engine port; tests map a launcher pod to a real server on 127.0.0.1.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from berth.operator import naming

Address = tuple[str, int]
AddressResolver = Callable[[Mapping[str, Any]], "Awaitable[Address | None] | Address | None"]


def pod_address(pod: Mapping[str, Any]) -> Address | None:
    """The default resolver: the pod's IP and the engine port (None until the pod has an IP)."""
    ip = (pod.get("status") or {}).get("podIP")
    return (ip, naming.ENGINE_PORT) if ip else None


async def resolve(resolver: AddressResolver, pod: Mapping[str, Any]) -> Address | None:
    address = resolver(pod)
    if inspect.isawaitable(address):
        address = await address
    return address


@dataclass(frozen=True)
class Probe:
    """One poll of an engine. status: alive (200), dead (engine_dead), unreachable (no answer)."""

    status: Literal["alive", "dead", "unreachable"]
    ready: bool = False
    admission: str | None = None
    error: str | None = None
    seconds: float = 0.0


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


async def probe(client: httpx.AsyncClient, address: Address, timeout: float) -> Probe:
    """Poll /health, then /ready when alive. Never raises: every failure is a Probe."""
    host, port = address
    base = f"http://{host}:{port}"
    started = time.perf_counter()
    try:
        health = await client.get(f"{base}/health", timeout=timeout)
        body = _json(health)
        if health.status_code != 200:
            if body.get("engine_dead"):
                error = str(body.get("error") or "engine reported dead without an error text")
                return Probe("dead", error=error, seconds=time.perf_counter() - started)
            return Probe(
                "unreachable",
                error=f"/health answered HTTP {health.status_code}",
                seconds=time.perf_counter() - started,
            )
        ready = await client.get(f"{base}/ready", timeout=timeout)
        ready_body = _json(ready)
        admission = ready_body.get("admission") or ("running" if ready.status_code == 200 else None)
        return Probe(
            "alive",
            ready=ready.status_code == 200,
            admission=admission,
            seconds=time.perf_counter() - started,
        )
    except httpx.HTTPError as exc:
        return Probe(
            "unreachable", error=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - started
        )
