"""Bearer-token checks: the API key for `/v1` (and `/tokenize`, `/detokenize`), the admin
token for `/admin`.

They run before anything else reads the request, its body included: a client without the
key learns nothing about what it sent, not even that it was malformed. Either check is off
when its token is not configured. Tokens are compared in constant time.
"""

from __future__ import annotations

import secrets

from fastapi import Security
from fastapi.security import HTTPBearer
from starlette.types import ASGIApp, Receive, Scope, Send

from berth.engine.serve.errors import APIError

# The routes behind the API key: the OpenAI API, and the tokenizer's (the model's, as much).
API_KEY_PREFIXES = ("/v1", "/tokenize", "/detokenize")
# Enforced by `Authentication` below; the routes name it so the OpenAPI document shows it.
bearer = HTTPBearer(auto_error=False, description="the server's --api-key (or admin token for /admin)")
BEARER = [Security(bearer)]


class Authentication:
    """ASGI middleware: a 401 for a request under `API_KEY_PREFIXES` or /admin without the right
    bearer token."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, admin_token: str | None) -> None:
        self.app = app
        self._api_key = api_key
        self._admin_token = admin_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        path = scope["path"]
        if any(_under(path, prefix) for prefix in API_KEY_PREFIXES):
            expected, error = (
                self._api_key,
                APIError(401, "Incorrect API key provided.", code="invalid_api_key"),
            )
        elif _under(path, "/admin"):
            expected, error = (
                self._admin_token,
                APIError(401, "Incorrect admin token.", code="invalid_admin_token"),
            )
        else:
            return None
        return error if expected and not _matches(_bearer_token(scope), expected) else None


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def _bearer_token(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def _matches(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode(), expected.encode())
