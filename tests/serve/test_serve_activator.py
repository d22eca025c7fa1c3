"""`berth activator` (engine/serve/activator.py): requests held while no world serves, released
in arrival order to the worlds the operator names, a clear 503 when the wake times out or fails,
and the operator's long poll answered the moment a request is held."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from berth.engine.serve.activator import Activator
from berth.engine.serve.errors import APIError
from tests.serve.server_process import API_KEY, MODEL_NAME, ServerProcess
from tests.support.engine_endpoint import free_ports
from tests.support.engine_processes import wait_until

TOKEN = "activator-admin"


async def test_held_requests_get_their_world_in_arrival_order() -> None:
    activator = Activator(wake_timeout=30)
    order: list[int] = []

    async def request(number: int) -> None:
        backend, reached = await activator.backend()
        order.append(number)
        assert backend == "http://world-0"
        reached.set()  # it reached its world: the next one may go

    held = []
    for number in range(5):
        held.append(asyncio.ensure_future(request(number)))
        await asyncio.sleep(0)  # each arrives after the one before
    await asyncio.sleep(0.05)
    assert order == [] and len(activator.waiting) == 5 and activator.held_total == 5
    activator.set_backends(["http://world-0"], None)
    await asyncio.wait_for(asyncio.gather(*held), 10)
    assert order == [0, 1, 2, 3, 4]
    # With a world serving and nothing held, a request goes straight through.
    assert (await activator.backend())[0] == "http://world-0" and activator.held_total == 5


async def test_a_wake_that_times_out_or_fails_answers_every_held_request() -> None:
    activator = Activator(wake_timeout=0.2)
    with pytest.raises(APIError) as timed_out:
        await activator.backend()
    assert timed_out.value.status == 503 and timed_out.value.code == "wake_timeout"
    assert timed_out.value.headers["Retry-After"]
    assert not activator.waiting

    activator.wake_timeout = 30
    held = [asyncio.ensure_future(activator.backend()) for _ in range(3)]
    await asyncio.sleep(0.05)
    activator.set_backends([], "world 0: wakeup failed: HTTP 503: engine dead")
    for outcome in await asyncio.gather(*held, return_exceptions=True):
        assert isinstance(outcome, APIError) and outcome.code == "wake_failed"
        assert "world 0: wakeup failed" in outcome.message
    with pytest.raises(APIError, match="wakeup failed"):  # until the operator says otherwise
        await activator.backend()


async def test_the_operators_long_poll_returns_as_soon_as_a_request_is_held() -> None:
    activator = Activator(wake_timeout=30)
    poll = asyncio.ensure_future(activator.wait_for_demand(seen=0, wait=60))
    await asyncio.sleep(0.05)
    assert not poll.done()
    held = asyncio.ensure_future(activator.backend())
    await asyncio.wait_for(poll, 5)  # long before its 60 s
    await activator.wait_for_demand(seen=0, wait=60)  # a demand it has not seen: at once
    activator.set_backends(["http://world-0"], None)
    await asyncio.wait_for(held, 5)


def test_the_activator_process_holds_then_forwards_streams_and_guards_its_admin_port(
    server: ServerProcess,
) -> None:
    port, admin_port = free_ports(2)
    env = {**os.environ, "BERTH_ADMIN_TOKEN": TOKEN}
    command = [
        sys.executable,
        "-m",
        "berth",
        "activator",
        "--port",
        str(port),
        "--admin-port",
        str(admin_port),
    ]
    process = subprocess.Popen(
        [*command, "--wake-timeout", "60"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    public, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    try:
        assert wait_until(lambda: _answers(f"{public}/ready"), 30, interval=0.1), (
            "the activator never listened"
        )
        headers = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.post(f"{admin}/admin/backends", json={"wait": 0}).status_code == 401
        assert httpx.post(f"{public}/admin/backends", json={"wait": 0}, headers=headers).status_code == 404

        request = {"model": MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}
        direct = server.post("/v1/completions", request).json()["choices"][0]["text"]
        with httpx.Client(timeout=60) as client:
            answers: list[httpx.Response] = []
            with _thread(lambda: answers.append(
                client.post(f"{public}/v1/completions", json=request, headers=server.headers())
            )):  # fmt: skip
                started = time.monotonic()
                demand = client.post(f"{admin}/admin/backends", json={"wait": 60}, headers=headers).json()
                assert demand["held"] == 1 and time.monotonic() - started < 30
                client.post(
                    f"{admin}/admin/backends", json={"backends": [server.url], "wait": 0}, headers=headers
                ).raise_for_status()
            assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"] == direct
            # A world serving: forwarded at once, streams too, the API key checked by the world.
            stream = client.post(
                f"{public}/v1/completions", json={**request, "stream": True}, headers=server.headers()
            )
            assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
            refused = client.post(
                f"{public}/v1/completions", json=request, headers={"Authorization": "Bearer no"}
            )
            assert refused.status_code == 401 and API_KEY not in refused.text
    finally:
        process.terminate()
        assert process.wait(30) == 0, process.stdout.read() if process.stdout else ""


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class _thread:
    """Run `call` on a thread for the duration of a with-block (joined on the way out)."""

    def __init__(self, call) -> None:
        import threading

        self._thread = threading.Thread(target=call, daemon=True)

    def __enter__(self) -> None:
        self._thread.start()

    def __exit__(self, *exc: object) -> None:
        self._thread.join(90)


async def test_a_world_that_refuses_is_set_aside_and_the_request_waits_for_one_that_serves() -> None:
    from berth.engine.serve.activator import public_app

    def world(request: httpx.Request) -> httpx.Response:
        if request.url.host == "parked":  # asleep since the operator named it
            return httpx.Response(503, json={"error": {"message": "asleep"}}, headers={"Retry-After": "5"})
        served = json.dumps({"served_by": request.url.host}).encode()
        return httpx.Response(
            200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(served)
        )

    activator = Activator(wake_timeout=30)
    activator.set_backends(["http://parked"], None)
    async with httpx.AsyncClient(transport=httpx.MockTransport(world)) as upstream:
        app = public_app(activator, upstream)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://activator"
        ) as client:
            reply = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x"}))
            while activator.held_total == 0:  # refused by the parked world, then held
                await asyncio.sleep(0.01)
            assert activator.backends == [] and not reply.done()
            activator.set_backends(["http://awake"], None)  # the operator names a world that serves
            answer = await asyncio.wait_for(reply, 10)
    assert answer.status_code == 200 and answer.json() == {"served_by": "awake"}
