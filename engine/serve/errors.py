"""OpenAI-shaped errors: every failure a client can cause or meet is answered with
`{"error": {"message", "type", "param", "code"}}` and the status OpenAI uses, never a bare
500 with a traceback."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from berth.engine.engine_io import RequestError
from berth.engine.executor.errors import EngineDeadError
from berth.engine.serve.protocol import PROMPT_SHAPES, ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# How long a client should wait before retrying a request the engine did not admit.
RETRY_AFTER_SECONDS = 5


def documented(*statuses: int) -> dict[int | str, dict]:
    """The OpenAPI `responses` of a route that can answer with these error statuses."""
    meaning = {
        400: "An invalid parameter (named in `param`), or a prompt too long for the model",
        401: "A missing or wrong bearer token",
        403: "Asked of an attached frontend: the engine's owner alone sleeps and wakes the engine",
        404: "An unknown model",
        409: "The engine is not in the state this transition starts from (another one runs)",
        413: "A request body larger than the server's limit (--max-request-body-bytes)",
        503: "The engine does not admit requests now (asleep, shutting down, or dead); see Retry-After",
        504: "The engine did not finish the transition in time",
    }
    return {status: {"model": ErrorResponse, "description": meaning[status]} for status in statuses}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        )

    def response(self) -> JSONResponse:
        return ErrorJSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


class ErrorJSONResponse(JSONResponse):
    """JSON in ASCII (non-ASCII characters escaped): whatever text an error quotes, encoding it
    can never fail and turn a 4xx into a 500."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its engine requests were aborted."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def from_engine_error(error: BaseException, names: dict[str, str] | None = None) -> APIError:
    """The status for an error the engine raised for one request. `names` maps the engine's
    field names ("prompt", "max_tokens") to this API's ("messages", "max_completion_tokens")."""
    if isinstance(error, EngineDeadError):  # a restarted world will admit again: retry later
        return unavailable(str(error), "engine_dead")
    if isinstance(error, RequestError):
        param = (names or {}).get(error.param, error.param)
        if error.code == "admission_closed":
            return unavailable(str(error), "admission_closed")
        if error.code == "too_long":
            return bad_request(str(error), param, "context_length_exceeded")
        if error.code == "internal":  # the engine failed on this request alone; it goes on
            return APIError(500, str(error), code="internal_error")
        return bad_request(str(error), param)
    if isinstance(error, ValueError):  # the request's shape, refused at the executor boundary
        field = str(error).split(" ", 1)[0]
        return bad_request(str(error), (names or {}).get(field, field))
    raise error


def _validation_error(errors: list[dict]) -> APIError:
    """Pydantic's complaint about a request body, naming the top-level parameter at fault."""
    first = errors[0]
    location = [part for part in first.get("loc", ()) if part != "body"]
    message = str(first.get("msg", "")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return bad_request(f"the request body is not valid JSON{f': {detail}' if detail else ''}")
    if not location:
        if first.get("type") == "missing":
            return bad_request("the request body is empty: a JSON object is expected")
        return bad_request(f"the request body must be a JSON object (sent as application/json): {message}")
    return bad_request(f"{_readable(location)}: {message}", param=str(location[0]))


# How pydantic names the member of a union it tried, in an error's location: not a field.
_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-str", "constrained-int"}


def _readable(location: list) -> str:
    """("messages", 0, "content", "list[TextContentPart]", 0, "text") -> "messages[0].content[0].text"."""
    parts = []
    for position, part in enumerate(location):
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif position == 1 and location[0] == "prompt" and part in PROMPT_SHAPES:
            continue  # which of the prompt's shapes it was read as
        elif not str(part).isidentifier() or part in _UNION_MEMBERS:
            continue
        else:
            parts.append(f".{part}" if parts else str(part))
    return "".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(list(error.errors())).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        code = "request_too_large" if error.status_code == 413 else None
        return APIError(error.status_code, str(error.detail), code=code, headers=error.headers).response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, error: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        # The details go to the log; the client learns that it failed, not how the server is built.
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", code="internal_error").response()
