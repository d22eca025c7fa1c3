"""The executor boundary: requests, results, errors, and the shapes the engine runs in."""

from __future__ import annotations

from berth.engine.executor.errors import EngineDeadError, RequestError
from berth.engine.executor.executor import GenerationExecutor
from berth.engine.executor.request import GenerationRequest
from berth.engine.executor.result import GenerationResult

__all__ = ["EngineDeadError", "GenerationExecutor", "GenerationRequest", "GenerationResult", "RequestError"]


MODES = ("proxy", "in-process")


def create_executor(config, tokenizer, *, mode: str = "proxy") -> GenerationExecutor:
    """Starts an engine for `config` in the shape `mode` names.

    "proxy" (the default): the engine runs in a worker process; this process keeps the client
    work (detokenizing, streaming) and talks to it over signed ZeroMQ queues.
    "in-process": the engine loop runs on a thread of this process (one process to debug).
    """
    if mode == "proxy":
        from berth.engine.executor.proxy import ProxyExecutor

        return ProxyExecutor(config, tokenizer)
    if mode == "in-process":
        from berth.engine.executor.in_process import InProcessExecutor

        return InProcessExecutor(config, tokenizer)
    raise ValueError(f"executor mode must be one of {MODES}, got {mode!r}")
