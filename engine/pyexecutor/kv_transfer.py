"""Moving a request's keys and values between engines (disaggregated prefill and decode).

The interface is two small roles, so that a GPU transport (NIXL, UCX, NCCL send/recv) can take
the place of this one: a `KVTransferServer` on the context engine answers pulls of pinned
blocks and hears releases; a `KVTransferClient` on the generation engine pulls (with a deadline)
and releases. Neither touches the KV cache: the engine loop reads and writes its own tensors,
in its own turns, and hands bytes to them (the cache belongs to the loop's thread).

This implementation runs over ZeroMQ (TCP or IPC): frames `[tag, header, payload]`, the header
JSON (`op`: pull | release | data | error | ok, `disagg_id`, `nonce`, ...), the payload the raw
keys and values `[layer][key|value][token][kv head][dim]`, every KV head of the model (a
tensor-parallel engine's rank 0 gathers them from its ranks: `kv_slices`). The tag is HMAC-SHA256 over header
and payload with the deployment's key: a message that fails it is answered with an unsigned
error (the peer then reports a key mismatch, not a silent timeout) and never acted on.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

logger = logging.getLogger(__name__)

KEY_MISMATCH = "the reply is not signed with this engine's KV transfer key (do the engines share one?)"


class KVTransferError(RuntimeError):
    pass


def _tag(key: bytes, header: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, b"berth-kv-transfer\x00", hashlib.sha256)
    mac.update(len(header).to_bytes(8, "big"))
    mac.update(header)
    mac.update(payload)
    return mac.digest()


def _frames(key: bytes, header: dict, payload: bytes = b"") -> list[bytes]:
    encoded = json.dumps(header).encode()
    return [_tag(key, encoded, payload), encoded, payload]


def _verify(key: bytes, frames: list[bytes]) -> tuple[dict, bytes] | None:
    if len(frames) != 3:
        return None
    tag, header, payload = frames
    if not hmac.compare_digest(tag, _tag(key, header, payload)):
        return None
    return json.loads(header), payload


def _unverified(frames: list[bytes]) -> dict:
    """The JSON header of a message that failed its signature check, to name it in an error."""
    try:
        header = json.loads(frames[1]) if len(frames) > 1 else {}
    except ValueError:
        return {}
    return header if isinstance(header, dict) else {}


@dataclass
class PullRequest:
    """A generation engine asks for a pinned request's keys and values (the loop answers)."""

    disagg_id: str
    reply: Callable[[dict, bytes], None]  # (header, payload): data, or {"op": "error", ...}


@dataclass
class ReleaseRequest:
    """A generation engine is done with a pinned request's blocks."""

    disagg_id: str


class KVTransferServer:
    """The context engine's side: a ROUTER socket served by a thread of its own. Requests go to
    `on_request` (the engine loop's queue); the loop's replies are sent from here."""

    def __init__(self, endpoint: str, key: bytes, on_request: Callable[[PullRequest | ReleaseRequest], None]):
        self._key = key
        self._on_request = on_request
        self._context = zmq.Context()
        self._replies: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        self._stop = threading.Event()
        try:
            self._socket = self._context.socket(zmq.ROUTER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(endpoint)
        except zmq.ZMQError as error:
            self._context.destroy(linger=0)
            raise ValueError(f"cannot bind the KV transfer socket ({endpoint}): {error}") from None
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="berth-kv-transfer", daemon=True)
        self._thread.start()
        logger.info("KV transfer: serving pinned blocks on %s", self.address)

    def _serve(self) -> None:
        sock = self._socket
        try:
            while not self._stop.is_set():
                while True:  # the loop's replies first
                    try:
                        sock.send_multipart(self._replies.get_nowait())
                    except queue.Empty:
                        break
                if sock.poll(5):
                    frames = sock.recv_multipart()
                    self._handle(frames[0], frames[1:])
        finally:
            sock.close(linger=0)

    def _handle(self, peer: bytes, frames: list[bytes]) -> None:
        verified = _verify(self._key, frames)
        if verified is None:
            logger.warning("KV transfer: a message failed its signature check: refused")
            # Unsigned, and naming the request it answers, so the peer can tell which of its
            # requests met the wrong key (it acts on nothing in it but that).
            answer = {"op": "error", "message": "bad signature", "nonce": _unverified(frames).get("nonce")}
            self._socket.send_multipart([peer, b"", json.dumps(answer).encode(), b""])
            return
        header, _ = verified
        op, disagg_id, nonce = header.get("op"), str(header.get("disagg_id")), header.get("nonce")
        if op == "pull":

            def reply(answer: dict, payload: bytes, peer=peer, nonce=nonce) -> None:
                self._replies.put([peer, *_frames(self._key, {**answer, "nonce": nonce}, payload)])

            self._on_request(PullRequest(disagg_id, reply))
        elif op == "release":
            self._on_request(ReleaseRequest(disagg_id))
            self._replies.put([peer, *_frames(self._key, {"op": "ok", "nonce": nonce})])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._context.term()


class KVTransferClient:
    """The generation engine's side: one thread runs the pulls and releases in order, each pull
    bounded by its deadline; results go to `done` callbacks (the engine loop's queue)."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._nonces = itertools.count(secrets.randbelow(1 << 30))
        self._thread = threading.Thread(target=self._run, name="berth-kv-pull", daemon=True)
        self._thread.start()

    def pull(
        self,
        address: str,
        disagg_id: str,
        deadline: float,
        done: Callable[[dict | None, bytes, str | None], None],
    ) -> None:
        """Fetches the pinned request's keys and values; `done(header, payload, error)` is called
        once, with an error text if it failed or `deadline` (time.monotonic()) passed."""
        self._jobs.put(("pull", address, disagg_id, deadline, done))

    def release(self, address: str, disagg_id: str) -> None:
        self._jobs.put(("release", address, disagg_id, None, None))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        context = zmq.Context()
        sockets: dict[str, zmq.Socket] = {}

        def socket_for(address: str) -> zmq.Socket:
            if address not in sockets:
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                sockets[address] = sock
            return sockets[address]

        try:
            while (job := self._jobs.get()) is not None:
                op, address, disagg_id, deadline, done = job
                nonce = next(self._nonces)
                try:
                    sock = socket_for(address)
                    sock.send_multipart(
                        _frames(self._key, {"op": op, "disagg_id": disagg_id, "nonce": nonce})
                    )
                except zmq.ZMQError as error:
                    if done is not None:
                        done(None, b"", f"cannot reach the context engine at {address}: {error}")
                    continue
                if op == "pull":
                    done(*self._await_reply(sock, nonce, deadline, address))
        finally:
            for sock in sockets.values():
                sock.close(linger=0)
            context.term()

    def _await_reply(self, sock: zmq.Socket, nonce: int, deadline: float, address: str):
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                return (
                    None,
                    b"",
                    f"the context engine at {address} did not answer within the transfer timeout",
                )
            frames = sock.recv_multipart()
            verified = _verify(self._key, frames)
            if verified is None:
                if _unverified(frames).get("nonce") != nonce:
                    continue  # the refusal of an earlier request (a release)
                return None, b"", KEY_MISMATCH
            header, payload = verified
            if header.get("nonce") != nonce:
                continue  # a late answer to an earlier pull, or a release's ok
            if header.get("op") == "error":
                return None, b"", f"the context engine refused: {header.get('message')}"
            return header, payload, None
