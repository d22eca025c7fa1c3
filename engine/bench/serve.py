"""`berth bench serve MODEL_DIR`: load-test an OpenAI-compatible server, like `vllm bench serve`.

The synthetic workload of `berth bench throughput` (random prompt token ids, output lengths
from a range, fixed seed) is sent to `POST /v1/completions`, streamed, greedy, every request
generating exactly its drawn number of tokens (`ignore_eos`). Requests start all at once, or at
`--request-rate` per second (Poisson arrivals), at most `--max-concurrency` at a time.

Reported per request: TTFT (request sent -> first chunk with text), TPOT ((E2E - TTFT) /
(output tokens - 1)), ITL (gaps between streamed chunks; a chunk is one engine step's text, so
usually one token) and E2E latency; overall: request, output-token and total-token throughput.

The server is the one at `--base-url`, or (default) a `berth serve MODEL_DIR` this command
starts on a free port and stops afterwards. Then, unless `--skip-offline`, the same workload
runs offline through `LLM.generate` (as `berth bench throughput` measures it) with the same
engine options, and the ratio served / offline output-token throughput is printed. Both runs
share this machine's CPUs with whatever else runs, the load generator included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from berth.engine.bench.workload import WorkItem, add_workload_arguments, describe_workload, make_workload

LISTENING = "berth serve: listening on "


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory: the workload's vocabulary, the server, the baseline")
    add_workload_arguments(parser)
    parser.add_argument(
        "--base-url", help="a running server (http://HOST:PORT); default: start `berth serve MODEL`"
    )
    parser.add_argument("--api-key", help="bearer token for the server (default: $BERTH_API_KEY)")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no limit)")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="max_batch_size of the engine (started server, baseline)"
    )
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--skip-offline", action="store_true", help="no offline LLM.generate baseline")
    parser.add_argument(
        "--offline-executor", default="in-process", help="the baseline's executor (as bench throughput)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds one request may take")


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        print(f"berth bench serve: error: {problem}", file=sys.stderr)
        return 2
    from berth.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    workload = make_workload(args, len(tokenizer), set(tokenizer.all_special_ids))
    print(
        f"{describe_workload(args, workload)}; max concurrency {args.max_concurrency or 'unlimited'}, "
        f"request rate {args.request_rate}",
        flush=True,
    )
    api_key = args.api_key or os.environ.get("BERTH_API_KEY") or None
    try:
        with _server(args) as base_url:
            duration, results = asyncio.run(_benchmark(args, base_url, api_key, workload))
    except (RuntimeError, OSError) as error:
        print(f"berth bench serve: error: {error}", file=sys.stderr)
        return 1
    offline = None if args.skip_offline else _offline_tokens_per_s(args, workload)
    _report(args, workload, duration, results, offline)
    return 0 if all(r.ok for r in results) else 1


def _check_args(args: argparse.Namespace) -> str | None:
    if args.num_requests < 1:
        return f"--num-requests must be >= 1, got {args.num_requests}"
    if args.max_concurrency is not None and args.max_concurrency < 1:
        return f"--max-concurrency must be >= 1, got {args.max_concurrency}"
    if not args.request_rate > 0:
        return f"--request-rate must be > 0, got {args.request_rate}"
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"{args.model} is not a model directory (no config.json)"
    return None


# ---- the server -----------------------------------------------------------------------------------


@contextmanager
def _server(args: argparse.Namespace) -> Iterator[str]:
    """The server's base URL: `--base-url`, or a `berth serve` started here (stopped on exit)."""
    if args.base_url:
        yield args.base_url.rstrip("/")
        return
    command = [
        sys.executable, "-m", "berth", "serve", args.model, "--host", "127.0.0.1", "--port", "0",
        "--max-batch-size", str(args.batch_size), "--max-num-tokens", str(args.max_num_tokens),
        "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
    )
    lines: list[str] = []
    listening = threading.Event()

    def read() -> None:  # for the process's whole life: a full pipe must never block it
        for line in process.stdout:
            lines.append(line)
            if line.startswith(LISTENING):
                listening.set()
        listening.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        listening.wait(180)
        url = next((line[len(LISTENING) :].strip() for line in lines if line.startswith(LISTENING)), None)
        if url is None:
            raise RuntimeError("`berth serve` did not start:\n" + "".join(lines))
        print(
            f"server: berth serve (pid {process.pid}) at {url}, max batch size {args.batch_size}", flush=True
        )
        yield url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


# ---- the load -------------------------------------------------------------------------------------


