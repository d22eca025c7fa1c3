"""Running the app under uvicorn: on a socket bound before the model loads (a taken port
fails at once, and port 0 works), with a graceful shutdown on SIGTERM / SIGINT that drains
the requests in flight."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger("uvicorn.error")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); raises OSError if it cannot.

    Its protocol is named (IPPROTO_TCP), not left 0: asyncio sets TCP_NODELAY only on sockets
    that say they are TCP, and without it Nagle's algorithm meets the client's delayed ACK and
    adds ~40 ms to every response on a kept-alive connection (what every OpenAI client uses).
    TCP_NODELAY is set on the listener too, which accepted connections inherit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# After the drain, how long uvicorn waits for responses still being written before it cancels them.
WRITE_OUT_SECONDS = 2.0


class GracefulServer(uvicorn.Server):
    """uvicorn with a drain phase. The first SIGTERM / SIGINT stops admission (`on_signal`: new
    requests get 503 + Retry-After, readiness drops) but the server keeps listening while the
    requests in flight finish, so a client or load balancer that has not noticed yet gets a clear
    answer instead of a refused connection. Once nothing is in flight (`is_idle`), or after
    `drain_timeout` seconds (`on_timeout` then aborts what is left: those answers end with
    finish_reason "abort"), uvicorn's own shutdown closes the listener and the connections.
    A second signal skips the rest of the drain; a third SIGINT forces uvicorn out."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        on_signal: Callable[[], None],
        is_idle: Callable[[], bool],
        on_timeout: Callable[[], None],
        drain_timeout: float,
        stop_when: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(config)
        self._stop_when = stop_when
        self._on_signal = on_signal
        self._is_idle = is_idle
        self._on_timeout = on_timeout
        self._drain_timeout = drain_timeout
        self._drain_deadline: float | None = None
        self._aborted = False
        self._announced = False

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler: it only flips state; on_tick, on the event loop, does the rest.
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self._drain_timeout
            self._on_signal()
            return
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after its shutdown, which would end the process with
        # "killed by SIGTERM". A graceful stop is a success: the caller exits 0 instead.
        self._captured_signals.clear()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self._stop_when is not None and self._stop_when():
            return True  # nothing left to drain: the engine is gone
        if self._drain_deadline is None:
            return False
        if not self._announced:
            self._announced = True
            logger.info(
                "Draining: admission stopped, waiting up to %.0f s for requests in flight",
                self._drain_timeout,
            )
        if self._is_idle():
            return True
        if time.monotonic() >= self._drain_deadline and not self._aborted:
            self._aborted = True
            logger.warning("Drain timeout: aborting the requests still in flight")
            self._on_timeout()  # the aborted requests answer within a step or two
            self._drain_deadline += WRITE_OUT_SECONDS
            return False
        return self._aborted and time.monotonic() >= self._drain_deadline


def serve(
    app: FastAPI,
    sock: socket.socket,
    *,
    admin_sock: socket.socket | None = None,
    on_signal: Callable[[], None],
    on_started: Callable[[], None],
    is_idle: Callable[[], bool],
    on_timeout: Callable[[], None],
    shutdown_timeout: float,
    log_level: str = "info",
    access_log: bool = False,
    stop_when: Callable[[], bool] | None = None,
) -> None:
    """Serves until SIGTERM / SIGINT (returns once in-flight requests finished or were aborted),
    or until `stop_when()` says so (checked every tick, a tenth of a second)."""
    config = uvicorn.Config(
        app,
        lifespan="off",  # the engine's lifetime is the caller's, around this call
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=WRITE_OUT_SECONDS,
        timeout_keep_alive=30,
    )
    server = GracefulServer(
        config,
        on_signal=on_signal,
        is_idle=is_idle,
        on_timeout=on_timeout,
        drain_timeout=shutdown_timeout,
        stop_when=stop_when,
    )

    async def main() -> None:
        sockets = [sock] if admin_sock is None else [sock, admin_sock]
        serving = asyncio.create_task(server.serve(sockets=sockets))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            on_started()
        await serving

    asyncio.run(main())


def quiet_metrics() -> None:
    import prometheus_client

    # No `*_created` timestamp series next to every counter and histogram (as vLLM does): this
    # process serves one model, and the series only double the exposition.
    prometheus_client.disable_created_metrics()


def serve_app(
    args: argparse.Namespace,
    ctx,
    sock,
    url: str,
    command: str = "berth serve",
    stop_when=None,
    on_started=None,
    admin_sock: socket.socket | None = None,
) -> None:
    """Serves `ctx` on `sock` (and its admin routes on `admin_sock` when given) until SIGTERM
    (a drain, see `ServingContext.start_draining`) or `stop_when()`; the options come from
    `berth serve`'s arguments."""
    from berth.engine.serve import build_app  # the routes import this module's neighbours

    admin_port = admin_sock.getsockname()[1] if admin_sock is not None else None
    if admin_sock is not None:
        print(f"{command}: admin routes on {url_of(admin_sock)}/admin", flush=True)
    serve(
        build_app(ctx, admin_port),
        sock,
        admin_sock=admin_sock,
        on_signal=ctx.start_draining,
        on_started=on_started or (lambda: print(f"{command}: listening on {url}", flush=True)),
        is_idle=lambda: ctx.idle,
        on_timeout=ctx.abort_all,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        access_log=args.access_log,
        stop_when=stop_when,
    )
