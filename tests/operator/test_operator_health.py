"""The health poll reaches IPv6 pod IPs (in brackets) and turns every bad address into an
unanswered poll: nothing it meets may end the health daemon."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from berth.operator.health import base_url, probe


@pytest.fixture
async def ipv6_engine() -> AsyncIterator[int]:
    """A stand-in engine on [::1] answering /health and /ready like berth serve."""
    app = web.Application()
    app.router.add_get("/health", lambda _: web.json_response({"status": "ok"}))
    app.router.add_get("/ready", lambda _: web.json_response({"admission": "running"}))
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        port = sock.getsockname()[1]
    site = web.TCPSite(runner, "::1", port)
    await site.start()
    try:
        yield port
    finally:
        await runner.cleanup()


def test_ipv6_addresses_are_bracketed() -> None:
    assert base_url(("10.0.0.5", 8000)) == "http://10.0.0.5:8000"
    assert base_url(("fd00::5", 8000)) == "http://[fd00::5]:8000"
    assert base_url(("[fd00::5]", 8000)) == "http://[fd00::5]:8000"


async def test_an_ipv6_pod_ip_is_polled(ipv6_engine: int) -> None:
    async with httpx.AsyncClient() as client:
        result = await probe(client, ("::1", ipv6_engine), timeout=5)
    assert result.status == "alive" and result.ready and result.admission == "running"


@pytest.mark.parametrize("host", ["[::1", "999.1.1.1:", "fd00::5]"])
async def test_an_address_that_is_no_url_is_an_unanswered_poll(host: str) -> None:
    async with httpx.AsyncClient() as client:
        result = await probe(client, (host, 8000), timeout=1)
    assert result.status == "unreachable"
    assert result.error is not None and result.error.startswith("InvalidURL")
