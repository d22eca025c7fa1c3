"""What `LLM.generate` returns: shaped the way vLLM and TensorRT-LLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field

from berth.engine.disaggregation import KVHandle


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence. `text_diff` / `token_ids_diff` hold what is new since the last
    streamed update of the same request (the whole output for a non-streamed result)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # A context-only request's handle to its pinned KV blocks, for GenerationOnly(handle) on
    # another engine; None when there is nothing more to generate (its first token ended it).
    kv_handle: KVHandle | None = None
    # Prompt tokens the prefix cache held when the request was admitted (None: not known yet).
    num_cached_tokens: int | None = None
