"""The operator's process (`berth operator`): a standby until it holds the Lease, then kopf with
the handlers, for as long as it holds it.

- Standby: it answers the liveness probe (it is healthy, only not leading) and watches nothing.
- Leader: kopf runs; `LeaseElector.hold()` renews the Lease meanwhile. A lost Lease stops
  kopf, and a kopf that has not stopped within `STOP_GRACE` is cut short by exiting the process:
  either way nothing acts after the deadline, before any other replica may lead. The process
  then exits 1 and its pod's restart brings it back as a standby.
- The election runs in a thread of its own (`LeaseThread`: its own event loop and connection),
  not on kopf's loop: a leader busy with a thousand deployments, or blocked for a while, still
  renews on time instead of stepping down under load, and a leader that lost the Lease is
  exited from that thread when its own loop is too busy to stop kopf.
- SIGTERM: kopf stops, the Lease is given up (the standby leads at once), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

import kopf
from aiohttp import web

from berth.operator.kube import Kube
from berth.operator.leadership import STOP_GRACE, LeaseElector, timing_problem

logger = logging.getLogger("berth.operator")


def lease_namespace(args: argparse.Namespace) -> str:
    """Where the replicas' Lease lives: --lease-namespace, else the pod's own namespace (the
    Deployment passes it as $POD_NAMESPACE), else "default" (an operator run from a laptop)."""
    return args.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"


def identity() -> str:
    # The pod's name (its hostname), plus a random suffix: a restarted process is a new candidate.
    return f"{socket.gethostname()}-{secrets.token_hex(4)}"


@contextlib.asynccontextmanager
async def standby_liveness(endpoint: str | None) -> AsyncIterator[None]:
    """The liveness endpoint while standing by (kopf serves it once leading)."""
    if not endpoint:
        yield
        return
    url = urlsplit(endpoint)

    async def alive(_: web.Request) -> web.Response:
        return web.json_response({"standby": True})

    app = web.Application()
    app.router.add_get(url.path or "/", alive)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, url.hostname, url.port).start()
        yield
    finally:
        await runner.cleanup()


async def run(args: argparse.Namespace, memo: dict[str, Any] | None = None) -> int:
    """`berth operator` after its arguments are read. `memo`: more for the handlers' memo."""
    timings = {
        "lease_seconds": args.lease_duration,
        "renew_seconds": args.lease_renew_interval,
        "deadline_seconds": args.lease_renew_deadline,
    }
    given = {key: value for key, value in timings.items() if value is not None}
    problem = timing_problem(**given)
    if problem:
        print(f"berth operator: error: {problem}", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with LeaseThread() as lease:
        kube = await lease.run(Kube.connect(args.kubeconfig))
        elector = LeaseElector(kube, lease_namespace(args), identity(), **given)
        leading = asyncio.Event()
        stopped = threading.Event()  # kopf has stopped after the Lease was lost
        campaign = lease.start(_campaign(elector, lambda: loop.call_soon_threadsafe(leading.set), stopped))
        try:
            async with standby_liveness(args.liveness):
                if not await _first(leading.wait(), stop.wait(), campaign):
                    return 0  # stopped while standing by
            return await _lead(args, elector, lease, campaign, stopped, stop, memo or {})
        finally:
            campaign.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await campaign
            await lease.run(kube.close())


class LeaseThread:
    """An event loop in a thread of its own, for the election's requests and timers. The GIL
    hands it the interpreter every few milliseconds however busy kopf's loop is, so a renewal is
    late by that at most, not by the length of kopf's queue."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lease", daemon=True)

    async def __aenter__(self) -> LeaseThread:
        self._thread.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, 5)
        if not self._thread.is_alive():
            self.loop.close()

    def start(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Future:
        """Runs `coroutine` on this thread's loop from now on, whatever the caller's loop does
        next; cancelling the returned future cancels it."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    async def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """`coroutine`'s result, run on this thread's loop (cancelling the caller cancels it)."""
        return await self.start(coroutine)


async def _first(wanted, *others) -> bool:
    """Runs them all; True when `wanted` finished first (the others are cancelled, unless they
    are futures that the caller keeps, and an error in any that finished is raised)."""
    tasks = [asyncio.ensure_future(wanted), *(asyncio.ensure_future(other) for other in others)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        if task in others:
            continue
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for task in done:
        task.result()
    return tasks[0] in done


async def _lead(
    args: argparse.Namespace,
    elector: LeaseElector,
    lease: LeaseThread,
    campaign: asyncio.Future,
    stopped: threading.Event,
    stop: asyncio.Event,
    memo: dict,
) -> int:
    operator = asyncio.ensure_future(
        kopf.operator(
            standalone=True,  # one actor: the Lease decides who, not kopf's peering
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness or None,
            stop_flag=stop,
            memo=kopf.Memo(kubeconfig=args.kubeconfig, **memo),
        )
    )
    await asyncio.wait({operator, campaign}, return_when=asyncio.FIRST_COMPLETED)
    if campaign.done():
        stop.set()
        try:
            await operator
        except asyncio.CancelledError:
            pass
        finally:
            stopped.set()
        return 1
    campaign.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await campaign
    await lease.run(elector.release())
    operator.result()
    return 0


async def _campaign(elector: LeaseElector, leading: Callable[[], None], stopped: threading.Event) -> None:
    """On the election's loop from start to end: waits for the Lease, says so, and renews it at
    once (not once kopf's loop gets round to asking: a loop blocked right after the Lease was
    taken would otherwise let it lapse). Once it is lost, gives kopf STOP_GRACE to stop before
    the process is ended; that loop cannot be delayed by kopf's load."""
    await elector.acquire()
    leading()
    await elector.hold()
    asyncio.get_running_loop().call_later(STOP_GRACE, _exit_unless, stopped)


def _exit_unless(stopped: threading.Event) -> None:
    if stopped.is_set():
        return
    logger.error("the operator did not stop within %.0f s of losing the lease: exiting", STOP_GRACE)
    logging.shutdown()
    os._exit(1)  # nothing may act past the deadline; the pod restarts as a standby
