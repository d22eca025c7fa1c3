"""A client that sends requests one after another to whichever world is ready, as a Service
does, and tallies what it got: what tests of moving worlds (drains, lost nodes) assert on."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

# (world index, base URL of its launcher without /v1) of every world that may be serving now.
Candidates = Callable[[], list[tuple[int, str]]]


@contextlib.asynccontextmanager
async def steady_client(candidates: Candidates, model: str) -> AsyncIterator[dict[str, Any]]:
    """Requests one after another to a world whose /ready is 200 (what the Service routes to),
    in turn. A 503 with Retry-After (admission closed between the check and the request) is
    retried elsewhere; any other answer that is not complete fails.

    The tally: `ok` (time.monotonic(), world) of each complete answer, `refused` (503s),
    `failed` (what went wrong), `nothing_ready` (times no world was ready)."""
    tally: dict[str, Any] = {"ok": [], "refused": 0, "failed": [], "nothing_ready": []}

    async def loop() -> None:
        async with httpx.AsyncClient() as client:
            turn = 0
            while True:
                turn += 1
                ready = []
                for index, url in candidates():
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(f"{url}/ready", timeout=2)).status_code == 200:
                            ready.append((index, url))
                if not ready:
                    tally["nothing_ready"].append(time.monotonic())
                    await asyncio.sleep(0.05)
                    continue
                index, url = ready[turn % len(ready)]
                body = {"model": model, "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
                try:
                    response = await client.post(f"{url}/v1/completions", json=body, timeout=30)
                except httpx.HTTPError as error:
                    tally["failed"].append(f"world {index}: {type(error).__name__}")
                    continue
                if response.status_code == 503 and "retry-after" in response.headers:
                    tally["refused"] += 1
                elif (
                    response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
                ):
                    tally["ok"].append((time.monotonic(), index))
                else:
                    tally["failed"].append(
                        f"world {index}: HTTP {response.status_code} {response.text[:200]}"
                    )

    task = asyncio.create_task(loop())
    try:
        yield tally
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
