"""`berth serve --route context=URL[,URL...] --route generation=URL[,URL...]`: the front door of
disaggregated serving. Each OpenAI request (`/v1/completions`, `/v1/chat/completions`) runs
first on a context server (`berth serve --role context`) as context-only: its prompt, its first
token, a KV handle; then on a generation server (`--role generation`) continuing from that
handle, whose answer (streamed or not) goes to the client as it comes. Servers of a role are
taken in turn, passing over one that refuses the connection or answers 503 (asleep, draining)
while another is left. Both halves carry the same `X-Request-Id` (the client's, or a new one),
which the servers log with their engines' request ids.

A request the first token ends (or with `max_tokens` 1) is answered from the context server's
reply. A request with `n` > 1 is refused: the engines split single sequences (send `n` requests).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import uuid
from collections.abc import Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from berth.engine.serve.arguments import fail

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
                if last:
                    raise
                continue
            if reply.status_code != 503 or last:
                return url, reply
            await reply.aclose()
            logger.info("%s answered 503: the request goes to another %s server", url, role)
        raise AssertionError("unreachable: a route has at least one server of each role")

    async def route(request: Request, path: str):
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "a valid API key is required (Authorization: Bearer ...)", "invalid_api_key")
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error(400, "the body is not JSON", "invalid_json")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object", "invalid_body")
        if body.get("n", 1) != 1:
            return error(400, "the router splits single sequences: send n requests with n=1", "unsupported_n")
        request_id = request.headers.get(REQUEST_ID) or f"route-{uuid.uuid4().hex}"
        headers = forwarded_headers(request, request_id)
        first_half = {**body, "stream": False, "disaggregated": {"context_only": True}}
        first_half.pop("stream_options", None)
        app.state.in_flight += 1
        try:
            context_url, context = await to_one_of(
                "context", lambda url: client.post(url + path, json=first_half, headers=headers)
            )
            if context.status_code != 200:
                return Response(context.content, context.status_code, media_type="application/json")
            answered = context.json()
            handle = answered.pop("kv_handle", None)
            logger.info(
                "%s: context part on %s done (handle: %s)", request_id, context_url, handle is not None
            )
            if handle is None:  # the first token ended it: the context's answer is the whole answer
                return _whole_answer(answered, body)
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
        except httpx.HTTPError as failure:
            return error(502, f"a server of the route did not answer: {failure!r}", "upstream_unavailable")
        finally:
            app.state.in_flight -= 1
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, upstream.status_code, media_type="application/json")

        async def relay():
            app.state.in_flight += 1
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()  # a client that leaves aborts the generation server's request
                app.state.in_flight -= 1

        return StreamingResponse(relay(), media_type="text/event-stream", headers={REQUEST_ID: request_id})

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


def _whole_answer(answered: dict, body: dict):
    """The context server's answer as the client asked for it (a stream of one chunk, or JSON)."""
    if not body.get("stream"):
        return JSONResponse(answered)
    chunk = dict(answered)
    if chunk.get("object") == "chat.completion":
        chunk["object"] = "chat.completion.chunk"
        chunk["choices"] = [
            {"index": c["index"], "delta": c["message"], "finish_reason": c["finish_reason"]}
            for c in answered["choices"]
        ]
    chunk.pop("usage", None)

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
