"""`berth serve`: the engine's HTTP face — OpenAI's API, health, readiness, admin, metrics."""

from berth.engine.serve.app import build_app
from berth.engine.serve.context import ServingContext

__all__ = ["ServingContext", "build_app"]
