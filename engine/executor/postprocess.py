"""From the engine's token ids to what a client reads: text, stop strings, decoded logprobs.

The engine only knows token ids. Turning them into text is the client side's work, and its
heaviest: incremental detokenization, matching stop strings in the text (which ends a sequence
before the engine knows), and decoding every log-probability's token. It happens here, per
request, in one of two places:

- in the client's process, inside `GenerationResult` (the default), or
- in a postprocess worker process (`--num-postprocess-workers N`, `postprocess_worker.py`),
  which sends `SequenceUpdate`s on instead of raw responses.

The same code runs in both places, so their outputs are the same, token for token and byte for
byte. A request's postprocessor holds the state of its incremental detokenizer: that is why a
request is pinned to one postprocess worker for its whole life.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from berth.engine.disaggregation import KVHandle
from berth.engine.engine_io import RequestError, Response, internal_error
from berth.engine.outputs import Logprob
from berth.engine.sampling_params import SamplingParams
from berth.engine.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SequenceUpdate:
    """One engine response of one sequence, postprocessed: what the client's view changes by.

    The sequence's text becomes `text[:text_start] + text`: an append, or a cut (a stop string
    found in text already streamed), or a longer final text (the full decode at the end).
    """

    request_id: int
    seq_index: int
    token_ids: list[int]
    text_start: int = 0
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None  # one entry per new token, when asked for
    cumulative_logprob: float | None = None  # the total so far, when logprobs are asked for
    finish_reason: str | None = None  # as the client sees it: a stop string is a "stop"
    stop_reason: int | str | None = None
    stopped_by_string: bool = False  # the engine must be told to stop this sequence
    # The engine has ended this sequence (or failed the request). An error with this False
    # happened here, after the engine: the engine still runs the request and must abort it.
    engine_finished: bool = False
    error: RequestError | None = None  # the whole request failed
    queue_seconds: float | None = None
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held (first update)
    kv_handle: KVHandle | None = None  # a context-only request's (disaggregated)


class SequencePostprocessor:
    """One output sequence's text and logprobs, built up from its responses in order."""

    def __init__(
        self, request_id: int, index: int, params: SamplingParams, tokenizer, incremental: bool
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.params = params
        self.tokenizer = tokenizer if params.detokenize else None
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
            if incremental and self.tokenizer is not None
            else None
        )
        self.token_ids: list[int] = []
        self.text = ""
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.finished = False  # for the client: by the engine, or by a stop string
        self.engine_finished = False
        self.longest_stop = max((len(s) for s in params.stop_strings), default=0)

    def process(self, response: Response) -> SequenceUpdate:
        before = self.text
        update = SequenceUpdate(
            self.request_id,
            self.index,
            [],
            text_start=len(before),
            queue_seconds=response.queue_seconds,
            num_cached_tokens=response.num_cached_tokens,
            engine_finished=response.finish_reason is not None,
            kv_handle=response.kv_handle,
        )
        self.engine_finished |= update.engine_finished
        if self.finished:
            return update  # a stop string ended it: the engine's last tokens are nobody's
        update.token_ids = response.token_ids
        self.token_ids += response.token_ids
        if self.cumulative_logprob is not None:
            if response.logprobs:
                update.logprobs = self._decode_logprobs(response)
            update.cumulative_logprob = self.cumulative_logprob
        if self.detokenizer is not None:
            checked = len(self.text)
            self.text += "".join(self.detokenizer.step(t) for t in response.token_ids)
            if self.params.stop_strings and self._match_stop_string(checked, update):
                return self._with_text(update, before)
        if response.finish_reason is not None:
            self.finished = True
            update.finish_reason, update.stop_reason = response.finish_reason, response.stop_reason
            if self.tokenizer is not None:
                self._decode_all()
        return self._with_text(update, before)

    def _with_text(self, update: SequenceUpdate, before: str) -> SequenceUpdate:
        # The new text either extends the old one or cuts it short: what they share is a prefix.
        update.text_start = min(len(before), len(self.text))
        update.text = self.text[update.text_start :]
        return update

    def _decode_logprobs(self, response: Response) -> list[dict[int, Logprob]]:
        entries = []
        for token_id, (logprob, rank, top) in zip(response.token_ids, response.logprobs):
            entry = {tid: Logprob(lp, r + 1, self._decode_one(tid)) for r, (tid, lp) in enumerate(top)}
            entry.setdefault(token_id, Logprob(logprob, rank, self._decode_one(token_id)))
            entries.append(entry)
            self.cumulative_logprob += logprob
        return entries

    def _decode_all(self) -> None:
        """The final text: a full decode, as a non-streamed result has. A streamed one only
        takes what it adds at the end: the incremental detokenizer holds back a trailing
        incomplete UTF-8 character for good (a full decode shows it as U+FFFD), and text
        already streamed is never rewritten."""
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.params.skip_special_tokens)
        streamed_prefix_kept = len(full) > len(self.text) and full.startswith(self.text)
        if self.detokenizer is None or streamed_prefix_kept:
            self.text = full

    def _match_stop_string(self, checked: int, update: SequenceUpdate) -> bool:
        # Only a match that ends in the new text is new: start just far enough back.
        start = max(0, checked - self.longest_stop + 1)
        found = [(pos, s) for s in self.params.stop_strings if (pos := self.text.find(s, start)) >= 0]
        if not found:
            return False
        pos, stop = min(found)
        self.text = self.text[: pos + (len(stop) if self.params.include_stop_str_in_output else 0)]
        self.finished = True
        update.finish_reason, update.stop_reason, update.stopped_by_string = "stop", stop, True
        return True

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])


class RequestPostprocessor:
    """Every sequence of one request; knows when the engine is done with all of them."""

    def __init__(self, request_id: int, params: SamplingParams, tokenizer, streaming: bool) -> None:
        self.request_id = request_id
        # Stop strings are matched as the text grows, so they need the incremental detokenizer.
        incremental = streaming or bool(params.stop_strings)
        self.sequences = [
            SequencePostprocessor(request_id, i, params, tokenizer, incremental) for i in range(params.n)
        ]
        self.failed = False

    def process(self, response: Response) -> SequenceUpdate:
        """The update `response` makes. Whatever goes wrong here (a tokenizer that raises on a
        token, a response that does not fit the request) fails this request alone: the update
        carries the error, and whoever applies it aborts the request in the engine."""
        if response.error is not None:
            self.failed = True
            return self._failed(response, response.error, engine_finished=True)
        try:
            return self.sequences[response.seq_index].process(response)
        except Exception:
            logger.exception("request %d failed in postprocessing: it alone ends", self.request_id)
            self.failed = True
            return self._failed(response, internal_error("postprocess"), engine_finished=False)

    def _failed(self, response: Response, error: RequestError, *, engine_finished: bool) -> SequenceUpdate:
        return SequenceUpdate(
            self.request_id,
            response.seq_index,
            [],
            error=error,
            engine_finished=engine_finished,
            queue_seconds=response.queue_seconds,
        )

    @property
    def engine_done(self) -> bool:
        """Nothing more will come from the engine for this request."""
        return self.failed or all(s.engine_finished for s in self.sequences)
