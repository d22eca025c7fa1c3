"""`GenerationResult`: the client's handle on one submitted request.

It is filled by the executor's dispatch thread and read by the client from sync code
(`result()`, `for out in result`) or async code (`await result`, `async for out in result`).
Detokenization and stop-string matching happen on the client side of the boundary, so the
engine loop never spends time on text: here (`postprocess.py`), or in a postprocess worker
process that sends the updates ready-made.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from berth.engine.disaggregation import KVHandle
from berth.engine.engine_io import GenerationRequest, RequestError, Response
from berth.engine.executor.errors import EngineDeadError
from berth.engine.executor.postprocess import RequestPostprocessor, SequenceUpdate
from berth.engine.outputs import CompletionOutput, Logprob, RequestOutput
from berth.engine.sampling_params import SamplingParams


class _Sequence:
    """One of the request's `n` output sequences, as the client sees it."""

    def __init__(self, index: int, params: SamplingParams) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.kv_handle: KVHandle | None = None
        self.longest_stop = max((len(s) for s in params.stop_strings), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, update: SequenceUpdate) -> bool:
        """Applies one postprocessed response; returns True when a stop string ended the
        sequence here (the engine does not know yet and must be told to stop it)."""
        self.token_ids += update.token_ids
        if self.logprobs is not None and update.logprobs:
            self.logprobs += update.logprobs
        if update.cumulative_logprob is not None:
            self.cumulative_logprob = update.cumulative_logprob
        if update.text or update.text_start < len(self.text):
            self.text = self.text[: update.text_start] + update.text
        if update.finish_reason is not None:
            self.finish_reason, self.stop_reason = update.finish_reason, update.stop_reason
        if update.kv_handle is not None:
            self.kv_handle = update.kv_handle
        return update.stopped_by_string

    def visible_text(self) -> str:
        """While streaming, hold back a tail that might still become a stop string."""
        if self.finished or self.longest_stop <= 1:
            return self.text
        return self.text[: max(0, len(self.text) - self.longest_stop + 1)]


