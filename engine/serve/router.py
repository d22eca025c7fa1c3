"""`berth serve --route context=URL[,URL...] --route generation=URL[,URL...]`: the front door of
disaggregated serving. Each OpenAI request (`/v1/completions`, `/v1/chat/completions`) runs
first on a context server (`berth serve --role context`) as context-only: its prompt, its first
token, a KV handle; then on a generation server (`--role generation`) continuing from that
handle, whose answer (streamed or not) goes to the client as it comes. Servers of a role are
taken in turn, passing over one that refuses the connection or answers 503 (asleep, draining)
while another is left. Both halves carry the same `X-Request-Id` (the client's, or a new one),
which the servers log with their engines' request ids.

A request the first token ends (or with `max_tokens` 1) is answered from the context server's
reply. The engines split single sequences, so a request with `n` > 1 runs as `n` splits whose
choices are merged (streamed as they come, each with its own index); split `i` samples with
`seed + i`, as a single engine's sequence `i` does, so seeded answers match one engine's. The
router cannot pick the best of several, so `best_of` other than `n` is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from berth.engine.serve.arguments import fail
from berth.engine.serve.router_metrics import RouterMetrics

logger = logging.getLogger(__name__)

ROUTED = ("/v1/completions", "/v1/chat/completions")
REQUEST_ID = "X-Request-Id"


def parse_routes(values: list[str]) -> dict[str, list[str]]:
    """`["context=URL,URL", "generation=URL"]` -> {"context": [...], "generation": [...]}; ValueError."""
    routes: dict[str, list[str]] = {"context": [], "generation": []}
    for value in values:
        role, _, urls = value.partition("=")
        if role not in routes or not urls:
            raise ValueError(f"--route takes context=URL[,URL...] or generation=URL[,URL...], got {value!r}")
        for url in urls.split(","):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--route {role}: {url!r} is not an http(s) URL")
            routes[role].append(url.rstrip("/"))
    for role, urls in routes.items():
        if not urls:
            raise ValueError(f"--route needs {role}=URL as well")
    return routes


def build_router_app(routes: dict[str, list[str]], api_key: str | None, timeout: float = 600.0) -> FastAPI:
    app = FastAPI(title="berth router", description="Disaggregated prefill and decode over berth servers.")
    turns = {role: itertools.cycle(urls) for role, urls in routes.items()}
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10))
    app.state.in_flight = 0
    metrics = app.state.metrics = RouterMetrics(routes, lambda: app.state.in_flight)

    def error(status: int, message: str, code: str) -> JSONResponse:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        return JSONResponse(body, status_code=status)

    def forwarded_headers(request: Request, request_id: str) -> dict[str, str]:
        headers = {REQUEST_ID: request_id}
        if request.headers.get("authorization"):
            headers["Authorization"] = request.headers["authorization"]
        return headers

    async def to_one_of(
        role: str, send: Callable[[str], Awaitable[httpx.Response]]
    ) -> tuple[str, httpx.Response]:
        """The first server of `role`, taken in turn, that takes the request. One that refuses the
        connection or answers 503 (asleep, draining, starting: not ready) is passed over while
        another is left, as a Service passes over pods that are not ready; neither has begun it."""
        urls = routes[role]
        for attempt in range(len(urls)):
            url, last = next(turns[role]), attempt == len(urls) - 1
            try:
                reply = await send(url)
            except httpx.ConnectError:
                metrics.upstream(role, url, "unreachable")
                if last:
                    raise
                continue
            metrics.upstream(role, url, "not_ready" if reply.status_code == 503 else "taken")
            if reply.status_code != 503 or last:
                return url, reply
            await reply.aclose()
            logger.info("%s answered 503: the request goes to another %s server", url, role)
        raise AssertionError("unreachable: a route has at least one server of each role")

    async def route(request: Request, path: str) -> Response:
        answer = await answer_of(request, path)
        metrics.answered(answer.status_code)
        return answer

    async def answer_of(request: Request, path: str) -> Response:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "a valid API key is required (Authorization: Bearer ...)", "invalid_api_key")
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error(400, "the body is not JSON", "invalid_json")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object", "invalid_body")
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return error(400, f"n must be a positive integer, got {n!r}", "invalid_n")
        if body.get("best_of") not in (None, n):
            return error(
                400, "the router cannot pick the best of several splits: leave best_of unset", "best_of"
            )
        request_id = request.headers.get(REQUEST_ID) or f"route-{uuid.uuid4().hex}"
        headers = forwarded_headers(request, request_id)
        if n == 1:
            return await split(body, path, headers, request_id)
        return await split_n(body, n, path, headers, request_id)

    async def split(body: dict, path: str, headers: dict, request_id: str):
        """One sequence: its context half, then its generation half relayed as it comes."""
        app.state.in_flight += 1
        try:
            first = await context_half(body, path, headers, request_id)
            if not isinstance(first, dict):
                return first
            if first.get("kv_handle") is None:  # the first token ended it: the whole answer
                return _whole_answer(first, body)
            upstream = await generation_half(body, first["kv_handle"], path, headers)
        except httpx.HTTPError as failure:
            return error(502, f"a server of the route did not answer: {failure!r}", "upstream_unavailable")
        finally:
            app.state.in_flight -= 1
        if isinstance(upstream, Response):
            return upstream

        async def relay():
            app.state.in_flight += 1
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()  # a client that leaves aborts the generation server's request
                app.state.in_flight -= 1

        return StreamingResponse(relay(), media_type="text/event-stream", headers={REQUEST_ID: request_id})

    async def context_half(body: dict, path: str, headers: dict, request_id: str) -> dict | Response:
        """The context server's JSON answer (its `kv_handle` None when the first token ended it)."""
        first_half = {**body, "stream": False, "disaggregated": {"context_only": True}}
        first_half.pop("stream_options", None)
        with metrics.context_seconds.time():
            context_url, reply = await to_one_of(
                "context", lambda url: client.post(url + path, json=first_half, headers=headers)
            )
        if reply.status_code != 200:
            return Response(reply.content, reply.status_code, media_type="application/json")
        answered = reply.json()
        answered.setdefault("kv_handle", None)
        if answered["kv_handle"] is not None:
            metrics.handovers.inc()
        logger.info(
            "%s: context part on %s done (handle: %s)",
            request_id,
            context_url,
            answered["kv_handle"] is not None,
        )
        return answered

    async def generation_half(
        body: dict, handle: dict, path: str, headers: dict
    ) -> Response | httpx.Response:
        """The generation server's answer: a Response when not streamed or refused, else its open stream."""
        second_half = {**body, "disaggregated": {"kv_handle": handle}}
        if not body.get("stream"):
            _, reply = await to_one_of(
                "generation", lambda url: client.post(url + path, json=second_half, headers=headers)
            )
            return Response(reply.content, reply.status_code, media_type="application/json")
        _, upstream = await to_one_of(
            "generation",
            lambda url: client.send(
                client.build_request("POST", url + path, json=second_half, headers=headers), stream=True
            ),
        )
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, upstream.status_code, media_type="application/json")
        return upstream

    async def split_n(body: dict, n: int, path: str, headers: dict, request_id: str):
        """`n` splits of one sequence each, merged into one answer of `n` choices."""
        seed = body.get("seed")
        bodies = [
            {**body, "n": 1, "best_of": None, **({"seed": seed + i} if isinstance(seed, int) else {})}
            for i in range(n)
        ]
        app.state.in_flight += 1
        try:
            firsts = await asyncio.gather(*(context_half(b, path, headers, request_id) for b in bodies))
            refused = next((first for first in firsts if not isinstance(first, dict)), None)
            if refused is not None:
                return refused  # the others' pins end by their timeout
            if not body.get("stream"):
                answers = await asyncio.gather(
                    *(_json_answer(first, b, path, headers) for first, b in zip(firsts, bodies))
                )
                failed = next((answer for answer in answers if isinstance(answer, Response)), None)
                return failed or JSONResponse(_merged(answers))
            opened = await asyncio.gather(
                *(
                    generation_half(b, first["kv_handle"], path, headers)
                    for first, b in zip(firsts, bodies)
                    if first["kv_handle"] is not None
                ),
                return_exceptions=True,
            )
        except httpx.HTTPError as failure:
            return error(502, f"a server of the route did not answer: {failure!r}", "upstream_unavailable")
        finally:
            app.state.in_flight -= 1
        upstreams = [up for up in opened if isinstance(up, httpx.Response)]
        if len(upstreams) < len(opened):  # one half refused or unreachable: close the others' streams
            for up in upstreams:
                await up.aclose()
            failed = next(up for up in opened if not isinstance(up, httpx.Response))
            if isinstance(failed, Response):
                return failed
            return error(502, f"a server of the route did not answer: {failed!r}", "upstream_unavailable")
        streams = iter(upstreams)
        sources = [_whole_events(first) if first["kv_handle"] is None else next(streams) for first in firsts]
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            _merged_events(sources, include_usage, app.state),
            media_type="text/event-stream",
            headers={REQUEST_ID: request_id},
        )

    async def _json_answer(first: dict, body: dict, path: str, headers: dict) -> dict | Response:
        if first["kv_handle"] is None:
            return first
        reply = await generation_half(body, first["kv_handle"], path, headers)
        if reply.status_code != 200:
            return reply
        return json.loads(reply.body)

    for path in ROUTED:

        async def handler(request: Request, path: str = path):
            return await route(request, path)

        app.add_api_route(path, handler, methods=["POST"])

    @app.get("/v1/models")
    async def models():
        try:
            _, reply = await to_one_of("generation", lambda url: client.get(url + "/v1/models"))
        except httpx.HTTPError as failure:
            return error(502, f"no generation server answered: {failure!r}", "upstream_unavailable")
        return Response(reply.content, reply.status_code, media_type="application/json")

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/live")
    async def live():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        """200 while each role has a server ready to take requests (a readiness probe's question:
        a router that could answer none must leave its Service); else 503 naming the roles."""

        async def is_ready(url: str) -> bool:
            try:
                return (await client.get(url + "/ready", timeout=2)).status_code == 200
            except httpx.HTTPError:
                return False

        checks = {role: [asyncio.ensure_future(is_ready(u)) for u in urls] for role, urls in routes.items()}
        waiting = [role for role, started in checks.items() if not any(await asyncio.gather(*started))]
        body = {"ready": not waiting, "roles_without_a_ready_server": waiting}
        return JSONResponse(body, status_code=503 if waiting else 200)

    @app.get("/health")
    async def health():
        """200 while every server of the route is healthy; else 503 naming those that are not."""
        sick = []
        for url in (*routes["context"], *routes["generation"]):
            try:
                if (await client.get(url + "/health", timeout=5)).status_code != 200:
                    sick.append(url)
            except httpx.HTTPError:
                sick.append(url)
        status = 503 if sick else 200
        return JSONResponse({"healthy": not sick, "unhealthy": sick}, status_code=status)

    return app


