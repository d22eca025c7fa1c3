"""`berth bench serve MODEL_DIR`: load-test an OpenAI-compatible server, like `vllm bench serve`.

The synthetic workload of `berth bench throughput` (random prompt token ids, output lengths
from a range, fixed seed) is sent to `POST /v1/completions`, streamed, greedy, every request
generating exactly its drawn number of tokens (`ignore_eos`). Requests start all at once, or at
`--request-rate` per second (Poisson arrivals), at most `--max-concurrency` at a time.

Reported per request: TTFT (request sent -> first chunk with text), TPOT ((E2E - TTFT) /
(output tokens - 1)), ITL (gaps between streamed chunks; a chunk is one engine step's text, so
usually one token) and E2E latency; overall: request, output-token and total-token throughput.
Then the latency of a small request (`GET /live`; `GET /v1/models` on a server without berth's
`/live`, e.g. vLLM or llama.cpp's llama-server) on a kept-alive connection and on fresh ones:
every OpenAI client reuses connections, and a server that lets Nagle's algorithm hold back its
responses shows it there (~40 ms reused vs ~1 ms fresh).

The server is the one at `--base-url`, or (default) a `berth serve MODEL_DIR` this command
starts on a free port and stops afterwards. Then, unless `--skip-offline`, the same workload
runs offline through `LLM.generate` (as `berth bench throughput` measures it) with the same
engine options, and the ratio served / offline output-token throughput is printed. Both runs
share this machine's CPUs with whatever else runs, the load generator included.

`--plot FILE.png` draws every request's TTFT and TPOT (sorted, as distributions).

`--frontends K` and `--num-postprocess-workers N` measure the multi-process shape against the
single-process server in the same run: after the plain `berth serve`, the same workload goes
to an engine whose owner runs N postprocess workers, spread over K frontends attached to it
(`berth serve --attach`; K = 0: to the owner itself), and the ratios of the two are printed.

`--batch-wait-timeout-ms MS` (and `--batch-wait-max-tokens-ratio R`) measures the enqueue
window the same way: the workload runs on a server without it, then on one with it, and the
throughput and TTFT of the two are printed side by side.

`--disaggregated` runs it on disaggregated serving too: a context server (`--role context`),
a generation server (`--role generation`) and the router (`berth serve --route`) in front of
them, each with the engine options of the single server; TTFT and ITL percentiles of the two
shapes side by side. On one machine the two engines share its cores: this measures what the
split costs there, not what it gains on separate GPUs.

`--structured-output` measures constrained decoding: after the plain workload, on the same
server, the same requests (prompts, number, concurrency, rate) go again with a JSON schema each
(`response_format` json_schema; engine/bench/structured.py `array_schema`: an object with an
array of exactly N integers in 100..999, N chosen so that the document is about the workload's
mean output length, max_tokens above any such document's length), without ignore_eos, which a
structured request may not use: each ends when its document is complete. TPOT and throughput of
the two are printed side by side, with their ratios, and every constrained output that ended
with finish_reason "stop" is checked against the schema (jsonschema): the count that validate
is printed, and one that does not fails the benchmark, as does a run where none stopped. With
`--rounds R` the two run in turn R times on the one server, and each keeps its fastest round.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from berth.engine.bench.structured import array_items_for, array_schema, schema_problem
from berth.engine.bench.workload import WorkItem, add_workload_arguments, describe_workload, make_workload

LISTENING = "berth serve: listening on "
ATTACH_AT = "berth serve: frontends attach at "


KEEPALIVE_PROBES = 50


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""  # the output, kept for a constrained request
    finish_reason: str | None = None


@dataclass(frozen=True)
class Constraint:
    """What each request of the constrained workload sends instead of ignore_eos."""

    schema: dict[str, Any]
    max_tokens: int  # the longest document's tokens: the schema, not the limit, ends the output


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
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="the engine's (server, baseline)"
    )
    parser.add_argument("--skip-offline", action="store_true", help="no offline LLM.generate baseline")
    parser.add_argument(
        "--offline-executor", default="in-process", help="the baseline's executor (as bench throughput)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with a comparison: run the shapes in turn this many times and keep each one's fastest "
        "round (the first server of a run can be slower for reasons of its own)",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="plot the TTFT and TPOT of every request")
    parser.add_argument(
        "--frontends",
        type=int,
        default=0,
        help="then run the load through K frontends attached to one engine (`berth serve --attach`) "
        "and compare with the single-process server",
    )
    parser.add_argument(
        "--num-postprocess-workers",
        type=int,
        default=0,
        help="then run it on an engine whose owner detokenizes in N postprocess workers, and compare",
    )
    parser.add_argument(
        "--batch-wait-timeout-ms",
        type=float,
        metavar="MS",
        help="then run it on a server with this enqueue window (`berth serve --batch-wait-timeout-ms`) "
        "and compare with the window off",
    )
    parser.add_argument(
        "--disaggregated",
        action="store_true",
        help="then run it through a router over a context and a generation server, and compare",
    )
    parser.add_argument(
        "--batch-wait-max-tokens-ratio",
        type=float,
        metavar="RATIO",
        help="the window's token ratio (with --batch-wait-timeout-ms)",
    )
    parser.add_argument(
        "--structured-output",
        action="store_true",
        help="then run the same requests on the same server, each constrained by a JSON schema, "
        "and compare (TPOT, throughput; every output that stops is checked against the schema)",
    )


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        print(f"berth bench serve: error: {problem}", file=sys.stderr)
        return 2
    if args.plot:
        import matplotlib  # noqa: F401  (fail now, not after the benchmark)
    from berth.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    workload = make_workload(args, len(tokenizer), set(tokenizer.all_special_ids))
    print(
        f"{describe_workload(args, workload)}; max concurrency {args.max_concurrency or 'unlimited'}, "
        f"request rate {args.request_rate}",
        flush=True,
    )
    api_key = args.api_key or os.environ.get("BERTH_API_KEY") or None
    constraint = constrained = None
    if args.structured_output:
        constraint = _constraint(tokenizer, workload)
        constrained = Shape(
            f"json_schema, {constraint.schema['properties']['values']['minItems']} integers", 0, 0
        )
        print(
            f"structured output: response_format json_schema {json.dumps(constraint.schema)}; "
            f"max_tokens {constraint.max_tokens}, no ignore_eos",
            flush=True,
        )
    shapes = [Shape("single-process server", 0, 0)]
    if args.disaggregated:
        shapes.append(Shape("context + generation servers behind the router", 0, 0, disaggregated=True))
    elif args.batch_wait_timeout_ms:
        shapes.append(_window_shape(args))
    elif args.frontends or args.num_postprocess_workers:
        shapes.append(
            Shape(
                _describe(args.frontends, args.num_postprocess_workers),
                args.frontends,
                args.num_postprocess_workers,
            )
        )
    rounds = []
    try:
        for _ in range(args.rounds if len(shapes) > 1 else 1):
            for shape in shapes:  # in turn, round after round: a drifting machine slows both alike
                with _servers(args, shape) as urls:
                    # Constrained or not is the same server: its rounds run on it, in turn.
                    for _ in range(args.rounds if constraint is not None else 1):
                        duration, results = asyncio.run(_benchmark(args, urls, api_key, workload))
                        if not rounds:
                            keepalive = asyncio.run(_keepalive_latency(urls[0], api_key))
                        rounds.append((shape, duration, results))
                        if constraint is not None:  # the same requests, constrained
                            duration, results = asyncio.run(
                                _benchmark(args, urls, api_key, workload, constraint)
                            )
                            rounds.append((constrained, duration, results))
    except (RuntimeError, OSError) as error:
        print(f"berth bench serve: error: {error}", file=sys.stderr)
        return 1
    if constrained is not None:
        shapes.append(constrained)
    # Each shape's fastest round (by output throughput), as `bench throughput --rounds` counts.
    measured = [
        max((m for m in rounds if m[0] is shape), key=lambda m: sum(r.output_tokens for r in m[2]) / m[1])
        for shape in shapes
    ]
    if len(rounds) > len(shapes):
        print(f"each shape's fastest of {args.rounds} rounds, run in turn", flush=True)
    offline = None if args.skip_offline else _offline_tokens_per_s(args, workload)
    for shape, duration, results in measured:
        _report(args, workload, duration, results, offline, title=shape.label if len(measured) > 1 else None)
    _report_keepalive(keepalive)
    valid = True
    if constraint is not None:
        valid = _report_structured(measured, constraint)
    elif len(measured) > 1:
        _report_shapes(measured)
    if args.plot:
        _plot(args, measured[-1][2])  # the shape asked about (the only one, without --frontends)
        print(f"plot: {args.plot}")
    return 0 if valid and all(r.ok for _, _, results in measured for r in results) else 1


@dataclass(frozen=True)
class Shape:
    label: str
    frontends: int  # attached frontends the load is spread over (0: the owner takes it)
    postprocess_workers: int
    engine_args: tuple[str, ...] = ()  # more `berth serve` options
    disaggregated: bool = False  # a context and a generation server behind a router


def _window_shape(args: argparse.Namespace) -> Shape:
    engine_args = ("--batch-wait-timeout-ms", str(args.batch_wait_timeout_ms))
    label = f"enqueue window {args.batch_wait_timeout_ms:g} ms"
    if args.batch_wait_max_tokens_ratio:
        engine_args += ("--batch-wait-max-tokens-ratio", str(args.batch_wait_max_tokens_ratio))
        label += f", token ratio {args.batch_wait_max_tokens_ratio:g}"
    return Shape(label, 0, 0, engine_args)


def _constraint(tokenizer, workload: list[WorkItem]) -> Constraint:
    """The schema of the constrained workload: a document of about the workload's mean output
    length."""
    mean = sum(item.output_len for item in workload) / len(workload)
    items, longest = array_items_for(tokenizer, mean)
    return Constraint(array_schema(items), longest)


def _describe(frontends: int, workers: int) -> str:
    where = f"{frontends} attached frontends" if frontends else "the owner"
    return f"{where}, {workers} postprocess workers"


def _check_args(args: argparse.Namespace) -> str | None:
    if args.num_requests < 1:
        return f"--num-requests must be >= 1, got {args.num_requests}"
    if args.rounds < 1:
        return f"--rounds must be >= 1, got {args.rounds}"
    if args.max_concurrency is not None and args.max_concurrency < 1:
        return f"--max-concurrency must be >= 1, got {args.max_concurrency}"
    if not args.request_rate > 0:
        return f"--request-rate must be > 0, got {args.request_rate}"
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"{args.model} is not a model directory (no config.json)"
    for flag, value in (
        ("--frontends", args.frontends),
        ("--num-postprocess-workers", args.num_postprocess_workers),
    ):
        if value < 0:
            return f"{flag} must be >= 0, got {value}"
        if value and args.base_url:
            return f"{flag} starts servers of its own: it cannot measure --base-url"
    if args.disaggregated and (args.base_url or args.frontends or args.num_postprocess_workers):
        return "--disaggregated starts servers of its own: no --base-url, --frontends or postprocess workers"
    if args.disaggregated and args.batch_wait_timeout_ms is not None:
        return "--disaggregated and --batch-wait-timeout-ms are two comparisons: run them one at a time"
    if args.structured_output and (
        args.disaggregated
        or args.batch_wait_timeout_ms is not None
        or args.frontends
        or args.num_postprocess_workers
    ):
        return "--structured-output is a comparison of its own: run it without the other comparisons"
    if args.structured_output and importlib.util.find_spec("jsonschema") is None:
        return "--structured-output checks every output with jsonschema: pip install jsonschema"
    window = args.batch_wait_timeout_ms
    if window is not None:
        if not 0 < window <= 1000:
            return f"--batch-wait-timeout-ms must be in (0, 1000], got {window:g}"
        if args.base_url:
            return "--batch-wait-timeout-ms starts servers of its own: it cannot measure --base-url"
        if args.frontends or args.num_postprocess_workers:
            return "--batch-wait-timeout-ms compares one server with and without the window: no --frontends"
    elif args.batch_wait_max_tokens_ratio is not None:
        return "--batch-wait-max-tokens-ratio needs --batch-wait-timeout-ms"
    return None


# ---- the server -----------------------------------------------------------------------------------


@contextmanager
def _servers(args: argparse.Namespace, shape: Shape) -> Iterator[list[str]]:
    """The base URLs the load goes to: `--base-url`, or the servers of `shape` started here (an
    owner, and its attached frontends), stopped on exit (frontends first)."""
    if args.base_url:
        yield [args.base_url.rstrip("/")]
        return
    owner = [
        sys.executable, "-m", "berth", "serve", args.model, "--host", "127.0.0.1", "--port", "0",
        "--max-batch-size", str(args.batch_size), "--max-num-tokens", str(args.max_num_tokens),
        "--dtype", args.dtype, "--log-level", "warning",
    ]  # fmt: skip
    owner += shape.engine_args
    if shape.postprocess_workers:
        owner += ["--num-postprocess-workers", str(shape.postprocess_workers)]
    if shape.frontends:
        owner += ["--attach-port", "0"]
    env = dict(os.environ, BERTH_ENGINE_KEY=secrets.token_hex(32))  # this run's engine key
    if shape.disaggregated:
        with _split_servers(owner, env) as url:
            yield [url]
        return
    with ExitStack() as stack:
        name = f"berth serve ({shape.label}, max batch size {args.batch_size}, dtype {args.dtype})"
        lines = stack.enter_context(_server_process(owner, env, name))
        url = _announced(lines, LISTENING)
        if not shape.frontends:
            yield [url]
            return
        attach = _announced(lines, ATTACH_AT)
        frontend = [
            sys.executable, "-m", "berth", "serve", "--attach", attach, "--host", "127.0.0.1", "--port", "0",
            "--log-level", "warning",
        ]  # fmt: skip
        urls = []
        for i in range(shape.frontends):
            urls.append(
                _announced(stack.enter_context(_server_process(frontend, env, f"frontend {i}")), LISTENING)
            )
        yield urls


@contextmanager
def _split_servers(server: list[str], env: dict[str, str]) -> Iterator[str]:
    """A context server and a generation server (`server` with a role each), and the router in
    front of them: its URL."""
    with ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="berth-bench-"))
        context = [*server, "--role", "context", "--kv-transfer-endpoint", f"ipc://{folder}/kv"]
        urls = {}
        for role, command in (("context", context), ("generation", [*server, "--role", "generation"])):
            urls[role] = _announced(
                stack.enter_context(_server_process(command, env, f"{role} server")), LISTENING
            )
        router = [
            sys.executable, "-m", "berth", "serve", "--host", "127.0.0.1", "--port", "0",
            "--log-level", "warning", "--route", f"context={urls['context']}",
            "--route", f"generation={urls['generation']}",
        ]  # fmt: skip
        yield _announced(stack.enter_context(_server_process(router, env, "router")), LISTENING)


def _announced(lines: list[str], prefix: str) -> str:
    return next(line[len(prefix) :].strip() for line in lines if line.startswith(prefix))


@contextmanager
def _server_process(command: list[str], env: dict[str, str], name: str) -> Iterator[list[str]]:
    """A `berth serve` process, once it listens: its output lines so far (stopped on exit)."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
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
        if not any(line.startswith(LISTENING) for line in lines):
            raise RuntimeError(f"{name} did not start:\n" + "".join(lines))
        print(f"server: {name} (pid {process.pid}) at {_announced(lines, LISTENING)}", flush=True)
        yield lines
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
    args: argparse.Namespace,
    base_urls: list[str],
    api_key: str | None,
    workload: list[WorkItem],
    constraint: Constraint | None = None,
) -> tuple[float, list[RequestResult]]:
    """The workload, request i to server i % len(base_urls); each constrained by `constraint`
    when one is given."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30)
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout)
            )
            for url in base_urls
        ]
        model = await _model_name(clients[0])
        # Warm-up, on every server: first-call costs are not speed.
        warm = await asyncio.gather(
            *(
                # Constrained too: the grammar engine's tokenizer and the schema's compile are
                # first-call costs.
                _one(client, model, WorkItem(item.prompt_token_ids[:8], 4), constraint, warm_up=True)
                for client in clients
                for item in workload[:4]
            )
        )
        failed = [r.error for r in warm if not r.ok]
        if failed:
            raise RuntimeError(f"the server fails the warm-up requests: {failed[0]}")

        gate = asyncio.Semaphore(args.max_concurrency or len(workload))
        rng = random.Random(args.seed)

        async def limited(client, item: WorkItem) -> RequestResult:
            async with gate:
                return await _one(client, model, item, constraint)

        started = time.perf_counter()
        tasks = []
        for index, item in enumerate(workload):
            tasks.append(asyncio.create_task(limited(clients[index % len(clients)], item)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return time.perf_counter() - started, results


async def _keepalive_latency(base_url: str, api_key: str | None) -> dict[str, Any]:
    """Median seconds of a small GET: on one kept-alive connection, and on a new one each time.
    berth's `/live` where the server has it; elsewhere (vLLM, llama.cpp's llama-server, any
    OpenAI-compatible server) `/v1/models`, a route every such server answers."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def client() -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30)

    async def median_of(client_for_each, route: str) -> float:
        seconds = []
        for _ in range(KEEPALIVE_PROBES):
            each = client_for_each()
            started = time.perf_counter()
            response = await each.get(route)
            seconds.append(time.perf_counter() - started)
            response.raise_for_status()
            if each is not reused:
                await each.aclose()
        return _percentiles(seconds)["Median"]

    async with client() as reused:
        # The connection is open from here on, whatever the first answer.
        route = "/v1/models" if (await reused.get("/live")).status_code == 404 else "/live"
        kept = await median_of(lambda: reused, route)
        fresh = await median_of(client, route)
    return {"route": route, "reused": kept, "fresh": fresh}


