"""OpenAI-shaped errors: every failure a client can cause or meet is answered with
`{"error": {"message", "type", "param", "code"}}` and the status OpenAI uses, never a bare
500 with a traceback."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from berth.engine.executor.errors import EngineDeadError, RequestError
from berth.engine.serve.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# How long a client should wait before retrying a request the engine did not admit.
RETRY_AFTER_SECONDS = 5


def documented(*statuses: int) -> dict[int | str, dict]:
    """The OpenAPI `responses` of a route that can answer with these error statuses."""
    meaning = {
        400: "An invalid parameter (named in `param`), or a prompt too long for the model",
        401: "A missing or wrong bearer token",
        404: "An unknown model",
        503: "The engine does not admit requests now (shutting down, or dead); see Retry-After",
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
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its engine requests were aborted."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def from_engine_error(error: BaseException, param: str | None = None) -> APIError:
    """The status for an error the engine raised for one request."""
    if isinstance(error, EngineDeadError):  # a restarted world will admit again: retry later
        return unavailable(str(error), "engine_dead")
    if isinstance(error, RequestError):
        if error.code == "admission_closed":
            return unavailable(str(error), "admission_closed")
        if error.code == "too_long":
            return bad_request(str(error), param, "context_length_exceeded")
        return bad_request(str(error), param)
    if isinstance(error, ValueError):  # the request's shape, refused at the executor boundary
        return bad_request(str(error), param)
    raise error


def _validation_error(errors: list[dict]) -> APIError:
    """Pydantic's complaint about a request body, naming the top-level parameter at fault."""
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid" or not location:
        return bad_request(f"the request body is not valid JSON for this endpoint: {first.get('msg')}")
    where = ".".join(location)
    return bad_request(f"{where}: {first.get('msg')}", param=location[0])


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(list(error.errors())).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail), headers=error.headers).response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, error: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(error).__name__}: {error}").response()
