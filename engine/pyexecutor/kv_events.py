"""KV-cache events: what the prefix cache holds, told to whoever listens (a KV-aware router).

Opt-in (`--kv-events-endpoint`): the engine loop publishes, after every turn that changed the
cache, one batch of events on a ZeroMQ PUB socket, as a multipart message
`[b"kv-events", sequence number (8 bytes, big-endian), JSON]`. The JSON is
`{"engine_id", "seq", "ts", "events": [...]}`, the events shaped as vLLM's:

- `{"type": "BlockStored", "block_hashes": [hex, ...], "parent_block_hash": hex | null,
  "token_ids": [...], "block_size": N, "lora_id": null, "medium": "cpu" | "cuda",
  "cache_salt_namespace": hex | null}`: full blocks recorded in the prefix cache, a run of one
  sequence's consecutive blocks (block i holds `token_ids[i*N:(i+1)*N]`, its parent is block
  i-1, the first one's is `parent_block_hash`, null at the start of a prompt);
- `{"type": "BlockRemoved", "block_hashes": [...], "medium": ...}`: evicted from the cache;
- `{"type": "AllBlocksCleared"}`: the cache was dropped (a sleep).

A block hash is SHA-256 chained over the tokens before it, seeded by the request's
`cache_salt` (`kv_cache.py`); the namespace names the salt without revealing it (a hash of
it; null without a salt), so a router keeps tenants apart. Sequence numbers count batches
from 1 without gaps: a subscriber that sees one missing lost events and must resynchronize.

A subscriber that joins late asks the snapshot socket (ZeroMQ ROUTER, `--kv-events-snapshot-
endpoint`; send `b"snapshot"` from a REQ socket) for the cache's contents and the sequence
number they are current at, then applies the batches numbered after it. The publisher keeps
that view by applying its own events, under the lock that also orders publishing, so a
snapshot and the batches after it never overlap or miss one. `KVEventSubscriber` does all
of this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable

import zmq

logger = logging.getLogger(__name__)

TOPIC = b"kv-events"
SNAPSHOT_REQUEST = b"snapshot"


def salt_namespace(cache_salt: str | None) -> str | None:
    if cache_salt is None:
        return None
    return hashlib.sha256(b"berth-cache-salt\x00" + cache_salt.encode("utf-8")).hexdigest()[:16]


class KVEventLog:
    """The events of the current turn, in the order they happened (the KV cache writes them)."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium
        self._events: list[dict] = []

    def stored(
        self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], namespace: str | None
    ) -> None:
        self._events.append(
            {
                "type": "BlockStored",
                "block_hashes": [h.hex() for h in block_hashes],
                "parent_block_hash": parent.hex() if parent is not None else None,
                "token_ids": token_ids,
                "block_size": self.block_size,
                "lora_id": None,
                "medium": self.medium,
                "cache_salt_namespace": namespace,
            }
        )

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and last["type"] == "BlockRemoved":  # one event per run of evictions
            last["block_hashes"].append(block_hash.hex())
        else:
            self._events.append(
                {"type": "BlockRemoved", "block_hashes": [block_hash.hex()], "medium": self.medium}
            )

    def cleared(self) -> None:
        self._events = [{"type": "AllBlocksCleared"}]  # what came before it no longer matters

    def take(self) -> list[dict]:
        events, self._events = self._events, []
        return events