async def _model_name(client) -> str:
    response = await client.get("/v1/models")
    if response.status_code != 200:
        raise RuntimeError(f"GET /v1/models: {response.status_code} {response.text[:200]}")
    return response.json()["data"][0]["id"]


async def _one(
    client, model: str, item: WorkItem, constraint: Constraint | None = None, *, warm_up: bool = False
) -> RequestResult:
    body = {
        "model": model,
        "prompt": item.prompt_token_ids,
        "max_tokens": item.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constraint is not None:  # the schema ends it: no ignore_eos (a structured request may not)
        del body["ignore_eos"]
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": constraint.schema},
        }
        if not warm_up:
            body["max_tokens"] = constraint.max_tokens
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
                for choice in chunk.get("choices", ()):
                    result.text += choice.get("text") or ""
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
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
    if constraint is not None:  # as long as its document is
        result.ok = last is not None and result.output_tokens > 0
        if not result.ok:
            result.error = "no output"
        return result
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
        dtype=args.dtype,
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
    *,
    title: str | None = None,
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

    section(f" Serving Benchmark Result{f': {title}' if title else ''} ")
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
    tpots = _tpots(ok)
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


def _report_shapes(measured: list[tuple[Shape, float, list[RequestResult]]]) -> None:
    """The multi-process shape against the single-process server, measured in the same run."""
    (_, base_duration, base), (shape, duration, results) = measured

    def throughput(seconds: float, rs: list[RequestResult]) -> float:
        return sum(r.output_tokens for r in rs if r.ok) / seconds

    def median_ttft(rs: list[RequestResult]) -> float:
        return _percentiles([r.ttft for r in rs if r.ok])["Median"]

    print(f"{f' {shape.label} vs single-process server ':-^52}")
    ratio = throughput(duration, results) / throughput(base_duration, base)
    print(f"{'Output throughput ratio (shape / single):':<44}{ratio:>8.2f}")
    print(f"{'Median TTFT ratio (shape / single):':<44}{median_ttft(results) / median_ttft(base):>8.2f}")
    if shape.engine_args or shape.disaggregated:  # the figures side by side
        print(f"{'':<28}{'single':>12}{'shape':>12}")
        print(f"{'Output throughput (tok/s):':<28}{throughput(base_duration, base):>12.2f}"
              f"{throughput(duration, results):>12.2f}")  # fmt: skip
        for short, of in (("TTFT", lambda r: [r.ttft]), ("ITL", lambda r: r.itls)):
            before = _percentiles([v for r in base if r.ok for v in of(r)])
            after = _percentiles([v for r in results if r.ok for v in of(r)])
            for stat in ("Median", "P90", "P99"):
                print(f"{f'{stat} {short} (ms):':<28}{1000 * before[stat]:>12.2f}{1000 * after[stat]:>12.2f}")
    print("-" * 52)


