"""The executor boundary: requests, results, errors, and the shapes the engine runs in."""

from __future__ import annotations

from berth.engine.executor.errors import EngineDeadError, RequestError
from berth.engine.executor.executor import GenerationExecutor
from berth.engine.executor.request import GenerationRequest
from berth.engine.executor.result import GenerationResult

__all__ = ["EngineDeadError", "GenerationExecutor", "GenerationRequest", "GenerationResult", "RequestError"]


def create_executor(config, tokenizer, *, mode: str = "in-process") -> GenerationExecutor:
    """Starts an engine for `config` in the shape `mode` names."""
    if mode == "in-process":
        from berth.engine.executor.in_process import InProcessExecutor

        return InProcessExecutor(config, tokenizer)
    raise ValueError(f"executor mode must be 'in-process', got {mode!r}")
