"""`Sequence`: one output sequence of a request, as the engine schedules it."""

from __future__ import annotations

import enum
import itertools

import torch

from berth.engine.sampling_params import SamplingParams


class SequenceState(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (new, or preempted and to be recomputed)
    CONTEXT_IN_PROGRESS = "context"  # prefilling its prompt, possibly over several chunks
    GENERATION_IN_PROGRESS = "generation"  # decoding one token per step
    FINISHED = "finished"


_arrival_order = itertools.count()


class Sequence:
    """A sequence's tokens, how far the KV cache covers them, and the blocks that hold them.

    The engine does not distinguish prefill from decode: each step computes the tokens not
    yet in the cache (`num_tokens - num_computed_tokens`), a whole prompt, a chunk of one, or
    the one token sampled last. When everything known is computed, the next token is sampled.
    A request with `n > 1` becomes `n` sequences sharing a `group` and the request's id;
    `seq_index` tells them apart.
    """

    def __init__(
        self,
        request_id: int,
        seq_index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: float,
        max_tokens: int,
        arrival_time: float,
        cache_salt: str | None = None,
        group: list[Sequence] | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.request_id = request_id
        self.seq_index = seq_index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time
        self.arrival_order = next(_arrival_order)
        self.group = group if group is not None else [self]
        self.state = SequenceState.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # Prefix caching: the chained hashes of the full blocks of `token_ids` (they never change:
        # tokens are only appended), and how many of `block_ids` are recorded in the cache.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        # Prompt tokens found in the prefix cache at its first admission (usage's cached_tokens).
        self.num_cached_tokens: int | None = None
        # The model's end-of-sequence tokens: what `min_tokens` holds back, with the stop ids.
        self.eos_token_ids = eos_token_ids
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # a stop token id; for an abort, why (if known)
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # What has been sent back: streamed sequences send every step, others once at the end.
        self.streaming = False
        self.num_sent_tokens = 0
        self.sent_any = False
        self.unsent_logprobs: list = []
        # A seeded sequence samples from its own generator (created by the sampler on the
        # logits' device), so its tokens do not depend on what else is batched with it.
        self.seed = None if params.seed is None else params.seed + seq_index
        self.generator: torch.Generator | None = None
        # Structured outputs: its llguidance matcher and how many output tokens it has consumed
        # (pyexecutor/grammar_masks.py).
        self.matcher = None
        self.num_matched_tokens = 0
        # Context-only (disaggregated): (the request's ContextOnly, the max_tokens it asked for).
        self.context_only: tuple | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.state is SequenceState.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.state = SequenceState.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason

    def reset_for_recompute(self) -> None:
        """Preempted: its cache is gone; prompt and output so far are recomputed on re-admission."""
        self.state = SequenceState.WAITING
        self.num_computed_tokens = 0
        self.block_ids = []
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (
            f"Sequence(request_id={self.request_id}, seq={self.seq_index}, state={self.state.value}, "
            f"tokens={self.num_computed_tokens}/{self.num_tokens})"
        )
