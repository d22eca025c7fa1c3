"""A bound on the size of a request body, so one request cannot make the server read (and then
tokenize) an unbounded amount of text: a body over the limit gets a 413 before it is parsed."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from berth.engine.serve.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20  # ~1M tokens of text: more than any context served


def _message(max_bytes: int) -> str:
    return (
        f"the request body is larger than this server's limit of {max_bytes} bytes "
        "(berth serve --max-request-body-bytes)"
    )


class BodyLimit:
    """ASGI middleware: refuses a body declared (Content-Length) or found, as it arrives, to be
    longer than `max_bytes`."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            refusal = APIError(413, _message(self.max_bytes), code="request_too_large")
            await refusal.response()(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the app's reading of the body: its HTTP error handler answers.
                    raise HTTPException(413, _message(self.max_bytes))
            return message

        await self.app(scope, counted, send)
