"""Signed messages over ZeroMQ: the wire between the proxy and the worker world.

Every message is two frames, an HMAC-SHA256 tag and a pickle. The tag is checked before
anything is unpickled: unpickling runs code, so a message from anyone who lacks the engine's
key is dropped and logged, never loaded. The tag also covers the queue's name, so a signed
message sent on one queue cannot be replayed as a message of another.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import secrets
import tempfile
from pathlib import Path

import zmq

logger = logging.getLogger(__name__)

KEY_ENV = "BERTH_ENGINE_KEY"  # hex; how a worker started by someone else (mpirun) gets the key
KEY_BYTES = 32

# The three queues (their names are part of every signature).
REQUESTS = b"requests"  # proxy -> rank 0: requests, aborts, control messages, in order
RESULTS = b"results"  # rank 0 -> proxy: one message per engine step
INIT_STATUS = b"init-status"  # worker <-> proxy: identity, config, READY / failure, ACK


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def key_from_env() -> bytes:
    value = os.environ.get(KEY_ENV)
    if not value:
        raise RuntimeError(f"{KEY_ENV} is not set: the worker needs the engine's key (hex)")
    key = bytes.fromhex(value)
    if len(key) != KEY_BYTES:
        raise RuntimeError(f"{KEY_ENV} must hold {KEY_BYTES} bytes ({2 * KEY_BYTES} hex digits)")
    return key


IPC_FOLDER_PREFIX = "berth-"


def ipc_addresses(directory: str | Path | None = None) -> tuple[dict[str, str], Path]:
    """Addresses for processes on one machine: Unix sockets in a fresh 0700 directory (so only
    this user can even connect). Returns the addresses and the directory to remove at the end."""
    folder = Path(tempfile.mkdtemp(prefix=IPC_FOLDER_PREFIX, dir=directory))
    names = {"requests": REQUESTS, "results": RESULTS, "init_status": INIT_STATUS}
    return {name: f"ipc://{folder / queue.decode()}" for name, queue in names.items()}, folder


def tcp_addresses(host: str = "127.0.0.1") -> dict[str, str]:
    """Addresses for processes on different hosts; `*` lets the binding side pick a free port."""
    return {name: f"tcp://{host}:*" for name in ("requests", "results", "init_status")}


class SignedSocket:
    """A ZeroMQ socket that signs what it sends and verifies what it receives.

    Not thread-safe (no ZeroMQ socket is): each one is used by one thread at a time.
    """

    def __init__(self, socket: zmq.Socket, key: bytes, queue: bytes) -> None:
        self.socket = socket
        self._key = key
        self._queue = queue
        self.num_dropped = 0

    @property
    def address(self) -> str:
        """The bound address, with the real port when `*` was asked for."""
        return self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self._key, self._queue + payload, hashlib.sha256).digest()

    def send(self, message: object, *, routing_id: bytes | None = None, flags: int = 0) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frames = [self._tag(payload), payload]
        if routing_id is not None:
            frames.insert(0, routing_id)
        self.socket.send_multipart(frames, flags=flags, copy=len(payload) < 64 << 10)

    def recv(self, timeout_ms: int | None = None, *, with_routing_id: bool = False):
        """The next authentic message, or None when `timeout_ms` passes without one.

        Forged or malformed messages are dropped (and logged) and the wait goes on.
        """
        # A dropped message restarts the wait: callers poll in loops with their own deadlines.
        while self.socket.poll(timeout_ms):
            frames = self.socket.recv_multipart()
            routing_id = frames.pop(0) if with_routing_id and frames else None
            message = self._verify(frames)
            if message is not _DROPPED:
                return (routing_id, message) if with_routing_id else message
        return None

    def recv_nowait_all(self) -> list:
        """Every authentic message already waiting, without blocking."""
        messages = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            message = self._verify(frames)
            if message is not _DROPPED:
                messages.append(message)

    def _verify(self, frames: list[bytes]) -> object:
        if len(frames) != 2:
            return self._drop(f"{len(frames)} frames instead of 2 (no signature?)")
        tag, payload = frames
        if not hmac.compare_digest(tag, self._tag(payload)):
            return self._drop("bad signature")
        return pickle.loads(payload)

    def _drop(self, why: str) -> object:
        self.num_dropped += 1
        logger.warning("dropped a message on the %s queue: %s (not unpickled)", self._queue.decode(), why)
        return _DROPPED

    def close(self, linger_ms: int = 0) -> None:
        self.socket.close(linger=linger_ms)


_DROPPED = object()


def open_socket(
    context: zmq.Context, kind: int, address: str, key: bytes, queue: bytes, *, bind: bool
) -> SignedSocket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    # No high-water mark: a send must never block or drop because the peer is a step behind;
    # the engine's own admission bounds how much can be in flight.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return SignedSocket(socket, key, queue)
