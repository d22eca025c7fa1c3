"""What probes and monitoring read: `/health`, `/ready`, `/live`, `/metrics`.

`/health` must not lie: once the engine is dead it answers 503 for as long as this process
lives (the operator, not the kubelet, restarts a world). None of these routes blocks: they
run on the event loop and only read state the executor keeps up to date.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from berth.engine.executor.errors import EngineStalledError
from berth.engine.serve.context import serving

router = APIRouter()


def admission_of(executor) -> str:
    try:
        return executor.admission_state
    except Exception:  # a dead engine may be unable to say; the probe must still answer
        return "unknown"


def death_reason_of(executor) -> str:
    """Why the engine is dead, in one word: "stalled" (alive but making no progress), "died"."""
    return "stalled" if isinstance(executor.fatal_error, EngineStalledError) else "died"


def fatal_error_of(executor) -> str:
    error = executor.fatal_error
    return f"{type(error).__name__}: {error}" if error is not None else "the engine is dead"


@router.get(
    "/health",
    responses={
        503: {
            "description": 'The engine is dead: {"engine_dead": true, "reason": "stalled" or "died", '
            '"error": "..."}'
        }
    },
)
async def health(request: Request) -> JSONResponse:
    llm = serving(request).llm
    if llm.check_health():
        return JSONResponse({"status": "ok"})
    executor = llm.executor
    body = {"engine_dead": True, "reason": death_reason_of(executor), "error": fatal_error_of(executor)}
    return JSONResponse(body, status_code=503)


@router.get("/ready", responses={503: {"description": "Not healthy, not admitting, or shutting down"}})
async def ready(request: Request) -> JSONResponse:
    """The readiness probe: healthy *and* admitting (a sleeping engine leaves the Service)."""
    ctx = serving(request)
    healthy = ctx.llm.check_health()
    admission = admission_of(ctx.llm.executor) if healthy else "failed"
    is_ready = healthy and admission == "running" and not ctx.draining
    body = {"ready": is_ready, "admission": admission, "healthy": healthy, "draining": ctx.draining}
    return JSONResponse(body, status_code=200 if is_ready else 503)


@router.get("/live")
async def live() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = serving(request)
    ctx.llm.check_health()  # notices a dead engine even when no probe has asked yet
    ctx.metrics.refresh(ctx.llm.executor)
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
