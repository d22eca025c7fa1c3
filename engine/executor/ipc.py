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
import threading
from pathlib import Path

import zmq

logger = logging.getLogger(__name__)

KEY_ENV = "BERTH_ENGINE_KEY"  # hex; how a worker started by someone else (mpirun) gets the key
KEY_BYTES = 32

# The queues (their names are part of every signature).
REQUESTS = b"requests"  # proxy -> rank 0: requests, aborts, control messages, in order
RESULTS = b"results"  # rank 0 -> proxy: one message per engine step
INIT_STATUS = b"init-status"  # worker <-> proxy: identity, config, READY / failure, ACK
ATTACH = b"attach"  # frontend <-> the engine's owner: requests and aborts in, results and news out
LANE = b"lane"  # rank 0 -> a postprocess worker: the raw responses of the requests it holds


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def engine_key() -> bytes:
    """The deployment's key when BERTH_ENGINE_KEY is set (every process of a world and its
    frontends share it), else a fresh one that only this engine's processes will know."""
    return key_from_env() if os.environ.get(KEY_ENV) else new_key()


def key_from_env() -> bytes:
    value = os.environ.get(KEY_ENV)
    if not value:
        raise RuntimeError(f"{KEY_ENV} is not set: the worker needs the engine's key (hex)")
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise RuntimeError(f"{KEY_ENV} must be hexadecimal ({2 * KEY_BYTES} hex digits)") from None
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


def reachable(address: str, host: str) -> str:
    """A bound address as a peer must dial it: `tcp://0.0.0.0:P` (every interface) becomes
    `tcp://HOST:P`; any other address is already one."""
    prefix = "tcp://0.0.0.0:"
    return f"tcp://{host}:{address.removeprefix(prefix)}" if address.startswith(prefix) else address


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
        self.send_frames(self.sign(message), routing_id=routing_id, flags=flags)

    def sign(self, message: object) -> list[bytes]:
        """The two frames of `message`, to send later (from the thread that owns the socket)."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return [self._tag(payload), payload]

    def send_frames(self, frames: list[bytes], *, routing_id: bytes | None = None, flags: int = 0) -> None:
        if routing_id is not None:
            frames = [routing_id, *frames]
        self.socket.send_multipart(frames, flags=flags, copy=len(frames[-1]) < 64 << 10)

    def recv(self, timeout_ms: int | None = None, *, with_routing_id: bool = False):
        """The next authentic message, or None when `timeout_ms` passes without one.

        Forged or malformed messages are dropped (and logged) and the wait goes on.
        """
        # A dropped message restarts the wait: callers poll in loops with their own deadlines.
        while self.socket.poll(timeout_ms):
            frames = self.socket.recv_multipart()
            routing_id = frames.pop(0) if with_routing_id and frames else None
            message = self.verify(frames)
            if message is not DROPPED:
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
            message = self.verify(frames)
            if message is not DROPPED:
                messages.append(message)

    def verify(self, frames: list[bytes], origin: str | None = None) -> object:
        """The message two frames carry, or DROPPED (logged, naming `origin` when known) if they
        are not authentic."""
        if len(frames) != 2:
            return self._drop(f"{len(frames)} frames instead of 2 (no signature?)", origin)
        tag, payload = frames
        if not hmac.compare_digest(tag, self._tag(payload)):
            return self._drop("bad signature", origin)
        return pickle.loads(payload)

    def _drop(self, why: str, origin: str | None = None) -> object:
        self.num_dropped += 1
        source = f" from {origin}" if origin else ""
        logger.warning(
            "dropped a message%s on the %s queue: %s (not unpickled)", source, self._queue.decode(), why
        )
        return DROPPED

    def close(self, linger_ms: int = 0) -> None:
        self.socket.close(linger=linger_ms)


DROPPED = object()  # what `verify` returns for a message that is not authentic


def open_socket(
    context: zmq.Context,
    kind: int,
    address: str,
    key: bytes,
    queue: bytes,
    *,
    bind: bool,
    options: dict[int, int] | None = None,
) -> SignedSocket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    # No high-water mark: a send must never block or drop because the peer is a step behind;
    # the engine's own admission bounds how much can be in flight.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    for option, value in (options or {}).items():
        socket.setsockopt(option, value)
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return SignedSocket(socket, key, queue)


class Outbox:
    """Frames other threads hand to the one thread that owns a socket (ZeroMQ sockets are not
    thread-safe): they `post`, it polls `reader` and `take`s. A message is signed (`sign`) by
    the thread that posts it, so the owning thread only moves bytes."""

    _STOP = b""  # a one-frame message, never a signed one (those are two frames)

    def __init__(self, context: zmq.Context) -> None:
        address = f"inproc://berth-outbox-{id(self)}"
        self.reader = context.socket(zmq.PULL)
        self.reader.bind(address)
        self._writer = context.socket(zmq.PUSH)
        self._writer.connect(address)
        self._lock = threading.Lock()

    def post(self, frames: list[bytes]) -> bool:
        """False once closed (nobody would send it)."""
        with self._lock:
            if self._writer.closed:
                return False
            self._writer.send_multipart(frames)
            return True

    def post_stop(self) -> None:
        """Tells the owning thread to stop, after what was posted before."""
        self.post([self._STOP])

    @classmethod
    def is_stop(cls, frames: list[bytes]) -> bool:
        return frames == [cls._STOP]

    def take(self) -> list[list[bytes]]:
        """Everything posted so far, in order, without blocking (owning thread only)."""
        taken = []
        while True:
            try:
                taken.append(self.reader.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return taken

    def close(self) -> None:
        with self._lock:
            self._writer.close(linger=0)
        self.reader.close(linger=0)
