"""How to sample one request's output, validated where the user can still fix it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Integers the engine computes with are 64-bit (torch tensors, seeds); token ids are 32-bit.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1
# Below this temperature, softmax(logits / T) overflows to NaN: such requests are sampled
# greedily, which is what they ask for in effect (vLLM does the same).
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object, low: int = INT64_MIN, high: int = INT64_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@dataclass
class SamplingParams:
    """Sampling settings of one request (the names and defaults vLLM users know).

    `temperature=0` is greedy decoding. `top_k` 0 or -1 and `top_p` 1.0 disable those filters.
    `logprobs=k` returns the sampled token's log-probability plus the k most likely
    alternatives at each step (0 for the sampled token alone). `seed` makes one request's
    sampling reproducible whatever else is batched with it.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the field first. Also run by the engine on what it receives:
        an unpickled SamplingParams never ran __post_init__."""
        if not _is_int(self.n, 1):
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and not _is_int(self.max_tokens, 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k, -1):
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs, 0, MAX_LOGPROBS)):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}"
            )
        if not isinstance(self.stop, (str, list, tuple, type(None))):
            raise ValueError(f"stop must be a string, a list of strings or None, got {self.stop!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = tuple(stop)
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        stop_ids = list(self.stop_token_ids or [])
        if any(not _is_int(t, 0, MAX_TOKEN_ID) for t in stop_ids):
            raise ValueError(
                f"stop_token_ids must be token ids (integers in [0, {MAX_TOKEN_ID}]), "
                f"got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = stop_ids
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop_strings and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
