"""Server-sent events in OpenAI's format: one `data: {json}` event per chunk, `data: [DONE]` last."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel

from berth.engine.serve.errors import APIError
from berth.engine.serve.generation import Generation
from berth.engine.serve.protocol import StreamOptions

DONE = format_sse_event(data_str="[DONE]")
# Characters JSON leaves raw that many line readers (Python's str.splitlines, httpx's iter_lines)
# take for line breaks, cutting an event in two; the rest below U+0020 JSON escapes already.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _one_line(json_text: str) -> str:
    """`json_text` with every character a line reader could split on escaped (the same JSON)."""
    return json_text.translate(_LINE_BREAKING)


def sse_response(
    chunks: AsyncIterator[BaseModel], generation: Generation, stream_options: StreamOptions | None = None
) -> EventSourceResponse:
    """With `include_usage` and `continuous_usage_stats` (vLLM's), every chunk carries the
    request's usage so far, not only the last one."""
    continuous = stream_options is not None and stream_options.include_usage
    continuous = continuous and stream_options.continuous_usage_stats

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                if continuous and chunk.usage is None:
                    chunk = chunk.model_copy(update={"usage": generation.usage()})
                yield format_sse_event(data_str=_one_line(chunk.model_dump_json()))
        except APIError as error:
            # The 200 is already sent: the error travels in the stream, the way OpenAI's does.
            yield format_sse_event(data_str=_one_line(error.body().model_dump_json()))
        finally:
            # A client that disconnects mid-stream lands here (the stream task is cancelled):
            # its engine requests stop now instead of generating for nobody.
            generation.abort()
        yield DONE

    return EventSourceResponse(events(), headers={"Cache-Control": "no-cache"})


def named_sse_response(events: AsyncIterator[tuple[str, str]], generation: Generation) -> EventSourceResponse:
    """Named events, an `event:` line before each `data:` (OpenAI's Responses streams), and no
    `data: [DONE]`: `events` yields (name, JSON text) and sends its errors as events of its own
    (their shape is its API's)."""

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for name, data in events:
                yield format_sse_event(event=name, data_str=_one_line(data))
        finally:
            generation.abort()  # as above: a client gone mid-stream stops its engine request

    return EventSourceResponse(stream(), headers={"Cache-Control": "no-cache"})
