"""`GenerationResult`: the client's handle on one submitted request.

It is filled by the executor's dispatch thread and read by the client from sync code
(`result()`, `for out in result`) or async code (`await result`, `async for out in result`).
Detokenization and stop-string matching happen here, on the client side of the boundary,
so the engine loop never spends time on text.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from berth.engine.executor.errors import EngineDeadError, RequestError
from berth.engine.executor.request import GenerationRequest
from berth.engine.executor.response import Response
from berth.engine.outputs import CompletionOutput, Logprob, RequestOutput
from berth.engine.sampling_params import SamplingParams
from berth.engine.tokenizer import IncrementalDetokenizer


class _Sequence:
    """One of the request's `n` output sequences, as the client sees it."""

    def __init__(self, index: int, params: SamplingParams, tokenizer, incremental: bool) -> None:
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
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.longest_stop = max((len(s) for s in params.stop_strings), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, response: Response) -> bool:
        """Applies one engine response; returns True when a stop string ended the sequence here
        (the engine does not know yet and must be told to stop it)."""
        self.token_ids += response.token_ids
        if self.logprobs is not None and response.logprobs:
            for token_id, (logprob, rank, top) in zip(response.token_ids, response.logprobs):
                entry = {tid: Logprob(lp, r + 1, self._decode_one(tid)) for r, (tid, lp) in enumerate(top)}
                entry.setdefault(token_id, Logprob(logprob, rank, self._decode_one(token_id)))
                self.logprobs.append(entry)
                self.cumulative_logprob += logprob
        if self.detokenizer is not None:
            checked = len(self.text)
            self.text += "".join(self.detokenizer.step(t) for t in response.token_ids)
            if self.params.stop_strings and self._match_stop_string(checked):
                return True
        if response.finish_reason is not None:
            self.finish_reason, self.stop_reason = response.finish_reason, response.stop_reason
            if self.tokenizer is not None:
                self._decode_all()
        return False

    def _decode_all(self) -> None:
        """The final text: a full decode, as a non-streamed result has. A streamed one only
        takes what it adds at the end: the incremental detokenizer holds back a trailing
        incomplete UTF-8 character for good (a full decode shows it as U+FFFD), and text
        already streamed is never rewritten."""
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.params.skip_special_tokens)
        streamed_prefix_kept = len(full) > len(self.text) and full.startswith(self.text)
        if self.detokenizer is None or streamed_prefix_kept:
            self.text = full

    def _match_stop_string(self, checked: int) -> bool:
        # Only a match that ends in the new text is new: start just far enough back.
        start = max(0, checked - self.longest_stop + 1)
        found = [(pos, s) for s in self.params.stop_strings if (pos := self.text.find(s, start)) >= 0]
        if not found:
            return False
        pos, stop = min(found)
        self.text = self.text[: pos + (len(stop) if self.params.include_stop_str_in_output else 0)]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def visible_text(self) -> str:
        """While streaming, hold back a tail that might still become a stop string."""
        if self.finished or self.longest_stop <= 1:
            return self.text
        return self.text[: max(0, len(self.text) - self.longest_stop + 1)]

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])


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
        incremental = request.streaming or bool(params.stop_strings)
        self._sequences = [_Sequence(i, params, tokenizer, incremental) for i in range(params.n)]
        self._lock = threading.Lock()
        self._updated = threading.Condition(self._lock)
        self._version = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        # Emitted-so-far cursors for streamed diffs, one (text, tokens) pair per sequence.
        self._cursors = [(0, 0)] * params.n
        self.queue_seconds: float | None = None

    @property
    def client_id(self) -> int:
        return self.request.client_id

    request_id = client_id

    @property
    def finished(self) -> bool:
        return self._done

    # ---- called by the executor's dispatch thread -------------------------------------------

    def _handle(self, responses: list[Response]) -> list[int]:
        """Applies one step's responses; returns the sequences a stop string ended client-side."""
        stopped: list[int] = []
        with self._lock:
            if self._done:
                return stopped  # late responses after a stop string or an error: dropped
            for response in responses:
                if response.queue_seconds is not None and self.queue_seconds is None:
                    self.queue_seconds = response.queue_seconds
                if response.error is not None:
                    self._finish(RequestError(response.error, response.error_code or "invalid_request"))
                    return stopped
                sequence = self._sequences[response.seq_index]
                if not sequence.finished and sequence.add(response):
                    stopped.append(sequence.index)
            if all(s.finished for s in self._sequences):
                self._finish(None)
            else:
                self._version += 1
                self._updated.notify_all()
        return stopped

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if not self._done:
                self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done = True
        self._version += 1
        self._updated.notify_all()

    def _take_waiter(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Future] | None:
        with self._lock:
            waiter, self._waiter = self._waiter, None
        return waiter

    # ---- the client's side ------------------------------------------------------------------

    def abort(self) -> None:
        """Asks the engine to stop this request; its unfinished sequences end with "abort"."""
        if self._abort is not None and not self._done:
            self._abort(self.client_id, None)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Blocks until the request is finished; raises its error (the same one every time)."""
        with self._lock:
            if not self._updated.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.client_id} not finished after {timeout} s")
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
        """Streams updates: each carries the cumulative output and what is new (`*_diff`)."""
        while True:
            with self._lock:
                version = self._version
                yield_now = self._has_news()
                output = self._output(stream=True) if yield_now else None
                done = self._done
            if output is not None:
                yield output
            if done:
                return
            with self._lock:
                self._updated.wait_for(lambda v=version: self._version != v)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            with self._lock:
                version = self._version
                output = self._output(stream=True) if self._has_news() else None
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
            self._waiter = (loop, future)
        await future

    def _has_news(self) -> bool:
        if self._done:
            return True
        return any(
            len(s.visible_text()) > text_at or len(s.token_ids) > tokens_at
            for s, (text_at, tokens_at) in zip(self._sequences, self._cursors)
        )

    def _output(self, stream: bool = False) -> RequestOutput:
        """A snapshot; raises the request's error instead if it has one. Caller holds the lock."""
        if self._error is not None:
            raise self._error
        outputs = []
        for i, s in enumerate(self._sequences):
            text = s.visible_text()
            text_at, tokens_at = self._cursors[i] if stream else (0, 0)
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
            if stream:
                self._cursors[i] = (len(text), len(s.token_ids))
        return RequestOutput(
            request_id=self.client_id,
            prompt=self.prompt,
            prompt_token_ids=self.request.prompt_token_ids.tolist(),
            outputs=outputs,
            finished=self._done,
        )


__all__ = ["EngineDeadError", "GenerationResult", "RequestError"]