def _report_structured(
    measured: list[tuple[Shape, float, list[RequestResult]]], constraint: Constraint
) -> bool:
    """Constrained against unconstrained, on the same server in the same run; then whether every
    constrained output that stopped is what the schema asks (False: one is not, or none stopped)."""
    (_, plain_duration, plain), (_, duration, constrained) = measured

    def throughput(seconds: float, rs: list[RequestResult]) -> float:
        return sum(r.output_tokens for r in rs if r.ok) / seconds

    tpots = (_percentiles(_tpots(plain)), _percentiles(_tpots(constrained)))
    itls = [_percentiles([gap for r in rs if r.ok for gap in r.itls]) for rs in (plain, constrained)]
    ttfts = [_percentiles([r.ttft for r in rs if r.ok]) for rs in (plain, constrained)]
    print(f"{' json_schema-constrained vs unconstrained ':-^64}")
    print(f"{'':<36}{'unconstrained':>14}{'json_schema':>14}")
    print(f"{'Output throughput (tok/s):':<36}{throughput(plain_duration, plain):>14.2f}"
          f"{throughput(duration, constrained):>14.2f}")  # fmt: skip
    for stat in ("Mean", "Median", "P90", "P99"):
        print(f"{f'{stat} TPOT (ms):':<36}{1000 * tpots[0][stat]:>14.2f}{1000 * tpots[1][stat]:>14.2f}")
    print(f"{'Median ITL (ms):':<36}{1000 * itls[0]['Median']:>14.2f}{1000 * itls[1]['Median']:>14.2f}")
    print(f"{'Median TTFT (ms):':<36}{1000 * ttfts[0]['Median']:>14.2f}{1000 * ttfts[1]['Median']:>14.2f}")
    for stat in ("Median", "Mean"):
        ratio = tpots[1][stat] / tpots[0][stat]
        print(f"{f'{stat} TPOT ratio (json_schema / unconstrained):':<56}{ratio:>8.2f}")
    ratio = throughput(duration, constrained) / throughput(plain_duration, plain)
    print(f"{'Output throughput ratio (json_schema / unconstrained):':<56}{ratio:>8.2f}")
    ok = [r for r in constrained if r.ok]
    stopped = [r for r in ok if r.finish_reason == "stop"]
    problems = [problem for r in stopped if (problem := schema_problem(r.text, constraint.schema))]
    for label, count, total in (
        ("Constrained outputs that stopped:", len(stopped), len(ok)),
        ("Stopped outputs valid per the schema:", len(stopped) - len(problems), len(stopped)),
    ):
        print(f"{label:<56}{count:>8} of {total} ({100 * count / max(total, 1):.1f} %)")
    for r in ok:
        if r.finish_reason != "stop":
            print(f"not stopped ({r.finish_reason}, {r.output_tokens} tokens): {r.text[:120]!r}")
            break
    for problem in problems[:3]:
        print(f"invalid output: {problem}")
    print("-" * 64)
    return bool(stopped) and not problems


