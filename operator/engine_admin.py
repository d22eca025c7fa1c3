"""Driving a world's engine through its admin routes: sleep (drain or abort) and wakeup
(optionally with another model revision), as the engine's contract defines them
(README.md, "Sleep and wakeup"; engine/serve/admin.py).

Each call answers when the transition is done, which for a drain may be minutes: the health
loop runs them as background tasks (`Transitions`) and keeps polling; it learns the outcome
from the task, or, after an operator restart, from the admission state the engine reports.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from berth.operator.health import Address, admin_headers, base_url, revision_text

# What the HTTP client waits beyond the engine's own bound (the drain timeout, the load).
SLACK_SECONDS = 30.0

Kind = Literal["sleep", "wakeup", "swap"]


@dataclass(frozen=True)
class TransitionOutcome:
    kind: Kind
    ok: bool
    # "done", "conflict" (another transition runs or the engine already is there: not an
    # error), "refused" (400: e.g. a revision that does not fit; the engine stays asleep),
    # "dead" (503: the engine died; the health loop restarts the world), "unreachable".
    result: str
    message: str
    seconds: float
    admission: str | None = None
    model_revision: str | None = None
    num_aborted: int = 0
    engine_seconds: float | None = None  # how long the engine says the transition took


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error") if isinstance(body, Mapping) else None
    if isinstance(error, Mapping) and error.get("message"):
        return str(error["message"])
    return str(body)[:500]


async def _post(
    client: httpx.AsyncClient,
    kind: Kind,
    address: Address,
    path: str,
    token: str | None,
    body: Mapping[str, Any],
    timeout: float,
) -> TransitionOutcome:
    started = time.perf_counter()
    try:
        response = await client.post(
            f"{base_url(address.admin)}{path}", json=dict(body), headers=admin_headers(token), timeout=timeout
        )
    except httpx.HTTPError as exc:
        return TransitionOutcome(
            kind, False, "unreachable", f"{type(exc).__name__}: {exc}", time.perf_counter() - started
        )
    seconds = time.perf_counter() - started
    if response.status_code == 200:
        answer = response.json()
        return TransitionOutcome(
            kind,
            True,
            "done",
            f"{kind} done in {float(answer.get('seconds') or seconds):.3f}s",
            seconds,
            admission=answer.get("admission"),
            model_revision=revision_text(answer.get("model_revision")),
            num_aborted=int(answer.get("num_aborted") or 0),
            engine_seconds=float(answer["seconds"])
            if isinstance(answer.get("seconds"), (int, float))
            else None,
        )
    result = {409: "conflict", 400: "refused", 503: "dead"}.get(response.status_code, "failed")
    message = f"HTTP {response.status_code}: {_error_text(response)}"
    return TransitionOutcome(kind, False, result, message, seconds)


def sleep(
    client: httpx.AsyncClient, address: Address, token: str | None, level: int, drain_timeout: float
) -> Awaitable[TransitionOutcome]:
    """Park the engine: admission closes at once, requests in flight get `drain_timeout` seconds."""
    body = {"level": level, "mode": "drain", "timeout": drain_timeout}
    return _post(client, "sleep", address, "/admin/sleep", token, body, drain_timeout + SLACK_SECONDS)


def wakeup(
    client: httpx.AsyncClient,
    address: Address,
    token: str | None,
    load_timeout: float,
    model: str | None = None,
    revision: str | None = None,
) -> Awaitable[TransitionOutcome]:
    """Wake the engine, with the weights it had or (`model`, named `revision`) the weights at
    that path, read again, in place."""
    body: dict[str, Any] = {"model": model} if model else {}
    if model and revision:
        body["revision"] = revision
    kind: Kind = "swap" if model else "wakeup"
    return _post(client, kind, address, "/admin/wakeup", token, body, load_timeout + SLACK_SECONDS)


class Transitions:
    """The transitions in flight of one LLMDeployment's worlds: at most one per world (the
    engine would refuse a second with 409 anyway). `purpose` says why the operator asked
    ("sleep", "wake", "retire"): the outcome is handled accordingly."""

    def __init__(self, on_end: Callable[[], None] | None = None) -> None:
        self.tasks: dict[int, tuple[Kind, str, asyncio.Task[TransitionOutcome]]] = {}
        # Called when a transition ends, however it ends (the health loop then looks at once,
        # not a poll later).
        self._on_end = on_end

    def busy(self, world: int) -> bool:
        """In flight, or ended but not yet collected by `finished()`. Why: a transition that ends
        mid-round must not free its world for this round's decisions (a retiring world was
        removed while the outcome of its drain, and so its Event, was never recorded)."""
        return world in self.tasks

    def start(self, world: int, kind: Kind, purpose: str, call: Awaitable[TransitionOutcome]) -> None:
        async def run() -> TransitionOutcome:
            try:
                return await call
            finally:
                if self._on_end is not None:
                    self._on_end()

        self.tasks[world] = (kind, purpose, asyncio.ensure_future(run()))

    def finished(self) -> list[tuple[int, str, TransitionOutcome]]:
        """(world, purpose, outcome) of every transition that ended since the last call."""
        done = []
        for world, (kind, purpose, task) in list(self.tasks.items()):
            if not task.done():
                continue
            del self.tasks[world]
            if task.cancelled():
                continue
            error = task.exception()
            if error is not None:  # e.g. a 200 whose body is no JSON: reported, never the loop's end
                done.append((world, purpose, TransitionOutcome(kind, False, "failed", repr(error), 0.0)))
            else:
                done.append((world, purpose, task.result()))
        return done

    def cancel_all(self) -> None:
        for _, _, task in self.tasks.values():
            task.cancel()
        self.tasks.clear()
