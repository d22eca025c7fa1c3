"""Every change the API server streams to a watcher of some resources, kept in the server's order:
what a test asserts a sequence of events on (this happened, then that), with no wall-clock bound.

    async with watching(cluster, "/api/v1/nodes", "/api/v1/namespaces/default/pods") as log:
        ...
    lost = log.first(lambda c: c.resource == "nodes" and ...)

The emulator stamps every create and update with the next value of one counter, whatever the
kind (as etcd's revision is for a real API server): a change's `resource_version` orders it
among all the writes of every watched resource. A deletion keeps the object's last version, so
`seq` (the order of arrival, exact within one watch) orders it among its own kind's changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.support.cluster import Cluster, wait_for


@dataclass(frozen=True)
class Change:
    seq: int  # the order of arrival
    at: float  # time.monotonic() at arrival (for reports, never for the order)
    resource: str  # the plural: "pods", "nodes", "llmdeployments"
    type: str  # ADDED, MODIFIED, DELETED
    object: dict[str, Any]

    @property
    def resource_version(self) -> int:
        return int(self.object["metadata"]["resourceVersion"])

    @property
    def name(self) -> str:
        return self.object["metadata"]["name"]

    @property
    def uid(self) -> str:
        return self.object["metadata"].get("uid", "")


@dataclass
class WatchLog:
    changes: list[Change] = field(default_factory=list)
    streaming: set[str] = field(default_factory=set)  # the resources whose watch has begun

    def first(self, matches: Callable[[Change], Any], after: Change | None = None) -> Change | None:
        """The first change that `matches`, of those that arrived after `after` (if given)."""
        start = after.seq + 1 if after is not None else 0
        return next((change for change in self.changes[start:] if matches(change)), None)

    async def wait_first(
        self, matches: Callable[[Change], Any], timeout: float, what: str, after: Change | None = None
    ) -> Change:
        return await wait_for(lambda: self.first(matches, after), timeout, what)


@contextlib.asynccontextmanager
async def watching(cluster: Cluster, *paths: str) -> AsyncIterator[WatchLog]:
    """Watches each collection path (`/api/v1/nodes`, `/apis/GROUP/VERSION/namespaces/NS/PLURAL`)
    for as long as the block runs; yields once every watch has begun."""
    log = WatchLog()

    async def watch(session: aiohttp.ClientSession, path: str) -> None:
        resource = path.rstrip("/").rsplit("/", 1)[-1]
        async with session.get(cluster.server + path, params={"watch": "true"}) as response:
            assert response.status == 200, f"watch {path}: HTTP {response.status}"
            log.streaming.add(resource)
            pending = b""  # one JSON document a line; a line may be longer than a read
            async for chunk in response.content.iter_any():
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        event = json.loads(line)
                        change = Change(
                            len(log.changes), time.monotonic(), resource, event["type"], event["object"]
                        )
                        log.changes.append(change)

    # A watch streams for as long as it is read: no total timeout, unlike the cluster's session.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.create_task(watch(session, path)) for path in paths]
        try:
            await wait_for(
                lambda: len(log.streaming) == len(paths) or any(t.done() for t in tasks), 10, "watches"
            )
            for task in tasks:
                if task.done():
                    task.result()  # its failure, raised here
            yield log
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