def _report_keepalive(medians: dict[str, Any]) -> None:
    title = f" Keep-alive request latency (GET {medians['route']}) "
    print(f"{title:-^52}")
    print(f"{'Median, reused connection (ms):':<40}{1000 * medians['reused']:>12.2f}")
    print(f"{'Median, new connection (ms):':<40}{1000 * medians['fresh']:>12.2f}")
    print("-" * 52)


def _tpots(results: list[RequestResult]) -> list[float]:
    return [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in results if r.ok and r.output_tokens > 1]


def _plot(args: argparse.Namespace, results: list[RequestResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft_axes, tpot_axes) = plt.subplots(1, 2, figsize=(9.6, 3.8), dpi=120)
    for axes, values, name in (
        (ttft_axes, [r.ttft for r in results if r.ok], "TTFT"),
        (tpot_axes, _tpots(results), "TPOT"),
    ):
        ordered = sorted(1000 * v for v in values)
        share = [100 * (i + 1) / len(ordered) for i in range(len(ordered))]
        axes.plot(ordered, share, drawstyle="steps-post")
        axes.set_xlabel(f"{name} (ms)")
        axes.set_ylabel("requests (%)")
        axes.set_ylim(0, 100)
        axes.grid(True, alpha=0.3)
        median = 1000 * _percentiles(values)["Median"]  # the report's figure
        axes.set_title(f"{name}: median {median:.0f} ms")
    concurrency = args.max_concurrency or "unlimited"
    figure.suptitle(
        f"berth serve {args.model.rstrip('/').split('/')[-1]} ({args.dtype}): {len(results)} requests, "
        f"concurrency {concurrency}, rate {args.request_rate}"
    )
    figure.tight_layout()
    figure.savefig(args.plot)
    plt.close(figure)
