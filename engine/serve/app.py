"""The FastAPI application: the routes of each room, OpenAI-shaped errors, one engine."""

from __future__ import annotations

from fastapi import FastAPI

from berth import __version__
from berth.engine.serve import admin, chat, completions, health, models
from berth.engine.serve.context import ServingContext
from berth.engine.serve.errors import install_error_handlers


def build_app(ctx: ServingContext) -> FastAPI:
    """An app serving `ctx.llm`. The caller owns the engine: it starts it before and shuts it
    down after the app (the CLI, or a test that runs several apps in one process)."""
    app = FastAPI(
        title="berth",
        version=__version__,
        description="An OpenAI-compatible server for one model, with health, readiness and metrics.",
    )
    app.state.serving = ctx
    install_error_handlers(app)
    for room in (models, completions, chat, health, admin):
        app.include_router(room.router)
    return app
