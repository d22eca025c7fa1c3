"""The operator's end of the activator (engine/serve/activator.py): a long poll that tells the
activator which worlds serve and learns, the moment it happens, that a request is held.

One `DemandWatcher` per deployment that scales to zero, run by its supervisor. Each
`POST /admin/backends` carries the serving worlds (and, when the wake the held requests wait
for failed, why) and comes back when the activator holds a request the operator has not been
told of, or after `LONG_POLL` seconds. A change of the serving worlds cuts the poll short, so
held requests are released as soon as the supervisor sees a world ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx

from berth.operator.health import Address, admin_headers, base_url

# Seconds the activator keeps a poll open without news; each poll also restores a world the
# activator set aside after one refused request.
LONG_POLL = 10.0
RETRY = 1.0  # seconds between attempts while the activator does not answer


class DemandWatcher:
    def __init__(
        self,
        http: httpx.AsyncClient,
        on_demand: Callable[[], None],
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> None:
        self.http = http
        self.on_demand = on_demand
        self.logger = logger
        self.held = 0  # requests the activator holds, as of its last answer
        self._target: tuple[Address | None, tuple[str, ...], str | None, str | None] = (None, (), None, None)
        self._seen = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def update(
        self, address: Address | None, backends: list[str], failure: str | None, token: str | None
    ) -> None:
        """The activator's admin address, the serving worlds' base URLs, why a wake failed."""
        target = (address, tuple(backends), failure, token)
        if target != self._target:
            self._target = target
            self._changed.set()
        if self._task is None and address is not None:
            self._task = asyncio.create_task(self._run())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            self._changed.clear()
            address, backends, failure, token = self._target
            if address is None:
                await self._changed.wait()
                continue
            body = {"backends": list(backends), "failure": failure, "seen": self._seen, "wait": LONG_POLL}
            poll = asyncio.ensure_future(
                self.http.post(
                    f"{base_url(address)}/admin/backends",
                    json=body,
                    headers=admin_headers(token),
                    timeout=LONG_POLL + 10,
                )
            )
            # Whatever becomes of it (cut short, or the activator gone), its outcome is read.
            poll.add_done_callback(lambda done: done.cancelled() or done.exception())
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({poll, changed}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                poll.cancel()  # the supervisor stops
                raise
            finally:
                changed.cancel()
            if not poll.done():
                poll.cancel()  # the worlds changed: tell the activator now
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await poll
                continue
            try:
                answer = poll.result().json() if poll.result().status_code == 200 else None
            except (httpx.HTTPError, ValueError) as exc:
                self.logger.debug(f"activator at {address} did not answer: {exc}")
                answer = None
            if answer is None:
                await asyncio.sleep(RETRY)
                continue
            self.held = int(answer.get("held") or 0)
            total = int(answer.get("heldTotal") or 0)
            if total > self._seen or total < self._seen:  # new demand, or a restarted activator
                self._seen = total
                if self.held:
                    self.on_demand()
