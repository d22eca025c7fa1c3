"""The server's listening socket: connections it accepts have TCP_NODELAY, so a response on a
kept-alive connection is not held back ~40 ms by Nagle's algorithm waiting for a delayed ACK
(`berth bench serve` prints the keep-alive latency that would show it)."""

from __future__ import annotations

import asyncio
import socket

from berth.engine.serve.server import bind


async def test_accepted_connections_have_tcp_nodelay():
    listener = bind("127.0.0.1", 0)
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("socket")
        accepted.set_result(peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    # The way uvicorn serves it: asyncio's server on the socket we bound.
    server = await asyncio.start_server(on_connection, sock=listener)
    try:
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(accepted, 10) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
