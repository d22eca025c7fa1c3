"""`berth activator`: the endpoint of a deployment that may scale to zero. It stays Ready when
every world sleeps or is released, holds the requests that arrive then, tells the operator at
once, and forwards them, in arrival order, as soon as the operator names a world that serves.

Two ports. The public one (the deployment's Service selects this pod like a launcher) serves
`/v1/*`: forwarded to a serving world (round robin) when the operator has named any, held
otherwise, for up to `--wake-timeout` seconds (then 503 + Retry-After), or answered with the
operator's error at once when it reports that the wake failed. Streams pass through as they
come, so a streaming client's first token is the woken engine's first token. The admin port
(bearer token, exposed by no Service) has one route for the operator: `POST /admin/backends`
sets the serving worlds and answers once a request is held that the operator has not been told
of (a long poll), so the demand reaches it in milliseconds, not a health poll later.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import os
import socket
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask

from berth.engine.serve.auth import Authentication
from berth.engine.serve.errors import APIError, unavailable

# A held request is released only once the one held before it has reached its world (its
# response began) or this many seconds passed: the engine admits them in arrival order.
RELEASE_SPACING = 0.5
# Tries per request: a world that refuses it (503: asleep since the operator named it, or dead)
# or does not answer is set aside, and the request goes to another or waits for one.
ATTEMPTS = 3
# Hop-by-hop headers and those the forwarded body's framing decides: never copied across.
NOT_FORWARDED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}


class Backends(BaseModel):
    """What the operator pushes: the worlds that serve, or why none will."""

    backends: list[str] = Field(default_factory=list)
    """Base URLs (http://HOST:PORT) of launchers that admit requests."""
    failure: str | None = None
    """Set when the wake the held requests wait for failed: each gets this error at once."""
    seen: int = 0
    """Held requests the operator already knows of (heldTotal of its previous answer)."""
    wait: float = Field(default=25.0, ge=0, le=300)
    """How long to wait for a request the operator does not know of."""


class Activator:
    """The held requests and the serving worlds."""

    def __init__(self, wake_timeout: float) -> None:
        self.wake_timeout = wake_timeout
        self.backends: list[str] = []
        self.failure: str | None = None
        self.waiting: collections.deque[asyncio.Future[tuple[str, asyncio.Event]]] = collections.deque()
        self.held_total = 0  # requests ever held: the operator's long poll waits for it to grow
        self._held = asyncio.Condition()
        self._turn = itertools.count()
        self._releasing: asyncio.Task[None] | None = None

    async def backend(self) -> tuple[str, asyncio.Event]:
        """A world for one request (and the event to set once it reached it), after the requests
        held before it; holds it while no world serves."""
        if self.backends and not self.waiting:
            return self._next(), asyncio.Event()
        if self.failure is not None:
            raise unavailable(f"no world can serve: {self.failure}", "wake_failed")
        turn: asyncio.Future[tuple[str, asyncio.Event]] = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        async with self._held:
            self.held_total += 1
            self._held.notify_all()
        try:
            return await asyncio.wait_for(asyncio.shield(turn), self.wake_timeout)
        except TimeoutError:
            raise unavailable(
                f"no world woke within {self.wake_timeout:g}s to serve this request", "wake_timeout"
            ) from None
        finally:
            if turn in self.waiting:
                self.waiting.remove(turn)

    def set_backends(self, backends: list[str], failure: str | None) -> None:
        self.backends, self.failure = backends, None if backends else failure
        if self.failure is not None:
            error = unavailable(f"no world can serve: {self.failure}", "wake_failed")
            while self.waiting:
                turn = self.waiting.popleft()
                if not turn.done():
                    turn.set_exception(error)
        elif backends and self.waiting and (self._releasing is None or self._releasing.done()):
            self._releasing = asyncio.create_task(self._release())

    async def _release(self) -> None:
        """Hand the held requests their world, oldest first, one at a time."""
        while self.waiting and self.backends:
            turn = self.waiting.popleft()
            if turn.done():
                continue  # timed out meanwhile
            reached = asyncio.Event()
            turn.set_result((self._next(), reached))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reached.wait(), RELEASE_SPACING)

    def not_serving(self, backend: str) -> None:
        """A world refused or did not answer: no more requests go there until the operator names
        it again (its next update)."""
        if backend in self.backends:
            self.backends = [other for other in self.backends if other != backend]

    async def wait_for_demand(self, seen: int, wait: float) -> None:
        """Until a request is held that the operator has not seen, or `wait` seconds pass."""
        async with self._held:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._held.wait_for(lambda: self.held_total > seen), wait)

    def _next(self) -> str:
        return self.backends[next(self._turn) % len(self.backends)]


