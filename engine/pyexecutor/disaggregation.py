"""The engine loop's side of disaggregated prefill and decode (`berth.engine.disaggregation`).

Context side: a context-only sequence ends after its first token; its blocks stay held by a
*pin* instead of being freed, and the response carries the handle. A pull is answered in the
loop's turn (the loop owns the cache tensors); a release, or the pin's deadline, frees the
blocks. Pins never outlive a sleep (the cache goes) and never leak: every path ends in `_unpin`.

Generation side: a generation-only sequence reserves the blocks its prompt needs (waiting for
room up to its timeout), pulls the keys and values through the `KVTransferClient`, and when
they arrive the loop writes them into its blocks and hands the sequence to the scheduler as a
running one whose prompt is computed, its first token appended: the next step decodes exactly
as a single engine would. A failed or late transfer fails the request alone (or, with
`fallback="local"`, the prompt is run here); its blocks go back either way, and the context
engine is told to release its pin.

Tensor parallelism: only rank 0 runs this (the loop, the pins, the pulls, the transfer sockets);
the other ranks hold no request state. The keys and values travel as every KV head of the
model: rank 0 gathers its world's slices to serve a pull and broadcasts what a pull brought
for each rank to write its own slice (`kv_slices`), in the loop's turn, so every rank runs the
same collectives in the same order, and the two engines may split the heads differently.
Whatever depends on time (a pull's data arriving, a pin expiring, a release) is decided here,
on rank 0, once.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from berth.engine.disaggregation import ContextOnly, GenerationOnly, KVHandle, KVLayout, prompt_digest
from berth.engine.engine_io import RequestError, Response
from berth.engine.pyexecutor import kv_slices
from berth.engine.pyexecutor.kv_transfer import (
    KVTransferClient,
    KVTransferServer,
    PullRequest,
    ReleaseRequest,
)
from berth.engine.pyexecutor.sequence import Sequence, SequenceState

if TYPE_CHECKING:
    from berth.engine.pyexecutor.py_executor import PyExecutor

logger = logging.getLogger(__name__)


@dataclass
class _Pin:
    block_ids: list[int]
    num_tokens: int
    deadline: float  # time.monotonic()
    request_id: int


@dataclass
class _Pull:
    sequence: Sequence
    spec: GenerationOnly
    deadline: float
    started: bool = False  # blocks reserved and the pull sent
    released: bool = False  # the context engine was told to free its pin


@dataclass
class PullDone:
    """A pull ended (on the client's thread): the loop takes it up in its next turn."""

    request_id: int
    header: dict | None
    payload: bytes
    error: str | None


class Disaggregation:
    def __init__(self, engine: PyExecutor, endpoint: str | None, key: bytes | None) -> None:
        self._engine = engine
        self._key = key
        self.pins: dict[str, _Pin] = {}
        self.pulls: dict[int, _Pull] = {}  # request_id -> its pull
        self.server = KVTransferServer(endpoint, key, engine.request_queue.enqueue_news) if endpoint else None
        self._client: KVTransferClient | None = None
        self.num_pins_expired = 0
        self.num_transfers_failed = 0
        self.pins_changed = False  # since the loop last reported: its stats must say so

    # ---- context side ---------------------------------------------------------------------------

    def check_context_only(self, n: int) -> None:
        if self.server is None:
            raise RequestError(
                "this engine serves no KV transfers: start it with a KV transfer endpoint "
                "(--kv-transfer-endpoint) to run context-only requests",
                code="disaggregation_unavailable",
            )
        self._check_common(n)

    def pin(self, sequence: Sequence, spec: ContextOnly) -> KVHandle:
        """Takes the finished sequence's blocks (so retiring it frees none) under a new id."""
        disagg_id = secrets.token_hex(16)
        num_tokens = sequence.num_prompt_tokens
        self.pins_changed = True
        self.pins[disagg_id] = _Pin(
            sequence.block_ids, num_tokens, time.monotonic() + spec.pin_seconds, sequence.request_id
        )
        blocks, sequence.block_ids = tuple(sequence.block_ids), []
        sequence.num_cached_blocks = 0
        logger.info(
            "request %d: context done, %d blocks pinned as %s for %g s",
            sequence.request_id, len(blocks), disagg_id, spec.pin_seconds,
        )  # fmt: skip
        return KVHandle(
            address=_reachable(self.server.address),
            disagg_id=disagg_id,
            block_ids=blocks,
            num_tokens=num_tokens,
            first_token=sequence.token_ids[num_tokens],
            prompt_digest=prompt_digest(sequence.token_ids[:num_tokens]),
            layout=self.layout(),
            context_request_id=sequence.request_id,
        )

    def serve_pull(self, pull: PullRequest) -> None:
        pin = self.pins.get(pull.disagg_id)
        if pin is None:
            pull.reply(
                {
                    "op": "error",
                    "message": f"no pinned KV blocks under {pull.disagg_id} (expired or released)",
                },
                b"",
            )
            return
        kv = self._engine.kv_cache
        if kv.kv_caches is None:
            pull.reply({"op": "error", "message": "the KV cache is released (the engine sleeps)"}, b"")
            return
        slots = kv_slices.slots_of(pin.block_ids, pin.num_tokens, kv.block_size)
        data = kv_slices.read(self._engine.model_runner, slots)
        header = {"op": "data", "shape": list(data.shape), "dtype": str(data.dtype).removeprefix("torch.")}
        pull.reply(header, data.view(torch.uint8).numpy().tobytes())

    def release(self, request: ReleaseRequest) -> None:
        self._unpin(request.disagg_id, "released")

    def _unpin(self, disagg_id: str, why: str) -> None:
        pin = self.pins.pop(disagg_id, None)
        if pin is not None:
            self.pins_changed = True
            self._engine.kv_cache.pool.free(reversed(pin.block_ids))
            logger.info("request %d: pinned KV blocks %s freed (%s)", pin.request_id, disagg_id, why)

    def drop_all_pins(self, why: str) -> None:
        for disagg_id in list(self.pins):
            self._unpin(disagg_id, why)

    # ---- generation side ------------------------------------------------------------------------

    def check_generation_only(self, group: list[Sequence], spec: GenerationOnly) -> None:
        """The handle against this engine and the request: a RequestError says what does not fit."""
        handle = spec.handle
        if self._key is None:
            raise RequestError(
                "this engine has no KV transfer key (BERTH_KV_TRANSFER_KEY or BERTH_ENGINE_KEY)"
            )
        self._check_common(len(group))
        # The keys and values travel as every head of the model: the engines may split them
        # over different numbers of ranks (`kv_slices`), and use other block sizes.
        mine, theirs = self.layout(), handle.layout
        shapes = ("num_layers", "num_kv_heads", "head_dim")
        if any(getattr(mine, name) != getattr(theirs, name) for name in shapes):
            raise RequestError(
                f"the context engine's KV layout {theirs} does not fit this engine's {mine}: another model?"
            )
        prompt = group[0].token_ids
        if handle.num_tokens != len(prompt) or handle.prompt_digest != prompt_digest(prompt):
            raise RequestError("the KV handle was made for another prompt than this request's")

    def start_generation(self, group: list[Sequence], spec: GenerationOnly) -> None:
        """The sequence waits here (not in the scheduler's queues) until its keys and values are in."""
        (sequence,) = group
        handle = spec.handle
        sequence.token_ids.append(handle.first_token)
        sequence.state = SequenceState.WAITING
        self.pulls[sequence.request_id] = _Pull(sequence, spec, time.monotonic() + spec.timeout)
        self._engine.scheduler.pending.add(sequence)
        logger.info(
            "request %d: generation-only, pulling %d tokens of KV from %s (context request %d)",
            sequence.request_id, handle.num_tokens, handle.address, handle.context_request_id,
        )  # fmt: skip

    def start_pulls(self) -> list[Response]:
        """Reserves blocks for the pulls waiting for room, and sends them; those past their
        deadline without room fail (or fall back)."""
        responses: list[Response] = []
        kv = self._engine.kv_cache
        now = time.monotonic()
        for request_id, pull in list(self.pulls.items()):
            if pull.started:
                continue
            needed = kv.blocks_for(pull.spec.handle.num_tokens)
            if needed <= kv.pool.num_free:
                pull.sequence.block_ids = kv.pool.allocate(needed)
                pull.started = True
                self._client_for().pull(
                    pull.spec.handle.address,
                    pull.spec.handle.disagg_id,
                    pull.deadline,
                    lambda header, payload, error, request_id=request_id: (
                        self._engine.request_queue.enqueue_news(PullDone(request_id, header, payload, error))
                    ),
                )
            elif now >= pull.deadline:
                responses += self._failed(
                    pull, f"no room in the KV cache for {needed} blocks within the timeout"
                )
        return responses

    def pull_done(self, done: PullDone) -> list[Response]:
        pull = self.pulls.pop(done.request_id, None)
        if pull is None or pull.sequence.finished:  # aborted while it pulled: its blocks went back then
            return []
        handle = pull.spec.handle
        self._release(pull)
        sequence = pull.sequence
        if done.error is None:
            try:
                self._write(sequence, done.header, done.payload)
            except (ValueError, RuntimeError, KeyError, TypeError) as error:
                done.error = f"the KV data does not fit: {error}"
        if done.error is not None:
            self.pulls[done.request_id] = pull  # `_failed` takes it out again
            return self._failed(pull, done.error)
        engine = self._engine
        self._skip_first_draw(sequence)
        engine.scheduler.pending.discard(sequence)
        engine.scheduler.add_running(sequence)
        sequence.state = SequenceState.GENERATION_IN_PROGRESS
        engine._check_stop(sequence, handle.first_token)
        if sequence.streaming or sequence.finished:
            response = engine._response(sequence)
            if sequence.finished:
                engine._retire(sequence)
            return [response]
        return []

    def _skip_first_draw(self, sequence: Sequence) -> None:
        """A seeded sequence's generator starts where the context engine's stopped: one draw on,
        the one that sampled the first token (a draw over the vocabulary uses the same random
        numbers whatever the probabilities), so its tokens equal a single engine's."""
        if sequence.seed is None or sequence.params.greedy:
            return
        device = self._engine.model_runner.device
        sequence.generator = torch.Generator(device=device).manual_seed(sequence.seed)
        vocabulary = torch.ones(self._engine.limits.vocab_size, device=device)
        torch.multinomial(vocabulary, 1, generator=sequence.generator)

    def forget(self, sequence: Sequence) -> None:
        """An aborted or failed generation-only sequence: its pull no longer matters (a late
        result is dropped; the release was or will be sent)."""
        pull = self.pulls.pop(sequence.request_id, None)
        if pull is not None:
            self._release(pull)

    def _release(self, pull: _Pull) -> None:
        """Whatever became of the pull, the context engine's pin is not needed any more."""
        if not pull.released:
            pull.released = True
            self._client_for().release(pull.spec.handle.address, pull.spec.handle.disagg_id)

    def _failed(self, pull: _Pull, error: str) -> list[Response]:
        self.num_transfers_failed += 1
        sequence, engine = pull.sequence, self._engine
        self.pulls.pop(sequence.request_id, None)
        self._release(pull)
        handle = pull.spec.handle
        logger.warning(
            "request %d: KV transfer from %s failed: %s", sequence.request_id, handle.address, error
        )
        if pull.spec.fallback == "local":
            engine.scheduler.pending.discard(sequence)
            engine.kv_cache.free(sequence)
            del sequence.token_ids[sequence.num_prompt_tokens :]  # the first token is sampled here
            sequence.num_computed_tokens = 0
            sequence.state = SequenceState.WAITING
            engine.scheduler.add([sequence])
            return []
        message = f"KV transfer from the context engine ({handle.address}) failed: {error}"
        return engine._fail(sequence.request_id, RequestError(message, code="kv_transfer_failed"))

    # ---- both ---------------------------------------------------------------------------------------

    def expire_pins(self) -> None:
        now = time.monotonic()
        for disagg_id, pin in list(self.pins.items()):
            if now >= pin.deadline:
                self.num_pins_expired += 1
                self._unpin(disagg_id, "pin timed out")

    def seconds_to_wait(self) -> float | None:
        """Until a pin expires or a pull waiting for room should look again (None: nothing due)."""
        if any(not pull.started for pull in self.pulls.values()):
            return 0.05
        if not self.pins:
            return None
        return max(0.0, min(pin.deadline for pin in self.pins.values()) - time.monotonic())

    def layout(self) -> KVLayout:
        runner = self._engine.model_runner
        kv = runner.kv_cache
        return KVLayout(
            dtype=str(kv.dtype).removeprefix("torch."),
            block_size=kv.block_size,
            num_layers=kv.shape[0],
            num_kv_heads=runner.model.config.num_kv_heads,
            head_dim=kv.shape[5],
            tensor_parallel_size=runner.tp.size,
        )

    def _check_common(self, n: int) -> None:
        if n != 1:
            raise RequestError("a disaggregated request takes n=1 (send n requests, each with its own seed)")

    def _client_for(self) -> KVTransferClient:
        if self._client is None:
            self._client = KVTransferClient(self._key)
        return self._client

    def _write(self, sequence: Sequence, header: dict, payload: bytes) -> None:
        """Into every rank's cache; checked whole here first, so that no rank fails its part."""
        runner = self._engine.model_runner
        kv = runner.kv_cache
        num_tokens = sequence.num_prompt_tokens
        dtype = getattr(torch, str(header["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"no dtype {header['dtype']!r}")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(header["shape"])
        expected = (kv.shape[0], 2, num_tokens, runner.model.config.num_kv_heads, kv.shape[5])
        if tuple(data.shape) != expected:
            raise ValueError(f"shape {tuple(data.shape)}, expected {expected}")
        kv_slices.write(runner, kv_slices.slots_of(sequence.block_ids, num_tokens, kv.block_size), data)
        sequence.num_computed_tokens = num_tokens
        kv.record_full_blocks(sequence, num_tokens)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._client is not None:
            self._client.close()


def _reachable(address: str) -> str:
    """A bound wildcard address, as another host reaches it."""
    return address.replace("//0.0.0.0:", f"//{socket.getfqdn()}:", 1)