class CacheContents:
    """The blocks a cache holds, as its events tell: hex hash -> {parent, token_ids, namespace}."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict] = {}
        self.applied: Counter[str] = Counter()  # events applied, by type

    def apply(self, events: Iterable[dict]) -> None:
        for event in events:
            kind = event["type"]
            self.applied[kind] += 1
            if kind == "BlockStored":
                size, tokens = event["block_size"], event["token_ids"]
                parent = event["parent_block_hash"]
                for index, block_hash in enumerate(event["block_hashes"]):
                    self.blocks[block_hash] = {
                        "parent": parent,
                        "token_ids": tokens[index * size : (index + 1) * size],
                        "namespace": event["cache_salt_namespace"],
                    }
                    parent = block_hash
            elif kind == "BlockRemoved":
                for block_hash in event["block_hashes"]:
                    self.blocks.pop(block_hash, None)
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
            else:
                raise ValueError(f"unknown KV event type {kind!r}")


class KVEventPublisher:
    """Binds the PUB socket (and the snapshot socket, if asked) at once; `publish` is called from
    the engine loop's thread only, the snapshot socket is served by a thread of its own."""

    def __init__(self, endpoint: str, snapshot_endpoint: str | None, engine_id: str) -> None:
        self.engine_id = engine_id
        self._context = zmq.Context()
        self._lock = threading.Lock()
        self._contents = CacheContents()
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.snapshot_endpoint = None
            if snapshot_endpoint is not None:
                snapshots = self._context.socket(zmq.ROUTER)
                snapshots.setsockopt(zmq.LINGER, 0)
                snapshots.bind(snapshot_endpoint)
                self.snapshot_endpoint = snapshots.getsockopt_string(zmq.LAST_ENDPOINT)
                self._thread = threading.Thread(
                    target=self._serve_snapshots, args=(snapshots,), name="berth-kv-snapshots", daemon=True
                )
                self._thread.start()
        except zmq.ZMQError as error:
            self._context.destroy(linger=0)
            raise ValueError(f"cannot bind the KV events socket ({endpoint}): {error}") from None
        logger.info("KV events: publishing on %s, snapshots on %s", self.endpoint, self.snapshot_endpoint)

    @property
    def seq(self) -> int:
        """The number of the last batch published."""
        return self._seq

    def publish(self, events: list[dict]) -> None:
        if not events:
            return
        with self._lock:
            self._seq += 1
            self._contents.apply(events)
            body = {"engine_id": self.engine_id, "seq": self._seq, "ts": time.time(), "events": events}
            self._pub.send_multipart([TOPIC, self._seq.to_bytes(8, "big"), json.dumps(body).encode()])

    def _serve_snapshots(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if frames[-1] != SNAPSHOT_REQUEST:
                    continue  # not ours: no answer (a REQ asking something else times out)
                with self._lock:
                    blocks = [{"block_hash": h, **block} for h, block in self._contents.blocks.items()]
                    body = {"engine_id": self.engine_id, "seq": self._seq, "blocks": blocks}
                sock.send_multipart([*frames[:-1], json.dumps(body).encode()])
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._pub.close(linger=0)
        self._context.term()


class KVEventSubscriber:
    """One engine's cache contents, kept current from its events (for a KV-aware router, and the
    tests). `sync()` takes a snapshot (joining late is the normal case); `poll()` applies the
    batches that arrived; a missing sequence number makes the next `poll` resynchronize."""

    def __init__(self, endpoint: str, snapshot_endpoint: str | None = None, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.snapshot_endpoint = snapshot_endpoint
        self.contents = CacheContents()
        self.seq = 0
        self.engine_id: str | None = None
        self.resyncs = 0  # snapshots taken because a batch was lost
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        monitor = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            self._sub.connect(endpoint)
            # The subscription travels right after the handshake: wait for it, so that what is
            # published from now on reaches us.
            if not monitor.poll(int(timeout * 1000)):
                raise TimeoutError(f"no KV events publisher answered at {endpoint} within {timeout:g} s")
        finally:
            self._sub.disable_monitor()
            monitor.close(linger=0)

    def sync(self) -> None:
        """The publisher's contents now (the snapshot), and the sequence number they are current at."""
        if self.snapshot_endpoint is None:
            raise RuntimeError("no snapshot endpoint: cannot join late or recover lost events")
        request = self._context.socket(zmq.REQ)
        request.setsockopt(zmq.LINGER, 0)
        try:
            request.connect(self.snapshot_endpoint)
            request.send(SNAPSHOT_REQUEST)
            if not request.poll(int(self.timeout * 1000)):
                raise TimeoutError(
                    f"no KV events snapshot from {self.snapshot_endpoint} within {self.timeout:g} s"
                )
            body = json.loads(request.recv())
        finally:
            request.close(linger=0)
        self.engine_id = body["engine_id"]
        self.contents = CacheContents()
        self.contents.blocks = {
            block["block_hash"]: {key: block[key] for key in ("parent", "token_ids", "namespace")}
            for block in body["blocks"]
        }
        self.seq = body["seq"]

    def poll(self, timeout: float = 0.0) -> int:
        """Applies every batch that has arrived (waiting up to `timeout` for the first); how many."""
        applied = 0
        wait = int(timeout * 1000)
        while self._sub.poll(wait):
            wait = 0
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.seq:
                continue  # in the snapshot already
            if seq != self.seq + 1:
                logger.warning(
                    "KV events: batch %d after %d, %d lost: resynchronizing",
                    seq,
                    self.seq,
                    seq - self.seq - 1,
                )
                self.resyncs += 1
                self.sync()  # taken after this batch was sent, so it holds it
                continue
            body = json.loads(payload)
            self.engine_id = body["engine_id"]
            self.contents.apply(body["events"])
            self.seq = seq
            applied += 1
        return applied

    def close(self) -> None:
        self._sub.close(linger=0)
        self._context.term()