def public_app(activator: Activator, client: httpx.AsyncClient, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="berth activator")

    @app.get("/ready")
    @app.get("/live")
    @app.get("/health")
    async def alive() -> dict[str, Any]:
        # Ready whatever the worlds do: holding requests while none serves is this pod's job.
        return {"status": "ok", "backends": len(activator.backends), "held": len(activator.waiting)}

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED}
        for attempt in range(ATTEMPTS):
            try:
                backend, reached = await activator.backend()
            except APIError as error:
                return error.response()
            upstream = client.build_request(
                request.method,
                f"{backend}/v1/{path}",
                content=body,
                headers=headers,
                params=request.query_params,
            )
            try:
                response = await client.send(upstream, stream=True)
            except httpx.HTTPError as exc:
                activator.not_serving(backend)
                if attempt + 1 < ATTEMPTS:
                    continue
                return unavailable(
                    f"the world at {backend} did not answer: {exc}", "backend_unreachable"
                ).response()
            finally:
                reached.set()
            if response.status_code == 503 and attempt + 1 < ATTEMPTS:
                # Not admitted (it went to sleep since the operator named it, or died): the
                # request waits for a world that serves, as if it had come a moment later.
                await response.aclose()
                activator.not_serving(backend)
                continue
            kept = {k: v for k, v in response.headers.items() if k.lower() not in NOT_FORWARDED}
            return StreamingResponse(
                response.aiter_raw(),
                status_code=response.status_code,
                headers=kept,
                background=BackgroundTask(response.aclose),
            )
        raise AssertionError("unreachable")  # the last attempt always returns

    return app if api_key is None else Authentication(app, api_key=api_key, admin_token=None)


def admin_app(activator: Activator, admin_token: str | None) -> Any:
    app = FastAPI(title="berth activator admin")

    @app.post("/admin/backends")
    async def backends(update: Backends) -> dict[str, Any]:
        activator.set_backends(update.backends, update.failure)
        await activator.wait_for_demand(update.seen, update.wait)
        return {"held": len(activator.waiting), "heldTotal": activator.held_total}

    return Authentication(app, api_key=None, admin_token=admin_token)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the public port (/v1, /ready)")
    parser.add_argument("--admin-port", type=int, default=8002, help="the operator's port (/admin)")
    parser.add_argument(
        "--wake-timeout",
        type=float,
        default=300.0,
        help="seconds a held request waits for a world (then 503)",
    )


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after its shutdown; a stop is a clean end (exit 0).
        self._captured_signals.clear()


def by_port(public: Any, admin: Any, admin_port: int) -> Any:
    """One ASGI app for both ports: the admin routes only on the admin port."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        server = scope.get("server") or (None, None)
        await (admin if server[1] == admin_port else public)(scope, receive, send)

    return app


async def serve(args: argparse.Namespace) -> None:
    activator = Activator(args.wake_timeout)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
        public = public_app(activator, client, os.environ.get("BERTH_API_KEY") or None)
        admin = admin_app(activator, os.environ.get("BERTH_ADMIN_TOKEN") or None)
        sockets = []
        for port in (args.port, args.admin_port):
            sock = socket.create_server((args.host, port), reuse_port=False)
            sockets.append(sock)
        # One server on both sockets: one signal handler, so SIGTERM ends the pod at once.
        config = uvicorn.Config(by_port(public, admin, sockets[1].getsockname()[1]), log_level="warning")
        print(f"berth activator: listening on http://{args.host}:{sockets[0].getsockname()[1]}", flush=True)
        await _Server(config).serve(sockets=sockets)


def run(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0
