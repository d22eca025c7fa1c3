"""The FastAPI application: the routes of each room, OpenAI-shaped errors, one engine."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from berth import __version__
from berth.engine.serve import admin, chat, completions, health, models, responses, tokenization
from berth.engine.serve.admin_listener import AdminListener
from berth.engine.serve.auth import Authentication
from berth.engine.serve.body_limit import BodyLimit
from berth.engine.serve.context import ServingContext
from berth.engine.serve.errors import install_error_handlers
from berth.engine.serve.loading import LoadingGate


def build_app(ctx: ServingContext, admin_port: int | None = None) -> FastAPI:
    """An app serving `ctx.llm`. The caller owns the engine: it starts it before and shuts it
    down after the app (the CLI, or a test that runs several apps in one process). With
    `admin_port`, /admin answers only on connections to that port (admin_listener.py)."""
    app = FastAPI(
        title="berth",
        version=__version__,
        description="An OpenAI-compatible server for one model, with health, readiness and metrics.",
    )
    app.state.serving = ctx
    install_error_handlers(app)
    for room in (models, completions, chat, responses, tokenization, health, admin):
        app.include_router(room.router)
    # The last added runs first: which listener, who is asking, then how much they send, then
    # (while the engine loads) the loading gate, then the routes.
    app.add_middleware(LoadingGate, ctx=ctx)
    app.add_middleware(BodyLimit, max_bytes=ctx.max_request_body_bytes)
    app.add_middleware(Authentication, api_key=ctx.api_key, admin_token=ctx.admin_token)
    if admin_port is not None:
        app.add_middleware(AdminListener, admin_port=admin_port)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI documents a body that fails validation as a 422 `HTTPValidationError`; this
    server answers it with a 400 in OpenAI's error shape (errors.py), and the document says so,
    so that clients generated from it handle the real answers."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema
