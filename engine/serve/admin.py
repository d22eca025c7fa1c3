"""`/admin`: the engine's state, and sleep / wakeup, for the operator (bearer token when one is
configured).

`POST /admin/sleep` and `POST /admin/wakeup` answer when the transition is done (a drain may
take up to its timeout): 200 with what it did, 409 when the engine is not in the state the
transition starts from (another one runs, or it already sleeps / is awake), 400 for a bad
parameter or a model the engine cannot serve (it stays asleep), 503 when the engine is dead
(a transition that fails half-way kills it: the world must be restarted), 403 from an attached
frontend (`berth serve --attach`): the engine's owner alone sleeps and wakes it. `GET
/admin/state` answers on a frontend too, for the engine it is attached to.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from fastapi import APIRouter, Request

from berth.engine.engine_io import EngineLimits, TransitionError, TransitionResult
from berth.engine.executor.errors import EngineDeadError
from berth.engine.serve.auth import BEARER
from berth.engine.serve.context import ServingContext, serving
from berth.engine.serve.errors import APIError, bad_request, documented, unavailable
from berth.engine.serve.health import admission_of, fatal_error_of
from berth.engine.serve.protocol import SleepRequest, WakeupRequest

router = APIRouter(prefix="/admin", dependencies=BEARER, responses=documented(401))


@router.get("/state")
async def state(request: Request) -> dict:
    ctx = serving(request)
    executor = ctx.llm.executor
    healthy = ctx.llm.check_health()
    stats = executor.stats  # as of the engine's latest step; a dead engine's holds nothing
    used = stats.kv_blocks_used if stats is not None else 0
    total = stats.kv_blocks_total if stats is not None else None
    revision = executor.model_revision
    return {
        "model": ctx.model_name,
        "phase": "serving",  # "loading" (with the progress) while the engine starts: serve/loading.py
        "model_path": revision.path if revision is not None else ctx.model_path,
        "model_revision": _revision(revision, ctx.model_label),
        "max_model_len": ctx.max_model_len,
        "engine_pid": executor.engine_pid,
        "tensor_parallel_size": ctx.llm.config.tensor_parallel_size,
        # The processes of the engine's world (an attached frontend's executor knows none of them).
        "ranks": [{"rank": r, "pid": pid, "host": host} for r, pid, host in getattr(executor, "ranks", ())],
        "admission": admission_of(executor),
        "admission_since": stats.admission_since if stats is not None else None,
        "sleep_level": stats.sleep_level if stats is not None else 0,
        "healthy": healthy,
        "engine_dead": not healthy,
        "error": None if healthy else fatal_error_of(executor),
        "draining": ctx.draining,
        "num_running": stats.num_running if stats is not None else 0,
        "num_waiting": stats.num_waiting if stats is not None else 0,
        "num_pending": executor.num_pending,  # submitted through this server, not finished yet
        # Engine requests this server still reads (and records in /metrics) to their end.
        "num_in_flight": len(ctx.in_flight),
        # Held on the engine's device now (a sleep releases them).
        "kv_cache_bytes": stats.kv_cache_bytes if stats is not None else 0,
        "weight_bytes": stats.weight_bytes if stats is not None else 0,
        "resident_bytes": stats.resident_bytes if stats is not None else 0,  # the engine process's RSS
        # How the pool was sized at start: its blocks, bytes and tokens, and the limit applied.
        "kv_cache": kv_cache_plan(executor.limits),
        "kv_blocks_used": used,
        "kv_blocks_total": total,
        "kv_cache_usage": used / total if total else 0.0,
        "kv_blocks_cached": stats.kv_blocks_cached if stats is not None else 0,
        "prefix_caching": ctx.llm.config.enable_prefix_caching,
        "num_preemptions": stats.num_preemptions if stats is not None else 0,
        # Tokens the model has run since start (prefill and decode): the engine's own work.
        "num_computed_tokens": stats.num_computed_tokens if stats is not None else 0,
    }


def kv_cache_plan(limits: EngineLimits | None) -> dict | None:
    plan = limits.kv_cache if limits is not None else None
    if plan is None:
        return None
    return {
        **asdict(plan),
        "pool_bytes": plan.pool_bytes,
        "bytes_per_token": plan.bytes_per_token,
        "num_tokens": plan.num_tokens,
    }


TRANSITION_ERRORS = documented(400, 403, 409, 503, 504)


@router.post("/sleep", responses=TRANSITION_ERRORS)
async def sleep(request: Request, body: SleepRequest | None = None) -> dict:
    body = body or SleepRequest()
    ctx = serving(request)
    result = await _transition(ctx, "sleep", ctx.llm.sleep, body.level, body.mode, body.timeout)
    return {**_describe(result, ctx.model_label), "level": body.level, "mode": body.mode}


@router.post("/wakeup", responses=TRANSITION_ERRORS)
async def wakeup(request: Request, body: WakeupRequest | None = None) -> dict:
    body = body or WakeupRequest()
    ctx = serving(request)
    if body.revision is not None and body.model is None:
        # Without `model` a wakeup may keep the weights it held (level 1): naming them anew
        # would say they were re-read when they were not.
        raise bad_request("`revision` names the weights a wakeup loads: give `model` too", "revision")
    result = await _transition(ctx, "wakeup", ctx.llm.wake_up, body.model)
    if body.model is not None:
        ctx.model_label = body.revision  # new weights: the name they came with, or none
    return _describe(result, ctx.model_label)


async def _transition(ctx: ServingContext, kind: str, call, *args) -> TransitionResult:
    """Runs the blocking transition off the event loop; its errors as HTTP answers."""
    try:
        result = await asyncio.to_thread(call, *args)
    except TransitionError as error:
        if error.code == "conflict":
            raise APIError(409, str(error), code="transition_conflict") from error
        if error.code == "not_engine_owner":  # an attached frontend's: never, in any state
            raise APIError(403, str(error), code="not_engine_owner") from error
        param = "model" if error.code == "invalid_model" else None
        raise bad_request(str(error), param, error.code) from error
    except ValueError as error:
        raise bad_request(str(error)) from error
    except EngineDeadError as error:
        ctx.metrics.transition_failed()
        raise unavailable(str(error), "engine_dead") from error
    except TimeoutError as error:
        raise APIError(504, str(error), code="transition_timeout") from error
    ctx.metrics.transition_done(kind, result.seconds)
    return result


def _revision(revision, label: str | None) -> dict | None:
    return {**asdict(revision), "label": label} if revision is not None else None


def _describe(result: TransitionResult, label: str | None = None) -> dict:
    return {
        "admission": result.admission,
        "seconds": result.seconds,
        "drain_seconds": result.drain_seconds,
        "num_aborted": result.num_aborted,
        "memory_before": asdict(result.memory_before) if result.memory_before else None,
        "memory_after": asdict(result.memory_after) if result.memory_after else None,
        "model_revision": _revision(result.model_revision, label),
    }
