"""`/metrics` parses as Prometheus text, names its series like vLLM's, labels every one with the
model, and its counters move by exactly the requests and tokens sent. A client that goes away
mid-request aborts its engine request: the metrics say "abort" and the engine is idle again."""

from __future__ import annotations

import json
import socket
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.server_process import ENGINE_ARGS, MODEL_NAME, ServerProcess

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

COUNTERS = (
    "berth_request_success",
    "berth_prompt_tokens",
    "berth_generation_tokens",
    "berth_num_preemptions",
    "berth_prefix_cache_queries",
    "berth_prefix_cache_hits",
    "berth_sleep_transitions",
)
HISTOGRAMS = (
    "berth_time_to_first_token_seconds",
    "berth_inter_token_latency_seconds",
    "berth_e2e_request_latency_seconds",
    "berth_request_queue_time_seconds",
    "berth_request_prompt_tokens",
    "berth_request_generation_tokens",
)
GAUGES = (
    "berth_num_requests_running",
    "berth_num_requests_waiting",
    "berth_kv_cache_usage_perc",
    "berth_engine_healthy",
    "berth_engine_admission_state",
    "berth_weight_bytes",
    "berth_kv_cache_bytes",
    "berth_kv_cache_blocks",
    "berth_kv_cache_pool_bytes",
    "berth_kv_cache_tokens",
    "berth_kv_cache_bytes_per_token",
    "berth_memory_limit_bytes",
    "berth_engine_resident_memory_bytes",
)