async def _benchmark(
    args: argparse.Namespace, base_url: str, api_key: str | None, workload: list[WorkItem]
) -> tuple[float, list[RequestResult]]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        model = await _model_name(client)
        # Warm-up: first-call costs are not speed.
        warm = await asyncio.gather(
            *(_one(client, model, WorkItem(item.prompt_token_ids[:8], 4)) for item in workload[:4])
        )
        failed = [r.error for r in warm if not r.ok]
        if failed:
            raise RuntimeError(f"the server fails the warm-up requests: {failed[0]}")

        gate = asyncio.Semaphore(args.max_concurrency or len(workload))
        rng = random.Random(args.seed)

        async def limited(item: WorkItem) -> RequestResult:
            async with gate:
                return await _one(client, model, item)

        started = time.perf_counter()
        tasks = []
        for item in workload:
            tasks.append(asyncio.create_task(limited(item)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return time.perf_counter() - started, results


async def _model_name(client) -> str:
    response = await client.get("/v1/models")
    if response.status_code != 200:
        raise RuntimeError(f"GET /v1/models: {response.status_code} {response.text[:200]}")
    return response.json()["data"][0]["id"]


async def _one(client, model: str, item: WorkItem) -> RequestResult:
    body = {
        "model": model,
        "prompt": item.prompt_token_ids,
        "max_tokens": item.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False)
    started = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"{response.status_code} {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk.get("choices", ())):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - started
                    else:
                        result.itls.append(now - last)
                    last = now
    except Exception as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = time.perf_counter() - started
    if result.output_tokens != item.output_len:
        result.error = f"generated {result.output_tokens} tokens, expected {item.output_len}"
        return result
    result.ok = last is not None
    return result


# ---- the offline baseline -------------------------------------------------------------------------


def _offline_tokens_per_s(args: argparse.Namespace, workload: list[WorkItem]) -> float:
    from berth.engine import LLM, SamplingParams
    from berth.engine.bench.throughput import run_berth

    with LLM(
        args.model,
        executor=args.offline_executor,
        max_batch_size=args.batch_size,
        max_num_tokens=args.max_num_tokens,
    ) as llm:
        seconds = run_berth(llm, workload, SamplingParams)
    return sum(item.output_len for item in workload) / seconds


# ---- the report -----------------------------------------------------------------------------------


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"Mean": math.nan, "Median": math.nan, "P90": math.nan, "P99": math.nan}
    ordered = sorted(values)

    def at(q: float) -> float:  # linear interpolation, as numpy's default
        position = q * (len(ordered) - 1)
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"Mean": sum(ordered) / len(ordered), "Median": at(0.5), "P90": at(0.9), "P99": at(0.99)}


def _report(
    args: argparse.Namespace,
    workload: list[WorkItem],
    duration: float,
    results: list[RequestResult],
    offline_tokens_per_s: float | None,
) -> None:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    input_tokens = sum(len(item.prompt_token_ids) for item, r in zip(workload, results) if r.ok)
    output_tokens = sum(r.output_tokens for r in ok)
    output_throughput = output_tokens / duration

    def line(label: str, value) -> None:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40}{shown:>12}")

    def section(title: str) -> None:
        print(f"{title:-^52}")

    section(" Serving Benchmark Result ")
    line("Successful requests:", len(ok))
    line("Failed requests:", len(failed))
    line("Maximum request concurrency:", args.max_concurrency or "unlimited")
    line("Request rate (req/s):", args.request_rate)
    line("Benchmark duration (s):", duration)
    line("Total input tokens:", input_tokens)
    line("Total generated tokens:", output_tokens)
    line("Request throughput (req/s):", len(ok) / duration)
    line("Output token throughput (tok/s):", output_throughput)
    line("Total token throughput (tok/s):", (input_tokens + output_tokens) / duration)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    for title, short, values in (
        ("Time to First Token", "TTFT", [r.ttft for r in ok]),
        ("Time per Output Token (excl. 1st token)", "TPOT", tpots),
        ("Inter-token Latency", "ITL", [gap for r in ok for gap in r.itls]),
        ("End-to-end Latency", "E2EL", [r.e2e for r in ok]),
    ):
        section(f" {title} ")
        for stat, seconds in _percentiles(values).items():
            line(f"{stat} {short} (ms):", 1000 * seconds)
    if offline_tokens_per_s is not None:
        section(" Offline baseline (LLM.generate) ")
        line("Offline output throughput (tok/s):", offline_tokens_per_s)
        line("Served / offline output throughput:", output_throughput / offline_tokens_per_s)
    print("-" * 52)
    for r in failed[:5]:
        print(f"failed request: {r.error}")
