"""`--admin-port`: the admin routes on a listener of their own.

The public port carries the OpenAI API and the probes, and is what a Kubernetes Service
exposes; the admin routes (sleep, wakeup, the engine's state) must not be reachable through it.
With an admin port, one app serves both sockets and this middleware tells them apart by the
port a connection arrived on: `/admin` only on the admin socket, everything else only on the
public one (each refuses the other's paths with a 404, as for a route that does not exist).
"""

from __future__ import annotations

import argparse
import socket

from starlette.types import ASGIApp, Receive, Scope, Send

from berth.engine.serve.errors import APIError

ADMIN_PREFIX = "/admin"


def bind_admin(args: argparse.Namespace) -> socket.socket | None:
    """The admin listener on --host:--admin-port, or None without --admin-port (the admin
    routes then answer on the public port, as on one machine)."""
    from berth.engine.serve.server import bind

    return bind(args.host, args.admin_port) if args.admin_port is not None else None


def is_admin_path(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


class AdminListener:
    """ASGI middleware: `/admin` answers only on connections to `admin_port`, every other path
    only on the other listener."""

    def __init__(self, app: ASGIApp, *, admin_port: int) -> None:
        self.app = app
        self.admin_port = admin_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            server = scope.get("server") or (None, None)
            on_admin_port = server[1] == self.admin_port
            if on_admin_port != is_admin_path(scope["path"]):
                error = APIError(404, f"{scope['path']} is not served on this port", code="not_found")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
