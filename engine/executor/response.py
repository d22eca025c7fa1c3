"""What the engine sends back for one sequence in one step."""

from __future__ import annotations

from dataclasses import dataclass

# One generated token's log-probability and the top alternatives at its position:
# (logprob of the sampled token, its rank in the vocabulary, [(token_id, logprob), ...]).
TokenLogprobs = tuple[float, int, list[tuple[int, float]]]


@dataclass(slots=True)
class Response:
    client_id: int
    seq_index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that ended the sequence
    error: str | None = None  # a RequestError's message: the whole request failed
    error_code: str | None = None
    queue_seconds: float | None = None  # on a sequence's first response: arrival -> first scheduled
    first_token_time: float | None = None  # on the response carrying the first token: wall clock
