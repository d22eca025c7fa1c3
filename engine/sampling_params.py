"""How to sample one request's output, validated where the user can still fix it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from berth.engine.structured_outputs import StructuredOutputs

MAX_LOGPROBS = 20
# Integers the engine computes with are 64-bit (torch tensors, seeds); token ids are 32-bit.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1
# Below this temperature, softmax(logits / T) overflows to NaN: such requests are sampled
# greedily, which is what they ask for in effect (vLLM does the same).
GREEDY_TEMPERATURE = 1e-5
# OpenAI's bounds: a bias is added to a token's logit (±100 bans or forces it), on at most 300
# tokens a request; the penalties are in [-2, 2].
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_PENALTY = 2.0
# A repetition penalty divides or multiplies logits: bounded so that no logit overflows float32.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


def _is_int(value: object, low: int = INT64_MIN, high: int = INT64_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@dataclass
class SamplingParams:
    """Sampling settings of one request (the names and defaults vLLM users know).

    `temperature=0` is greedy decoding. `top_k` 0 or -1 and `top_p` 1.0 disable those filters.
    `logprobs=k` returns the sampled token's log-probability plus the k most likely
    alternatives at each step (0 for the sampled token alone). `seed` makes one request's
    sampling reproducible whatever else is batched with it.

    Adjustments of the logits before sampling (`pyexecutor/logits_processors.py`), greedy
    requests included: `presence_penalty` and `frequency_penalty` (OpenAI's: subtracted once per
    token that occurs in the output, and once per occurrence), `repetition_penalty` (vLLM's:
    the logit of a token in the prompt or output is divided by it when positive, multiplied when
    negative; 1.0 is off), `logit_bias` (token id -> a bias added to its logit; JSON's string
    keys are read as ids), `min_tokens` (no end of sequence, EOS or stop token id, before that
    many tokens). `min_p` drops tokens less likely than `min_p` times the most likely one, after
    temperature.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None
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
        self._validate_adjustments()
        self._validate_structured_outputs()

    def _validate_structured_outputs(self) -> None:
        """The output's shape (engine/structured_outputs.py); whether its grammar compiles is
        checked where the tokenizer is (the server asks first, the engine again at admission)."""
        spec = self.structured_outputs
        if spec is None:
            return
        if not isinstance(spec, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, got {spec!r}")
        spec.validate()
        # Each would let a "stop" output end before its grammar does, or never let it end.
        if self.ignore_eos:
            raise ValueError(
                "structured_outputs cannot be combined with ignore_eos: the output ends when its grammar does"
            )
        if self.min_tokens:
            raise ValueError(
                "structured_outputs cannot be combined with min_tokens: a complete output may only end"
            )
        if self.stop_strings or self.stop_token_ids:
            raise ValueError(
                "structured_outputs cannot be combined with stop or stop_token_ids: "
                "they would cut the output before its grammar ends"
            )

    def _validate_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}"
                )
        low, high = MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        if not _finite_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise ValueError(
                f"repetition_penalty must be in [{low:g}, {high:g}] (1.0: off), "
                f"got {self.repetition_penalty!r}"
            )
        if not _finite_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens, 0):
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self.logit_bias = _checked_logit_bias(self.logit_bias)

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the sampler's common path skips them all otherwise)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _checked_logit_bias(bias: object) -> dict[int, float] | None:
    """`bias` with int keys (JSON's object keys are strings: "50256" is token 50256), or None
    for no bias at all; raises ValueError naming logit_bias."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)}")
    checked: dict[int, float] = {}
    for key, value in bias.items():
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10
        token = int(key) if digits else key
        if not _is_int(token, 0, MAX_TOKEN_ID):
            raise ValueError(
                f"logit_bias keys must be token ids (integers in [0, {MAX_TOKEN_ID}]), got {key!r}"
            )
        if not _finite_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {value!r} for token {key!r}"
            )
        checked[token] = float(value)
    return checked or None


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
