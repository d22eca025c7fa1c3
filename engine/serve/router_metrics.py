"""The router's `/metrics`: what it answered, which servers of each role took or passed over its
halves, and how long the context half (prompt, first token, KV handle) took, the floor of a
split request's time to first token. The engines' own series stay on the engines (their
`X-Request-Id` ties a request's two halves together there)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from berth.engine.serve.metrics import LATENCY_BUCKETS

# How a server of a role met one half: it took it (whatever it answered), answered 503 (asleep,
# draining, starting) or refused the connection; the last two pass the half to another server.
UPSTREAM_OUTCOMES = ("taken", "not_ready", "unreachable")


class RouterMetrics:
    def __init__(self, routes: dict[str, list[str]], in_flight: Callable[[], float]) -> None:
        self.registry = r = CollectorRegistry()
        self._answered = Counter(
            "berth_router_requests",
            "Requests the router answered, by HTTP status code.",
            ["code"],
            registry=r,
        )
        Gauge(
            "berth_router_requests_in_flight", "Requests between the router and its servers now.", registry=r
        ).set_function(in_flight)
        upstream = Counter(
            "berth_router_upstream_requests",
            "Halves of requests sent to a server of a role, by how the server met them.",
            ["role", "server", "outcome"],
            registry=r,
        )
        # Every series from the start: a rate over a counter that appears late misses its first rise.
        self._upstream = {
            (role, url, outcome): upstream.labels(role, url, outcome)
            for role, urls in routes.items()
            for url in urls
            for outcome in UPSTREAM_OUTCOMES
        }
        self.handovers = Counter(
            "berth_router_kv_handovers",
            "Context halves that handed a KV cache on to the generation role.",
            registry=r,
        )
        self.context_seconds = Histogram(
            "berth_router_context_duration_seconds",
            "Time of a request's context half (its prompt, first token and KV handle).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        for code in ("200", "400", "401", "502"):
            self._answered.labels(code)

    def answered(self, status_code: int) -> None:
        self._answered.labels(str(status_code)).inc()

    def upstream(self, role: str, url: str, outcome: str) -> None:
        self._upstream[role, url, outcome].inc()