def scrape(server: ServerProcess) -> tuple[dict, Samples]:
    response = server.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items())))
    return samples.get(key, 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def idle_samples(server: ServerProcess) -> Samples:
    assert server.wait_idle(), server.admin_state()
    return scrape(server)[1]


def test_the_exposition_has_vllms_series_each_labelled_with_the_model(server):
    families, samples = scrape(server)
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name in (*HISTOGRAMS, "berth_sleep_transition_duration_seconds"):  # the last: per transition
        assert families[name].type == "histogram", name
    for name in GAUGES:
        assert families[name].type == "gauge", name
    assert all(dict(labels)["model_name"] == MODEL_NAME for _, labels in samples)
    assert not any(name.endswith("_created") for name, _ in samples)
    assert value(samples, "berth_engine_healthy") == 1
    assert value(samples, "berth_engine_admission_state", state="running") == 1
    assert value(samples, "berth_engine_admission_state", state="parked") == 0


def test_counters_move_by_exactly_the_requests_and_tokens_sent(server, client):
    before = idle_samples(server)

    replies = [
        client.completions.create(
            model=MODEL_NAME, prompt=[[5] * 5, [6] * 7], n=2, max_tokens=6, extra_body={"ignore_eos": True}
        ),
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=20, stop=["e", "a"]
        ),
    ]
    streamed_reasons = []
    streamed_usage = None
    for chunk in client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=1, stream=True, stream_options={"include_usage": True}
    ):
        streamed_reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        streamed_usage = chunk.usage or streamed_usage
    engine_requests = 2 + 1 + 1  # one per prompt: n choices share one engine request

    after = idle_samples(server)
    reasons = Counter(c.finish_reason for r in replies for c in r.choices) + Counter(streamed_reasons)
    usages = [r.usage for r in replies] + [streamed_usage]
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generation_tokens = sum(u.completion_tokens for u in usages)
    assert prompt_tokens == 5 + 7 + replies[1].usage.prompt_tokens + streamed_usage.prompt_tokens
    assert replies[0].usage.completion_tokens == 4 * 6

    for reason in ("length", "stop", "abort"):
        assert delta(before, after, "berth_request_success_total", finished_reason=reason) == reasons[reason]
    assert delta(before, after, "berth_prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "berth_generation_tokens_total") == generation_tokens
    for name in HISTOGRAMS:
        if name != "berth_inter_token_latency_seconds":
            assert delta(before, after, f"{name}_count") == engine_requests, name
    assert delta(before, after, "berth_request_prompt_tokens_sum") == prompt_tokens
    assert delta(before, after, "berth_request_generation_tokens_sum") == generation_tokens
    # One gap per engine step after a request's first that brought it tokens, however the
    # server consumed them: a step gives each of a request's sequences one token (the n=2
    # choices of a prompt step together), so each prompt's steps are its choices' length.
    steps = [6, 6, replies[1].usage.completion_tokens, 1]
    assert delta(before, after, "berth_inter_token_latency_seconds_count") == sum(n - 1 for n in steps)
    assert value(after, "berth_num_requests_running") == 0
    assert value(after, "berth_num_requests_waiting") == 0


def test_the_prefix_cache_counts_its_queries_and_hits_and_admin_state_shows_cached_blocks(server, client):
    prompt = list(range(400, 448))  # three full blocks of 16
    before = idle_samples(server)
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    after = idle_samples(server)
    assert delta(before, after, "berth_prefix_cache_queries_total") == 2 * len(prompt)
    # The second request found the first one's blocks but the last (it computes its last token).
    assert delta(before, after, "berth_prefix_cache_hits_total") == 2 * 16
    state = server.admin_state()
    assert state["prefix_caching"] is True and state["kv_blocks_used"] == 0
    # Held by nobody, but cached (the shared server's pool may be full of them: new ones evict
    # the least recently used).
    assert 3 <= state["kv_blocks_cached"] <= state["kv_blocks_total"]


def test_no_prefix_caching_computes_every_prompt_in_full(tiny_model):
    server = ServerProcess(tiny_model, *ENGINE_ARGS, "--no-prefix-caching")
    try:
        for _ in range(2):
            assert server.post(
                "/v1/completions", {"prompt": list(range(400, 448)), "max_tokens": 1}
            ).is_success
        _, samples = scrape(server)
        assert value(samples, "berth_prefix_cache_hits_total", model_name=str(tiny_model)) == 0
        state = server.admin_state()
        assert state["prefix_caching"] is False and state["kv_blocks_cached"] == 0
        assert "prefix caching off" in server.output
    finally:
        assert server.stop() == 0, server.output


def test_a_client_leaving_mid_stream_aborts_its_request(server):
    before = idle_samples(server)
    n, max_tokens = 16, 240
    body = {"prompt": [5] * 8, "n": n, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=server.headers(), timeout=30
    ) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # and leave: the connection closes here

    after = idle_samples(server)  # within wait_idle's bound: nothing keeps generating for nobody
    assert delta(before, after, "berth_request_success_total", finished_reason="abort") == n
    assert delta(before, after, "berth_request_success_total", finished_reason="length") == 0
    assert delta(before, after, "berth_generation_tokens_total") < n * max_tokens


def test_a_client_that_goes_away_from_a_whole_answer_aborts_its_request(server):
    before = idle_samples(server)
    n, max_tokens = 16, 240
    body = json.dumps({"prompt": [5] * 8, "n": n, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    url = httpx.URL(server.url)
    head = "".join(f"{k}: {v}\r\n" for k, v in server.headers().items())
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{head}\r\n"
    ).encode() + body

    # The client leaves once the engine is generating its answer (not on a timer, which a
    # loaded machine could beat before the request reached the engine): the request is running,
    # or tokens were generated since (a scrape that took long may miss the running state).
    def generating() -> bool:
        samples = scrape(server)[1]
        return value(samples, "berth_num_requests_running") > 0 or (
            delta(before, samples, "berth_generation_tokens_total") > 0
        )

    with socket.create_connection((url.host, url.port), timeout=10) as client:
        client.sendall(request)
        deadline = time.monotonic() + 60
        while not generating():
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)

    after = idle_samples(server)
    assert delta(before, after, "berth_request_success_total", finished_reason="abort") == n
    assert delta(before, after, "berth_generation_tokens_total") < n * max_tokens


def test_memory_series_say_what_admin_state_says(server):
    """Weights, KV pool (as sized: the shared server's --kv-blocks 512, a flag), the limit it was
    sized under, and the engine's RSS."""
    state = server.admin_state()
    samples = scrape(server)[1]
    plan = state["kv_cache"]
    assert plan["limit_source"] == "flag" and plan["num_blocks"] == 512 == state["kv_blocks_total"]
    assert value(samples, "berth_kv_cache_blocks") == 512
    assert value(samples, "berth_kv_cache_pool_bytes") == plan["pool_bytes"] == state["kv_cache_bytes"] > 0
    assert value(samples, "berth_kv_cache_bytes") == state["kv_cache_bytes"]
    assert value(samples, "berth_kv_cache_tokens") == plan["num_tokens"] == 512 * 16
    assert (
        value(samples, "berth_kv_cache_bytes_per_token")
        == plan["bytes_per_token"]
        == plan["pool_bytes"] / 8192
    )
    assert (
        value(samples, "berth_memory_limit_bytes", source="flag") == plan["limit_bytes"] == plan["pool_bytes"]
    )
    assert value(samples, "berth_weight_bytes") == state["weight_bytes"] > 0
    # The RSS of the engine's process (the worker), which holds at least its weights.
    assert value(samples, "berth_engine_resident_memory_bytes") >= state["weight_bytes"]
    assert state["resident_bytes"] >= state["weight_bytes"]
