"""Disaggregated prefill and decode: one request split over two engines (the request types and
the KV handle that crosses between them).

`ContextOnly` runs the prompt, samples the first token and keeps the request's KV blocks pinned
(at most `pin_seconds`); its output carries a `KVHandle`. `GenerationOnly(handle)`, sent with
the same prompt and sampling parameters to another engine, pulls those blocks' keys and values
and decodes from there exactly as if it had run the prompt itself; its output holds every
generated token, the first one included. The context engine frees the blocks when the pull is
acknowledged, or when the pin times out.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np

FALLBACKS = ("error", "local")


@dataclass(frozen=True)
class ContextOnly:
    """The output ends after the first token (finish_reason "length", or "stop" if that token
    ended the request: then there is no handle, nothing is left to generate)."""

    pin_seconds: float = 30.0  # how long the KV blocks wait for a generation engine to pull them

    def validate(self) -> None:
        if isinstance(self.pin_seconds, bool) or not isinstance(self.pin_seconds, (int, float)):
            raise ValueError(f"pin_seconds must be a number, got {self.pin_seconds!r}")
        if not 0 < self.pin_seconds <= 3600:
            raise ValueError(f"pin_seconds must be in (0, 3600], got {self.pin_seconds!r}")


@dataclass(frozen=True)
class KVLayout:
    """How the context engine stores keys and values: a generation engine refuses a handle of
    other layers, KV heads or head size (another model). The block size, the dtype and the
    number of ranks may differ: the KV travels per token, as every KV head of the model."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # of the whole model
    head_dim: int
    tensor_parallel_size: int  # how many ranks split the heads (rank r holds a contiguous slice)


@dataclass(frozen=True)
class KVHandle:
    address: str  # the context engine's KV transfer endpoint
    disagg_id: str  # the request's id there (random: it is also a capability)
    block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens whose keys and values the blocks hold
    first_token: int
    prompt_digest: str  # of the prompt's token ids: the generation request must bring the same
    layout: KVLayout
    context_request_id: int  # for correlating the two engines' logs


@dataclass(frozen=True)
class GenerationOnly:
    handle: KVHandle
    fallback: str = "error"  # or "local": a failed transfer runs the prompt here instead
    timeout: float = 30.0  # seconds for the pull (reserve, fetch, copy)

    def validate(self) -> None:
        if not isinstance(self.handle, KVHandle):
            raise ValueError(f"GenerationOnly needs a KVHandle, got {type(self.handle).__name__}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not self.timeout > 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")


Disaggregated = ContextOnly | GenerationOnly


def handle_to_dict(handle: KVHandle) -> dict:
    """Plain JSON data (what `berth serve` answers and a router passes on)."""
    return dataclasses.asdict(handle)


def handle_from_dict(data: object) -> KVHandle:
    """The handle a server answered with; ValueError if it is not one."""
    try:
        fields = dict(data)
        fields["layout"] = KVLayout(**fields["layout"])
        fields["block_ids"] = tuple(int(block) for block in fields["block_ids"])
        handle = KVHandle(**fields)
    except (TypeError, KeyError, ValueError) as error:
        raise ValueError(f"not a KV handle: {error}") from None
    if not isinstance(handle.address, str) or not isinstance(handle.disagg_id, str):
        raise ValueError("not a KV handle: address and disagg_id must be strings")
    return handle


def prompt_digest(token_ids: np.ndarray | list[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int32).tobytes()).hexdigest()


def check_disaggregated(value: object) -> None:
    if value is None:
        return
    if not isinstance(value, (ContextOnly, GenerationOnly)):
        raise ValueError(
            f"disaggregated must be ContextOnly(), GenerationOnly(handle) or None, got {value!r}"
        )
    value.validate()
