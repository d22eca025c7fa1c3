"""`/admin`: the engine's state for the operator (bearer token when one is configured)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from berth.engine.serve.auth import require_admin_token
from berth.engine.serve.context import serving
from berth.engine.serve.errors import documented
from berth.engine.serve.health import admission_of, fatal_error_of

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin_token)], responses=documented(401))


@router.get("/state")
async def state(request: Request) -> dict:
    ctx = serving(request)
    executor = ctx.llm.executor
    healthy = ctx.llm.check_health()
    stats = executor.stats  # None until the engine's first step
    used = stats.kv_blocks_used if stats is not None else 0
    total = stats.kv_blocks_total if stats is not None else None
    return {
        "model": ctx.model_name,
        "model_path": ctx.model_path,
        "max_model_len": ctx.max_model_len,
        "engine_pid": executor.engine_pid,
        "admission": admission_of(executor),
        "healthy": healthy,
        "engine_dead": not healthy,
        "error": None if healthy else fatal_error_of(executor),
        "draining": ctx.draining,
        "num_running": stats.num_running if stats is not None else 0,
        "num_waiting": stats.num_waiting if stats is not None else 0,
        "num_pending": executor.num_pending,  # submitted through this server, not finished yet
        # Engine requests this server still reads (and records in /metrics) to their end.
        "num_in_flight": len(ctx.in_flight),
        "kv_blocks_used": used,
        "kv_blocks_total": total,
        "kv_cache_usage": used / total if total else 0.0,
        "num_preemptions": getattr(stats, "num_preemptions", 0),
    }
