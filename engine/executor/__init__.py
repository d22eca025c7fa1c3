"""The executor boundary: requests, results, errors, and the shapes the engine runs in."""

from __future__ import annotations

from berth.engine.engine_io import GenerationRequest, RequestError
from berth.engine.executor.errors import EngineDeadError
from berth.engine.executor.executor import GenerationExecutor
from berth.engine.executor.result import GenerationResult

__all__ = ["EngineDeadError", "GenerationExecutor", "GenerationRequest", "GenerationResult", "RequestError"]


MODES = ("proxy", "in-process")


def create_executor(
    config, tokenizer, *, mode: str = "proxy", world=None, num_postprocess_workers: int = 0, on_progress=None
) -> GenerationExecutor:
    """Starts an engine for `config` in the shape `mode` names.

    "proxy" (the default): the engine runs in a worker process, or with tensor parallelism in
    an MPI world of ranks (`world`: where; default this machine); this process keeps the client
    work (detokenizing, streaming) and talks to it (rank 0) over signed ZeroMQ queues. With
    `num_postprocess_workers` N > 0, detokenizing moves to N processes of its own.
    "in-process": the engine loop runs on a thread of this process (one process to debug).
    `on_progress` hears how the engine's start comes along (`LoadProgress`), until it returns.
    """
    if mode == "proxy":
        from berth.engine.executor.proxy import ProxyExecutor

        return ProxyExecutor(
            config,
            tokenizer,
            world=world,
            num_postprocess_workers=num_postprocess_workers,
            on_progress=on_progress,
        )
    if num_postprocess_workers:
        raise ValueError("num_postprocess_workers needs the proxy executor (the engine in a worker process)")
    if world is not None or config.tensor_parallel_size > 1:
        raise ValueError(
            f"executor {mode!r} runs one engine in this process: tensor parallelism needs executor 'proxy'"
        )
    if mode == "in-process":
        from berth.engine.executor.in_process import InProcessExecutor

        return InProcessExecutor(config, tokenizer, on_progress)
    raise ValueError(f"executor mode must be one of {MODES}, got {mode!r}")
