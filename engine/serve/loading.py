"""While the engine loads, the server already answers.

A big model takes minutes to load; a server that listens only once it is loaded looks dead to
every probe meanwhile (connection refused), and nobody can tell a slow load from a hung one.
So `berth serve` listens from the start and, until the engine is up, this gate answers:

- `/live` 200: the process answers (the kubelet's startup and liveness probes);
- `/health` 200 `{"status": "loading", ...}`: not dead (the operator must not restart a world
  for loading), with the progress;
- `/ready` 503 `{"ready": false, "admission": "loading", "loading": {...}}`: not in the Service;
- `/admin/state` (behind the admin token, as always) the phase and progress; sleep and wakeup
  409 (nothing to put to sleep yet);
- `/metrics` what the registry holds; every other route 503 + `Retry-After`.

The progress is rank 0's (`LoadProgress`): the weights read, the KV cache sized (a profiled
step), the model checked (one token through every rank). `/ready` turns 200 only after that
check: the first step, which may compile kernels, is behind the engine when it admits traffic.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from berth.engine.engine_io import LoadProgress
from berth.engine.serve.errors import APIError, unavailable


class Loading:
    """How far the engine's start has come (updated from the loading thread)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.progress: LoadProgress | None = None

    def update(self, progress: LoadProgress) -> None:
        self.progress = progress

    def describe(self) -> dict:
        progress = self.progress
        return {
            "step": progress.step if progress is not None else "starting the engine",
            "done": progress.done if progress is not None else 0,
            "total": progress.total if progress is not None else 0,
            "fraction": progress.fraction if progress is not None else None,
            "message": progress.describe() if progress is not None else "starting the engine",
            "seconds": round(time.monotonic() - self.started, 1),
        }


class LoadingGate:
    """Answers for the engine until `ctx.llm` is set (a pure ASGI middleware: nothing of the
    app runs before the engine exists)."""

    def __init__(self, app: ASGIApp, ctx) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loading = self.ctx.loading
        if scope["type"] != "http" or self.ctx.llm is not None or loading is None:
            await self.app(scope, receive, send)
            return
        await _answer(scope["method"], scope["path"], loading, self.ctx)(scope, receive, send)


def _answer(method: str, path: str, loading: Loading, ctx) -> Response:
    progress = loading.describe()
    if path == "/live":
        return JSONResponse({"status": "ok"})
    if path == "/health":
        return JSONResponse({"status": "loading", "loading": progress})
    if path == "/ready":
        body = {"ready": False, "admission": "loading", "healthy": True, "draining": ctx.draining}
        return JSONResponse({**body, "loading": progress}, status_code=503)
    if path == "/metrics":
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
    if path == "/admin/state":
        state = {"model": ctx.model_name, "model_path": ctx.model_path, "phase": "loading"}
        return JSONResponse(
            {**state, "admission": "loading", "healthy": True, "engine_dead": False, "loading": progress}
        )
    message = f"the engine is loading ({progress['message']}, {progress['seconds']:g} s so far)"
    if path.startswith("/admin/") and method == "POST":
        return APIError(409, f"{message}: nothing to put to sleep or wake yet", code="conflict").response()
    return unavailable(message, "engine_loading").response()