class GenerationResult:
    def __init__(
        self,
        request: GenerationRequest,
        *,
        tokenizer=None,
        prompt: str | None = None,
        abort: Callable[[int, int | None], None] | None = None,
    ) -> None:
        self.request = request
        self.prompt = prompt
        self._abort = abort
        params = request.sampling_params
        self._sequences = [_Sequence(i, params) for i in range(params.n)]
        self._tokenizer = tokenizer
        # Raw engine responses are postprocessed here; updates from a postprocess worker
        # arrive postprocessed. Built on the first raw response.
        self._postprocessor: RequestPostprocessor | None = None
        self._lock = threading.Lock()
        self._updated = threading.Condition(self._lock)
        self._version = 0
        self._done = False
        self._error: BaseException | None = None
        # Every asyncio consumer waiting for news (several may await or iterate one result).
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.queue_seconds: float | None = None
        self.num_cached_tokens: int | None = None  # the first sequence's to report it
        # The engine's clock (wall time) at each step that brought this request new tokens:
        # what inter-token latency is measured on, however the updates are consumed.
        self.token_step_times: list[float] = []

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self._done

    # ---- called by the executor's dispatch thread -------------------------------------------

    def _handle(self, responses: list[Response | SequenceUpdate], step_time: float) -> list[int | None]:
        """Applies one step's responses, raw or postprocessed (the step ran at `step_time`, the
        engine's clock); returns what the engine must stop because this side ended it: the
        sequences a stop string ended, or None for the whole request when postprocessing it
        failed (the engine does not know, and would go on computing it for nobody)."""
        stopped: list[int | None] = []
        with self._lock:
            if self._done:
                return stopped  # late responses after a stop string or an error: dropped
            if any(response.token_ids for response in responses):
                self.token_step_times.append(step_time)
            for response in responses:
                update = response if isinstance(response, SequenceUpdate) else self._postprocess(response)
                if update.queue_seconds is not None and self.queue_seconds is None:
                    self.queue_seconds = update.queue_seconds
                if update.num_cached_tokens is not None and self.num_cached_tokens is None:
                    self.num_cached_tokens = update.num_cached_tokens
                if update.error is not None:
                    self._finish(update.error)
                    return stopped if update.engine_finished else [None]
                sequence = self._sequences[update.seq_index]
                if not sequence.finished and sequence.apply(update):
                    stopped.append(sequence.index)
            if all(s.finished for s in self._sequences):
                self._finish(None)
            else:
                self._version += 1
                self._updated.notify_all()
        return stopped

    def _postprocess(self, response: Response) -> SequenceUpdate:
        if self._postprocessor is None:
            self._postprocessor = RequestPostprocessor(
                self.request_id, self.request.sampling_params, self._tokenizer, self.request.streaming
            )
        return self._postprocessor.process(response)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if not self._done:
                self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done = True
        self._version += 1
        self._updated.notify_all()

    def _take_waiters(self) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        return waiters

    # ---- the client's side ------------------------------------------------------------------

    def abort(self) -> None:
        """Asks the engine to stop this request; its unfinished sequences end with "abort"."""
        if self._abort is not None and not self._done:
            self._abort(self.request_id, None)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Blocks until the request is finished; raises its error (the same one every time)."""
        with self._lock:
            if not self._updated.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
            return self._output()

    async def aresult(self) -> RequestOutput:
        while True:
            with self._lock:
                if self._done:
                    return self._output()
                version = self._version
            await self._changed_since(version)

    def __await__(self):
        return self.aresult().__await__()

    def __iter__(self) -> Iterator[RequestOutput]:
        """Streams updates: each carries the cumulative output and what is new (`*_diff`) to this
        stream (several streams of one result each see everything)."""
        cursors = [(0, 0)] * len(self._sequences)
        while True:
            with self._lock:
                version = self._version
                output = self._output(cursors) if self._has_news(cursors) else None
                done = self._done
            if output is not None:
                yield output
            if done:
                return
            with self._lock:
                self._updated.wait_for(lambda v=version: self._version != v)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        cursors = [(0, 0)] * len(self._sequences)
        while True:
            with self._lock:
                version = self._version
                output = self._output(cursors) if self._has_news(cursors) else None
                done = self._done
            if output is not None:
                yield output
            if done:
                return
            await self._changed_since(version)

    async def _changed_since(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._version != version:
                return
            future = loop.create_future()
            self._waiters.append((loop, future))
        await future

    def _has_news(self, cursors: list[tuple[int, int]]) -> bool:
        if self._done:
            return True
        return any(
            len(s.visible_text()) > text_at or len(s.token_ids) > tokens_at
            for s, (text_at, tokens_at) in zip(self._sequences, cursors)
        )

    def _output(self, cursors: list[tuple[int, int]] | None = None) -> RequestOutput:
        """A snapshot; raises the request's error instead if it has one. Caller holds the lock.

        `cursors`, a stream's own (text, tokens) emitted-so-far per sequence, make the `*_diff`
        fields what is new to that stream, and move on."""
        if self._error is not None:
            raise self._error
        outputs = []
        for i, s in enumerate(self._sequences):
            text = s.visible_text()
            text_at, tokens_at = cursors[i] if cursors is not None else (0, 0)
            outputs.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=list(s.token_ids),
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    text_diff=text[text_at:],
                    token_ids_diff=s.token_ids[tokens_at:],
                )
            )
            if cursors is not None:
                cursors[i] = (len(text), len(s.token_ids))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.request.prompt_token_ids.tolist(),
            outputs=outputs,
            finished=self._done,
            kv_handle=self._sequences[0].kv_handle,
            num_cached_tokens=self.num_cached_tokens,
        )


__all__ = ["EngineDeadError", "GenerationResult", "RequestError"]
