"""berth: run LLM inference engines on Kubernetes."""

__version__ = "0.1.0"
