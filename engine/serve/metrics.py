"""`/metrics`: Prometheus series named and meant like vLLM's (`vllm:` -> `berth_`), so its
dashboards and alerts carry over by a change of prefix. Not `berth:`: Prometheus keeps colons
for recording rules, and `promtool check metrics` refuses them in what a target exports.
Every series is labelled with `model_name`.

Latencies are measured where the client's experience is: in the server, from the moment a
request is submitted to the engine. Inter-token latency, as vLLM means it, is the time
between consecutive engine steps that brought a request new tokens, read from the engine's
own step times: however updates coalesce on their way to a slow consumer, every step counts.
Each app has its own registry, so several servers can live in one process (the tests do this).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from berth.engine.outputs import RequestOutput

ADMISSION_STATES = ("running", "parking", "parked", "waking", "failed", "shutdown")
# Where a request can fail alone on an internal error (RequestError.stage).
ERROR_STAGES = ("admission", "sampling", "postprocess")
# The states a sleep or wakeup moves the engine to (the labels of sleep_transitions_total).
TRANSITION_TARGETS = ("parking", "parked", "waking", "running", "failed")

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

        self.num_requests_running = gauge("berth_num_requests_running", "Requests in the engine's batch.")
        self.num_requests_waiting = gauge("berth_num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("berth_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.engine_healthy = gauge("berth_engine_healthy", "1 while the engine lives, 0 once it is dead.")
        self._admission = Gauge(
            "berth_engine_admission_state",
            "1 for the engine's current admission state, 0 for the others.",
            ["model_name", "state"],
            registry=r,
        )
        self._admission_by_state = {s: self._admission.labels(model_name, s) for s in ADMISSION_STATES}
        transitions = Counter(
            "berth_sleep_transitions",
            "Admission transitions of sleep and wakeup, by the state reached.",
            ["model_name", "to"],
            registry=r,
        )
        self._transitions_to = {to: transitions.labels(model_name, to) for to in TRANSITION_TARGETS}
        durations = Histogram(
            "berth_sleep_transition_duration_seconds",
            "How long a sleep (drain included) or a wakeup took in the engine.",
            ["model_name", "transition"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._transition_durations = {
            kind: durations.labels(model_name, kind) for kind in ("sleep", "wakeup")
        }
        # Memory: what the engine holds now, and how its KV pool was sized at start.
        self.weight_bytes = gauge("berth_weight_bytes", "Bytes of weights the engine holds on its device.")
        self.kv_cache_bytes = gauge(
            "berth_kv_cache_bytes", "Bytes of KV cache the engine holds now (0 while a sleep has freed it)."
        )
        self.kv_cache_blocks = gauge("berth_kv_cache_blocks", "Blocks in the KV pool.")
        self.kv_cache_pool_bytes = gauge(
            "berth_kv_cache_pool_bytes", "Bytes of the KV pool, as sized at start."
        )
        self.kv_cache_bytes_per_token = gauge(
            "berth_kv_cache_bytes_per_token", "KV cache bytes one token of context takes."
        )
        self.kv_cache_tokens = gauge("berth_kv_cache_tokens", "Tokens of context the KV pool holds.")
        self._memory_limit = Gauge(
            "berth_memory_limit_bytes",
            "The memory limit the KV pool was sized under, by where it came from (1 series).",
            ["model_name", "source"],
            registry=r,
        )
        self.engine_resident_bytes = gauge(
            "berth_engine_resident_memory_bytes", "Resident memory of the engine's process (rank 0)."
        )
        self.num_preemptions = counter("berth_num_preemptions", "Sequences preempted (recomputed later).")
        self.prefix_cache_queries = counter(
            "berth_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "berth_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again)."
        )
        self.prompt_tokens = counter("berth_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("berth_generation_tokens", "Tokens generated for finished requests.")
        self._request_success = Counter(
            "berth_request_success",
            "Finished sequences (one per choice: n=2 counts twice), by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._model_name = model_name
        request_errors = Counter(
            "berth_request_errors",
            "Requests that failed alone on an internal error (the engine went on), by where.",
            ["model_name", "stage"],
            registry=r,
        )
        for stage in ERROR_STAGES:  # every series from the start (at 0): rates work from the first error
            request_errors.labels(model_name, stage)
        self._request_errors = request_errors
        self.request_prompt_tokens = histogram(
            "berth_request_prompt_tokens", "Prompt length of finished requests.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "berth_request_generation_tokens", "Tokens generated per finished request.", TOKEN_COUNT_BUCKETS
        )
        self.time_to_first_token = histogram(
            "berth_time_to_first_token_seconds",
            "From submission to the first generated token.",
            LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "berth_inter_token_latency_seconds",
            "Between consecutive engine steps that gave a request new tokens.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "berth_e2e_request_latency_seconds", "From submission to the last token.", LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "berth_request_queue_time_seconds",
            "From arrival in the engine to first scheduled.",
            LATENCY_BUCKETS,
        )
        self._engine_totals: dict[str, int] = {}  # what the counters above have caught up with

    def refresh(self, executor) -> None:
        """Brings the gauges up to date with the engine's latest stats (called at scrape time).
        A dead engine's stats say it holds nothing: the gauges drop to zero with it."""
        self.engine_healthy.set(0 if executor.is_dead else 1)
        stats = executor.stats
        if stats is not None:
            self.num_requests_running.set(stats.num_running)
            self.num_requests_waiting.set(stats.num_waiting)
            total = stats.kv_blocks_total
            self.kv_cache_usage.set(stats.kv_blocks_used / total if total else 0.0)
            self.weight_bytes.set(stats.weight_bytes)
            self.kv_cache_bytes.set(stats.kv_cache_bytes)
            self.engine_resident_bytes.set(stats.resident_bytes)
            self._catch_up(self.num_preemptions, "preemptions", stats.num_preemptions)
            self._catch_up(self.prefix_cache_queries, "queries", stats.prefix_cache_queries)
            self._catch_up(self.prefix_cache_hits, "hits", stats.prefix_cache_hits)
            for to, count in stats.transitions.items():
                if to in self._transitions_to and to != "failed":  # a failed engine never says so
                    self._catch_up(self._transitions_to[to], f"to {to}", count)
        plan = executor.limits.kv_cache if executor.limits is not None else None
        if plan is not None:
            self.kv_cache_blocks.set(plan.num_blocks)
            self.kv_cache_pool_bytes.set(plan.pool_bytes)
            self.kv_cache_bytes_per_token.set(plan.bytes_per_token)
            self.kv_cache_tokens.set(plan.num_tokens)
            self._memory_limit.labels(self._model_name, plan.limit_source).set(plan.limit_bytes)
        state = executor.admission_state
        for name, child in self._admission_by_state.items():
            child.set(1 if name == state else 0)

    def _catch_up(self, counter, key: str, engine_total: int) -> None:
        """Moves `counter` to the engine's running total (which only grows while it lives)."""
        seen = self._engine_totals.get(key, 0)
        if engine_total > seen:
            counter.inc(engine_total - seen)
            self._engine_totals[key] = engine_total

    def transition_done(self, kind: str, seconds: float) -> None:
        self._transition_durations[kind].observe(seconds)

    def transition_failed(self) -> None:
        """A sleep or wakeup this server asked for ended with the engine's death."""
        self._transitions_to["failed"].inc()

    def track(self, num_prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, num_prompt_tokens)

    def finished_sequence(self, reason: str) -> None:
        self._request_success.labels(self._model_name, reason).inc()

    def request_failed(self, error: BaseException) -> None:
        """Counts a request that failed alone on an internal error, by the stage it failed in."""
        stage = getattr(error, "stage", None)
        if getattr(error, "code", None) == "internal" and stage is not None:
            self._request_errors.labels(self._model_name, stage).inc()


class RequestTimer:
    """Times one engine request from its streamed updates and records it when it finishes."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self._metrics = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._submitted = time.perf_counter()
        self._tokens_seen = 0
        self._steps_seen = 0  # of the result's token step times, those already measured

    def update(self, output: RequestOutput, result) -> None:
        """`result` is the GenerationResult `output` came from: its engine step times."""
        tokens = sum(len(o.token_ids) for o in output.outputs)
        now = time.perf_counter()
        if tokens > self._tokens_seen:
            if self._tokens_seen == 0:
                self._metrics.time_to_first_token.observe(now - self._submitted)
            self._tokens_seen = tokens
        steps = result.token_step_times  # appended to by the dispatch thread: read up to a length
        count = len(steps)
        for i in range(max(1, self._steps_seen), count):
            self._metrics.inter_token_latency.observe(max(0.0, steps[i] - steps[i - 1]))
        self._steps_seen = count
        if output.finished:
            self._finish(output, result.queue_seconds, now)

    def failed(self, error: BaseException) -> None:
        self._metrics.request_failed(error)

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
