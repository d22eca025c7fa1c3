"""berth.engine: the LLM inference engine.

The public names are imported lazily, so `import berth.engine.<room>` stays cheap.
"""

from __future__ import annotations

if __name__ != "berth.engine":  # imported as a top-level `engine` from the checkout root
    from berth._rooms import step_aside

    step_aside(__name__, __file__)
else:
    _EXPORTS = {
        "LLM": "berth.engine.llm",
        "SamplingParams": "berth.engine.sampling_params",
        "StructuredOutputs": "berth.engine.structured_outputs",
        "RequestOutput": "berth.engine.outputs",
        "CompletionOutput": "berth.engine.outputs",
        "EngineConfig": "berth.engine.config",
        "EngineDeadError": "berth.engine.executor.errors",
        "RequestError": "berth.engine.engine_io",
        "ContextOnly": "berth.engine.disaggregation",
        "GenerationOnly": "berth.engine.disaggregation",
        "KVHandle": "berth.engine.disaggregation",
    }

    __all__ = sorted(_EXPORTS)

    def __getattr__(name: str):
        if name in _EXPORTS:
            import importlib

            return getattr(importlib.import_module(_EXPORTS[name]), name)
        raise AttributeError(f"module 'berth.engine' has no attribute {name!r}")
