"""What the operator sends to launcher pods, recorded: an HTTP proxy on 127.0.0.1 per pod, in front
of the pod's real `berth serve` (the fleet's) or of nothing (a pod no engine runs in, e.g. one a
user created), keeping every request's path and Authorization header. The operator's address
resolver hands out the proxies' addresses, so every poll and admin call passes through one."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

Address = tuple[str, int]


@dataclass
class Recorded:
    pod: str
    method: str
    path: str
    authorization: str | None
    uid: str = ""  # the pod's uid: a restarted launcher keeps its name, not its uid


@dataclass
class RecordingResolver:
    # pod -> its engine (host, port[, admin port]), if one runs
    upstream: Callable[[Mapping[str, Any]], tuple | None]
    requests: list[Recorded] = field(default_factory=list)
    _proxies: dict[str, tuple[web.AppRunner, Address]] = field(default_factory=dict)  # pod uid -> proxy
    _session: aiohttp.ClientSession | None = None

    def authorizations(self, pod: str | None = None) -> set[str | None]:
        return {r.authorization for r in self.requests if pod is None or r.pod == pod}

    async def __call__(self, pod: Mapping[str, Any]) -> Address | None:
        if not (pod.get("status") or {}).get("podIP"):
            return None
        uid = pod["metadata"]["uid"]
        if uid not in self._proxies:
            self._proxies[uid] = await self._start(pod)
        return self._proxies[uid][1]

    async def _start(self, pod: Mapping[str, Any]) -> tuple[web.AppRunner, Address]:
        name = pod["metadata"]["name"]

        async def forward(request: web.Request) -> web.StreamResponse:
            self.requests.append(
                Recorded(
                    name,
                    request.method,
                    request.path,
                    request.headers.get("Authorization"),
                    pod["metadata"]["uid"],
                )
            )
            target = self.upstream(pod)
            if target is None:
                return web.json_response({"error": "no engine runs in this pod"}, status=503)
            assert self._session is not None
            headers = {key: value for key, value in request.headers.items() if key.lower() != "host"}
            # One proxy port in front of both of the engine's: /admin goes to its admin port.
            port = target[1]
            if request.path.startswith("/admin") and len(target) > 2 and target[2]:
                port = target[2]
            try:
                async with self._session.request(
                    request.method,
                    f"http://{target[0]}:{port}{request.path_qs}",
                    data=await request.read(),
                    headers=headers,
                ) as answer:
                    return web.Response(
                        status=answer.status, body=await answer.read(), content_type=answer.content_type
                    )
            except aiohttp.ClientError as error:  # the engine stopped (its pod is going)
                return web.json_response({"error": str(error)}, status=502)

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        return runner, ("127.0.0.1", port)

    async def close(self) -> None:
        for runner, _ in self._proxies.values():
            await runner.cleanup()
        self._proxies.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None


@contextlib.asynccontextmanager
async def recording(
    upstream: Callable[[Mapping[str, Any]], Address | None],
) -> AsyncIterator[RecordingResolver]:
    resolver = RecordingResolver(upstream)
    try:
        yield resolver
    finally:
        await resolver.close()
