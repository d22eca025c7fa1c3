"""One HTTP request's engine requests (one per prompt), submitted together and read back as
one stream of updates; and giving up on them when the client goes away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from berth.engine.outputs import RequestOutput
from berth.engine.sampling_params import SamplingParams
from berth.engine.serve.context import ServingContext
from berth.engine.serve.errors import ClientDisconnected, from_engine_error
from berth.engine.serve.protocol import Usage

logger = logging.getLogger(__name__)
T = TypeVar("T")
Update = tuple[int, RequestOutput]  # (prompt index, the request's output so far)


class Generation:
    """Engine requests are always streamed, whatever the client asked for: the server times
    every token for /metrics, and a non-streamed answer is simply the last update."""

    def __init__(
        self,
        ctx: ServingContext,
        prompts: list[list[int]],
        params: list[SamplingParams],
        *,
        names: dict[str, str],
        cache_salt: str | None = None,
        tokenized_with=None,
        disaggregated=None,
        correlation_id: str | None = None,
    ) -> None:
        """`names` maps the engine's field names to this API's, for the errors it raises.
        `tokenized_with`: the tokenizer the prompts were made with (None: the client's ids)."""
        self.prompt_token_ids = prompts
        self._names = names
        self._queue: asyncio.Queue = asyncio.Queue()
        self._results = []
        try:
            for token_ids, sampling_params in zip(prompts, params):
                self._results.append(
                    ctx.llm.generate_async(
                        token_ids,
                        sampling_params,
                        streaming=True,
                        cache_salt=cache_salt,
                        tokenized_with=tokenized_with,
                        disaggregated=disaggregated,
                    )
                )
        except Exception as error:
            self.abort()  # all of the HTTP request's prompts run, or none
            raise from_engine_error(error, names) from error
        for index, result in enumerate(self._results):
            if correlation_id is not None:  # a router's X-Request-Id: the two halves' logs meet here
                logger.info("%s: engine request %d", correlation_id, result.request_id)
            timer = ctx.metrics.track(len(prompts[index]))
            # Drained by their own tasks, so an aborted request is still read to its end (and
            # counted in /metrics) after its HTTP request is gone.
            ctx.keep(asyncio.create_task(self._drain(index, result, timer)), result)
        self._updates = self._merge()
        self._primed: Update | None = None
        # Each prompt's output as last iterated: the usage so far (a stream's continuous usage).
        self._latest: list[RequestOutput | None] = [None] * len(prompts)

    async def _drain(self, index: int, result, timer) -> None:
        try:
            async for output in result:
                timer.update(output, result)
                self._queue.put_nowait((index, output))
        except Exception as error:
            timer.failed(error)
            self._queue.put_nowait((index, error))
        self._queue.put_nowait((index, None))

    async def _merge(self) -> AsyncIterator[Update]:
        running = len(self._results)
        while running:
            index, item = await self._queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                self.abort()
                raise from_engine_error(item, self._names) from item
            else:
                yield index, item

    async def __aiter__(self) -> AsyncIterator[Update]:
        if self._primed is not None:
            primed, self._primed = self._primed, None
            self._latest[primed[0]] = primed[1]
            yield primed
        async for update in self._updates:
            self._latest[update[0]] = update[1]
            yield update

    def usage(self) -> Usage:
        """The usage of what has been iterated so far (all of it, once iterated to the end)."""
        return Usage.of(self.prompt_token_ids, [output for output in self._latest if output is not None])

    async def start(self) -> None:
        """Waits for the first update (kept for iteration). An engine refusal (bad request, too
        long) comes by then at the latest, so a stream can still answer with the right status
        instead of a 200 followed by an error event."""
        self._primed = await anext(self._updates)

    async def final_outputs(self) -> list[RequestOutput]:
        last: list[RequestOutput | None] = [None] * len(self._results)
        async for index, output in self:
            last[index] = output
        return last  # every request ends with a finished output, or `_merge` raised

    def abort(self) -> None:
        """Stops whatever is unfinished (a no-op for finished requests)."""
        for result in self._results:
            result.abort()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`; raises ClientDisconnected (cancelling `work`) if the client leaves first."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise ClientDisconnected()


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
