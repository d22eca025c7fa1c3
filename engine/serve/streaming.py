"""Server-sent events in OpenAI's format: one `data: {json}` event per chunk, `data: [DONE]` last."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel

from berth.engine.serve.errors import APIError
from berth.engine.serve.generation import Generation

DONE = format_sse_event(data_str="[DONE]")


def sse_response(chunks: AsyncIterator[BaseModel], generation: Generation) -> EventSourceResponse:
    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield format_sse_event(data_str=chunk.model_dump_json())
        except APIError as error:
            # The 200 is already sent: the error travels in the stream, the way OpenAI's does.
            yield format_sse_event(data_str=error.body().model_dump_json())
        finally:
            # A client that disconnects mid-stream lands here (the stream task is cancelled):
            # its engine requests stop now instead of generating for nobody.
            generation.abort()
        yield DONE

    return EventSourceResponse(events(), headers={"Cache-Control": "no-cache"})