def _merged(answers: list[dict]) -> dict:
    """`n` single-choice answers as one: choice `i` from answer `i`; the prompt counted once."""
    merged = {key: value for key, value in answers[0].items() if key != "kv_handle"}
    merged["choices"] = [{**answer["choices"][0], "index": i} for i, answer in enumerate(answers)]
    usages = [answer.get("usage") or {} for answer in answers]
    if all(usages):
        completion = sum(usage.get("completion_tokens", 0) for usage in usages)
        prompt = usages[0].get("prompt_tokens", 0)
        merged["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if "prompt_tokens_details" in usages[0]:  # of the prompt, which counts once
            merged["usage"]["prompt_tokens_details"] = usages[0]["prompt_tokens_details"]
    return merged


def _as_chunk(answered: dict) -> dict:
    """A whole answer (JSON, without usage) as the one stream chunk that would have carried it."""
    chunk = {key: value for key, value in answered.items() if key not in ("kv_handle", "usage")}
    if chunk.get("object") == "chat.completion":
        chunk["object"] = "chat.completion.chunk"
        chunk["choices"] = [
            {"index": c["index"], "delta": c["message"], "finish_reason": c["finish_reason"]}
            for c in answered["choices"]
        ]
    return chunk


async def _whole_events(answered: dict):
    """A context server's whole answer as the stream chunks one choice would have sent."""
    chunk = _as_chunk(answered)
    yield chunk
    if answered.get("usage"):
        yield {**chunk, "choices": [], "usage": answered["usage"]}


async def _events_of(upstream: httpx.Response):
    """The JSON chunks of one generation server's stream (closed when done or abandoned)."""
    try:
        async for line in upstream.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
    finally:
        await upstream.aclose()  # a client that leaves aborts the generation server's request


async def _merged_events(sources: list, include_usage: bool, state) -> AsyncIterator[bytes]:
    """Every choice's chunks as they come, choice `i`'s index rewritten to `i`; one usage chunk
    (the prompt counted once) and one `[DONE]` at the end."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, source) -> None:
        events = source if not isinstance(source, httpx.Response) else _events_of(source)
        try:
            async for chunk in events:
                await queue.put((i, chunk))
        except Exception as failure:
            await queue.put((i, failure))
        finally:
            await events.aclose()
            await queue.put((i, done))

    state.in_flight += 1
    pumps = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    usages: list[dict] = []
    try:
        for _ in range(len(sources)):
            while (item := await queue.get())[1] is not done:
                i, chunk = item
                if isinstance(chunk, Exception):
                    problem = {
                        "message": f"choice {i}: its generation server failed: {chunk!r}",
                        "code": "upstream",
                    }
                    yield f"data: {json.dumps({'error': problem})}\n\n".encode()
                    return
                if chunk.get("usage") and not chunk.get("choices"):
                    usages.append(chunk)
                    continue
                chunk["choices"] = [{**choice, "index": i} for choice in chunk.get("choices", [])]
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        if include_usage and usages:
            total = _merged([{**chunk, "choices": [{}]} for chunk in usages])
            yield f"data: {json.dumps({**usages[0], 'usage': total['usage']})}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        state.in_flight -= 1


def _whole_answer(answered: dict, body: dict):
    """The context server's answer as the client asked for it (a stream of one chunk, or JSON)."""
    if not body.get("stream"):
        return JSONResponse({key: value for key, value in answered.items() if key != "kv_handle"})
    chunk = _as_chunk(answered)

    async def events():
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def run_router(args: argparse.Namespace) -> int:
    if args.model is not None:
        return fail("--route makes a router, which serves no model itself: give no MODEL")
    try:
        routes = parse_routes(args.route)
    except ValueError as problem:
        return fail(str(problem))
    from berth.engine.serve.server import bind, serve, url_of

    try:
        sock = bind(args.host, args.port)
    except OSError as problem:
        return fail(f"cannot listen on {args.host}:{args.port}: {problem.strerror or problem}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = build_router_app(routes, args.api_key or os.environ.get("BERTH_API_KEY") or None)
    url = url_of(sock)
    with sock:
        serve(
            app,
            sock,
            on_signal=lambda: None,
            on_started=lambda: print(
                f"berth serve: routing to {routes}\nberth serve: listening on {url}", flush=True
            ),
            is_idle=lambda: app.state.in_flight == 0,
            on_timeout=lambda: None,
            shutdown_timeout=args.shutdown_timeout,
            log_level=args.log_level,
            access_log=args.access_log,
        )
    return 0
