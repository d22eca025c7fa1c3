"""Bearer-token checks: the API key for `/v1`, the admin token for `/admin`.

Either is off when not configured. Tokens are compared in constant time.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from berth.engine.serve.context import serving
from berth.engine.serve.errors import APIError

_bearer = HTTPBearer(auto_error=False, description="the server's --api-key (or admin token for /admin)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _matches(credentials: HTTPAuthorizationCredentials | None, expected: str) -> bool:
    given = credentials.credentials if credentials is not None else ""
    return secrets.compare_digest(given.encode(), expected.encode())


def require_api_key(request: Request, credentials: Credentials) -> None:
    expected = serving(request).api_key
    if expected and not _matches(credentials, expected):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def require_admin_token(request: Request, credentials: Credentials) -> None:
    expected = serving(request).admin_token
    if expected and not _matches(credentials, expected):
        raise APIError(401, "Incorrect admin token.", code="invalid_admin_token")
