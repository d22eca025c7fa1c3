"""berth.engine: the LLM inference engine."""
