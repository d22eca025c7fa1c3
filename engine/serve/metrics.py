"""`/metrics`: Prometheus series named and meant like vLLM's (`vllm:` -> `berth:`), so its
dashboards and alerts carry over. Every series is labelled with `model_name`.

Latencies are measured where the client's experience is: in the server, from the moment a
request is submitted to the engine. Each app has its own registry, so several servers can
live in one process (the tests do this).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from berth.engine.outputs import RequestOutput

ADMISSION_STATES = ("running", "parking", "parked", "waking", "failed")

# Bucket edges in seconds, from sub-millisecond CPU steps to minutes-long requests.
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("berth:num_requests_running", "Requests in the engine's batch.")
        self.num_requests_waiting = gauge("berth:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("berth:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.engine_healthy = gauge("berth:engine_healthy", "1 while the engine lives, 0 once it is dead.")
        self._admission = Gauge(
            "berth:engine_admission_state",
            "1 for the engine's current admission state, 0 for the others.",
            ["model_name", "state"],
            registry=r,
        )
        self._admission_by_state = {s: self._admission.labels(model_name, s) for s in ADMISSION_STATES}
        self.num_preemptions = counter("berth:num_preemptions", "Sequences preempted (recomputed later).")
        self.prompt_tokens = counter("berth:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("berth:generation_tokens", "Tokens generated for finished requests.")
        self._request_success = Counter(
            "berth:request_success",
            "Finished sequences (one per choice: n=2 counts twice), by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._model_name = model_name
        self.request_prompt_tokens = histogram(
            "berth:request_prompt_tokens", "Prompt length of finished requests.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "berth:request_generation_tokens", "Tokens generated per finished request.", TOKEN_COUNT_BUCKETS
        )
        self.time_to_first_token = histogram(
            "berth:time_to_first_token_seconds",
            "From submission to the first generated token.",
            LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "berth:inter_token_latency_seconds",
            "Between consecutive engine steps that gave a request new tokens.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "berth:e2e_request_latency_seconds", "From submission to the last token.", LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "berth:request_queue_time_seconds",
            "From arrival in the engine to first scheduled.",
            LATENCY_BUCKETS,
        )
        self._preemptions_seen = 0

    def refresh(self, executor) -> None:
        """Brings the gauges up to date with the engine's latest stats (called at scrape time)."""
        healthy = not executor.is_dead
        self.engine_healthy.set(1 if healthy else 0)
        stats = executor.stats
        if stats is not None:
            self.num_requests_running.set(stats.num_running)
            self.num_requests_waiting.set(stats.num_waiting)
            total = stats.kv_blocks_total
            self.kv_cache_usage.set(stats.kv_blocks_used / total if total else 0.0)
            preemptions = getattr(stats, "num_preemptions", 0)
            if preemptions > self._preemptions_seen:
                self.num_preemptions.inc(preemptions - self._preemptions_seen)
                self._preemptions_seen = preemptions
        state = "failed" if not healthy else (stats.admission if stats is not None else "running")
        for name, child in self._admission_by_state.items():
            child.set(1 if name == state else 0)

    def track(self, num_prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, num_prompt_tokens)

    def finished_sequence(self, reason: str) -> None:
        self._request_success.labels(self._model_name, reason).inc()


class RequestTimer:
    """Times one engine request from its streamed updates and records it when it finishes."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self._metrics = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._submitted = time.perf_counter()
        self._last_token_at: float | None = None
        self._tokens_seen = 0

    def update(self, output: RequestOutput, queue_seconds: float | None) -> None:
        tokens = sum(len(o.token_ids) for o in output.outputs)
        now = time.perf_counter()
        if tokens > self._tokens_seen:
            if self._last_token_at is None:
                self._metrics.time_to_first_token.observe(now - self._submitted)
            else:
                self._metrics.inter_token_latency.observe(now - self._last_token_at)
            self._last_token_at = now
            self._tokens_seen = tokens
        if output.finished:
            self._finish(output, queue_seconds, now)

    def _finish(self, output: RequestOutput, queue_seconds: float | None, now: float) -> None:
        m = self._metrics
        m.e2e_request_latency.observe(now - self._submitted)
        if queue_seconds is not None:
            m.request_queue_time.observe(queue_seconds)
        m.prompt_tokens.inc(self._num_prompt_tokens)
        m.generation_tokens.inc(self._tokens_seen)
        m.request_prompt_tokens.observe(self._num_prompt_tokens)
        m.request_generation_tokens.observe(self._tokens_seen)
        for sequence in output.outputs:
            m.finished_sequence(sequence.finish_reason or "abort")
