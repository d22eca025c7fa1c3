"""Run the real berth operator (kopf, in-process, over HTTP) against a test cluster."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import kopf

from berth.operator.health import AddressResolver, pod_address
from tests.support.cluster import Cluster

# kopf waits this long for its own tasks on stop; it also counts the emulator's request
# handlers (same event loop) as its own and would wait 5 s for them: cancel after this.
STOP_GRACE = 0.5


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.queueing.exit_timeout = 0.1
    settings.queueing.idle_timeout = 0.5
    # The emulator ignores watch timeouts; reconnect now and then like a real server forces.
    settings.watching.server_timeout = 10
    settings.watching.client_timeout = 15
    settings.posting.level = 0  # post every Event, so tests can assert on them
    return settings


@contextlib.asynccontextmanager
async def running_operator(
    cluster: Cluster, resolver: AddressResolver = pod_address, *, clusterwide: bool = False, **memo: Any
) -> AsyncIterator[asyncio.Task[None]]:
    """The operator with the handlers of `berth.operator.handlers`, standalone, the cluster's
    namespace (or, `clusterwide`, every namespace, as `berth operator --all-namespaces`)."""
    import berth.operator.handlers  # noqa: F401  registers the handlers in kopf's default registry

    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            standalone=True,
            clusterwide=clusterwide,
            namespaces=[] if clusterwide else [cluster.namespace],
            settings=operator_settings(),
            stop_flag=stop,
            ready_flag=ready,
            memo=kopf.Memo(kubeconfig=str(cluster.kubeconfig), resolve_launcher_address=resolver, **memo),
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield task
    finally:
        stop.set()
        done, _ = await asyncio.wait({task}, timeout=STOP_GRACE)
        if not done:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class ShiftedClock:
    """Real time plus an offset the test sets: the operator's schedules see the shifted time, and
    its waits are real seconds (the offset is constant between two shifts)."""

    def __init__(self) -> None:
        self.offset = dt.timedelta(0)

    def __call__(self) -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc) + self.offset

    def set(self, when: dt.datetime) -> None:
        self.offset = when - dt.datetime.now(dt.timezone.utc)
