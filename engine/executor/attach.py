"""The attach endpoint: frontends in other processes (other pods) share the engine this one owns.

    the engine's owner: `berth serve MODEL --attach-port P`     a frontend: `berth serve --attach
    (or `berth launch`): a ROUTER socket on tcp://HOST:P  <-->  tcp://OWNER:P`, one DEALER each

Everything on it is signed with the deployment's engine key (BERTH_ENGINE_KEY, as on the
worker queues) and checked before it is unpickled: a frontend without the key is refused and
logged before anything it sent can run.

A frontend says hello and is given a frontend id and what it needs to serve (`EngineInfo`:
limits, tokenizer, model name). Its request ids carry that id in their high bits, so the
owner's dispatch thread routes each response by its id alone (`foreign_sink`) and a frontend's
connection is its result lane: results for frontend A never reach B.

The owner alone owns the engine's life. A frontend that detaches, whose connection drops
(`kill -9`: seen at once through the socket's monitor events) or that falls silent (no
heartbeat for HEARTBEAT_TIMEOUT) is gone: exactly its requests still in the engine are aborted,
nothing else is touched. When the engine dies or its owner stops, every frontend is told
(`AttachmentEnded`) and later hellos are refused with the reason; the frontends keep trying,
and attach to the next owner that comes up at this address. A wakeup that swaps in a revision
with another tokenizer ends every attachment too: each frontend attaches again, for the new one.

Use: `endpoint = AttachEndpoint(f"tcp://{host}:{port}", key)` before the model loads (a port
in use fails at once), `endpoint.start(executor, model_name)` once it has loaded, and
`endpoint.close()` after `executor.shutdown()` (which answers the frontends' requests too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import zmq

from berth.engine.engine_io import AbortRequest, EngineStats, GenerationRequest, RequestError, Response
from berth.engine.executor import ipc
from berth.engine.executor.errors import EngineDeadError
from berth.engine.executor.executor import GenerationExecutor
from berth.engine.executor.messages import (
    ATTACH_PROTOCOL,
    MAX_FRONTEND_ID,
    AttachHello,
    AttachmentEnded,
    AttachRefused,
    AttachWelcome,
    Detach,
    EngineInfo,
    Heartbeat,
    StepResults,
    frontend_of,
)
from berth.engine.executor.postprocess import SequenceUpdate
from berth.engine.tokenizer import tokenizer_files

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0  # each side speaks at least this often
# Silence after which the other side is taken for gone. Generous: a frontend taken for gone
# loses its requests, and a loaded machine can hold a thread back for a while. A process that
# dies is seen at once anyway (its connection closes).
HEARTBEAT_TIMEOUT = 10.0
TICK_SECONDS = 0.1  # how often the endpoint looks at the engine (dead? closed?) at least
PROBE_SECONDS = 2.0  # after a connection closed, how long to look for the frontend it was
PROBE_INTERVAL = 0.05
MAX_MESSAGE_BYTES = 64 << 20  # a request is a few hundred KB at most; anything larger is refused
SWAP_TIMEOUT = 10.0  # how long a tokenizer swap waits for the endpoint's thread to act on it


@dataclass
class _Session:
    frontend_id: int
    routing_id: bytes
    who: str  # "pid P on HOST (ADDRESS)", for the logs
    last_heard: float
    # Requests of this frontend the engine still runs: request_id -> sequences not finished.
    live: dict[int, int] = field(default_factory=dict)

    def answered(self, responses: list[Response | SequenceUpdate]) -> None:
        for response in responses:
            if response.error is not None:
                self.live.pop(response.request_id, None)
                continue
            if isinstance(response, SequenceUpdate):
                ended = response.engine_finished
            else:
                ended = response.finish_reason is not None
            if ended and response.request_id in self.live:
                self.live[response.request_id] -= 1
                if self.live[response.request_id] <= 0:
                    del self.live[response.request_id]


class AttachEndpoint:
    def __init__(self, address: str, key: bytes) -> None:
        self._context = zmq.Context()
        self._router = ipc.open_socket(
            self._context,
            zmq.ROUTER,
            address,
            key,
            ipc.ATTACH,
            bind=True,
            # MANDATORY: a send to a frontend whose connection is gone fails (EHOSTUNREACH)
            # instead of vanishing: that is how a closed connection is matched to its frontend.
            options={zmq.ROUTER_MANDATORY: 1, zmq.MAXMSGSIZE: MAX_MESSAGE_BYTES},
        )
        self.address = self._router.address
        self._monitor = self._router.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # Other threads (the dispatch thread, close) hand frames to the endpoint's thread, the
        # only one that touches the router.
        self._outbox = ipc.Outbox(self._context)
        self._sessions: dict[bytes, _Session] = {}
        self._by_frontend: dict[int, _Session] = {}
        self._sessions_lock = threading.Lock()  # the dispatch thread reads the ledgers too
        self._next_frontend_id = 1
        self._executor: GenerationExecutor | None = None
        self._info: EngineInfo | None = None
        self._model_name = ""
        self._info_tokenizer = None
        self._ended_reason: str | None = None  # once set, every hello is refused with it
        self._last_refusal: str | None = None
        self._thread: threading.Thread | None = None
        # Tokenizer swaps waiting for the endpoint's thread to send frontends away: the tokenizer
        # swapped in, and the event set once the thread has acted on it.
        self._swaps_waiting: list[tuple[object, threading.Event]] = []

    # ---- the owner's side --------------------------------------------------------------------

    def start(self, executor: GenerationExecutor, model_name: str) -> None:
        self._executor = executor
        self._model_name = model_name
        self._info = self._engine_info()
        executor.foreign_sink = self._forward
        executor.tokenizer_listeners.append(self._tokenizer_replaced)
        self._thread = threading.Thread(target=self._run, name="berth-attach", daemon=True)
        self._thread.start()

    def _engine_info(self) -> EngineInfo:
        executor = self._executor
        self._info_tokenizer = executor.tokenizer  # what the info was made from
        return EngineInfo(
            limits=executor.limits,
            config=executor.config,
            model_name=self._model_name,
            model_path=str(executor.config.model),
            tokenizer_files=tokenizer_files(executor.tokenizer),
            engine_pid=executor.engine_pid,
        )

    def close(self) -> None:
        """Tells every frontend its attachment is over, then closes the endpoint."""
        if self._thread is not None and self._thread.is_alive():
            self._outbox.post_stop()
            self._thread.join(5)
        if self._executor is not None:
            self._executor.foreign_sink = None
            with contextlib.suppress(ValueError):
                self._executor.tokenizer_listeners.remove(self._tokenizer_replaced)
        self._monitor.close(linger=0)
        self._router.close(linger_ms=1000)  # the last word to each frontend must get out
        self._outbox.close()
        self._context.term()

    @property
    def idle(self) -> bool:
        """No frontend's request is in the engine (the drain before a shutdown waits for this)."""
        with self._sessions_lock:
            return not any(session.live for session in self._sessions.values())

    def abort_all(self) -> None:
        """Aborts every frontend's requests in the engine (a drain's timeout has passed): each
        ends with finish_reason "abort", and its frontend hears so before the attachment ends."""
        with self._sessions_lock:
            live = [request_id for session in self._sessions.values() for request_id in session.live]
        for request_id in live:
            self._executor.abort(request_id)

    def _owner_stats(self) -> EngineStats | None:
        return self._as_owner_says(self._executor.stats)

    def _as_owner_says(self, stats: EngineStats | None) -> EngineStats | None:
        """The engine's stats with the owner's admission state: frontends follow the owner's
        decision (a drain before its shutdown closes admission before the engine's own state
        changes), whichever way the stats reach them."""
        admission = self._executor.admission_state
        if stats is None or stats.admission == admission:
            return stats
        return dataclasses.replace(stats, admission=admission)

    def _tokenizer_replaced(self, tokenizer) -> None:
        """The executor swapped its tokenizer (a wakeup with another revision, while the engine
        is parked): returns once the endpoint's thread has sent away every frontend attached with
        another one (`_model_swapped`), so none of their requests reaches the engine after it
        admits again."""
        done = threading.Event()
        with self._sessions_lock:
            self._swaps_waiting.append((tokenizer, done))
        if self._thread is not None and self._thread.is_alive() and not done.wait(SWAP_TIMEOUT):
            logger.error("the attach endpoint did not act on a tokenizer swap in %.0f s", SWAP_TIMEOUT)

    # ---- other threads hand frames over --------------------------------------------------------

    def _forward(self, responses: dict[int, list[Response | SequenceUpdate]], stats) -> None:
        """The dispatch thread: each frontend's share of a step goes on its own lane."""
        stats = self._as_owner_says(stats)
        for frontend_id, mine in responses.items():
            with self._sessions_lock:
                session = self._by_frontend.get(frontend_id)
                if session is None:
                    continue  # gone: its requests were aborted and nobody waits for these
                session.answered(mine)
            self._outbox.post([session.routing_id, *self._router.sign(StepResults(mine, stats))])

    # ---- the endpoint's thread -------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._router.socket, self._outbox.reader, self._monitor):
            poller.register(sock, zmq.POLLIN)
        next_heartbeat = time.monotonic()
        probe_until = 0.0
        admission = self._executor.admission_state
        try:
            while True:
                now = time.monotonic()
                probing = now < probe_until
                wait = PROBE_INTERVAL if probing else min(TICK_SECONDS, max(0.0, next_heartbeat - now))
                ready = dict(poller.poll(wait * 1000))
                if self._outbox.reader in ready and not self._send_outbox():
                    break
                if self._router.socket in ready:
                    self._receive()
                if self._monitor in ready:
                    self._drain_monitor()
                    probe_until = time.monotonic() + PROBE_SECONDS
                self._check_engine()
                self._swaps_done()
                now = time.monotonic()
                # A change of admission (a drain starts) reaches every frontend at once: each
                # stops being ready then, not a heartbeat later.
                previous, admission = admission, self._executor.admission_state
                if probing or admission != previous or now >= next_heartbeat:
                    self._heartbeat(now)
                    next_heartbeat = now + HEARTBEAT_SECONDS
            self._end_all("the engine's owner has stopped serving frontends", engine_dead=False)
        except Exception:
            logger.exception("the attach endpoint failed: frontends can no longer attach")
            with contextlib.suppress(Exception):  # they would otherwise wait for a heartbeat timeout
                self._end_all("the engine's owner failed to serve frontends", engine_dead=False)

    def _send_outbox(self) -> bool:
        """Sends what other threads handed over; False once told to stop."""
        for frames in self._outbox.take():
            if ipc.Outbox.is_stop(frames):
                return False
            self._send_frames(frames[0], frames[1:])
        return True

    def _send(self, routing_id: bytes, message: object) -> None:
        self._send_frames(routing_id, self._router.sign(message))

    def _send_frames(self, routing_id: bytes, frames: list[bytes]) -> None:
        try:
            self._router.send_frames(frames, routing_id=routing_id)
        except zmq.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:
                raise
            session = self._sessions.get(routing_id)
            if session is not None:
                self._gone(session, "its connection closed")

    def _receive(self) -> None:
        while True:
            try:
                frames = self._router.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            routing_id = frames[0].bytes
            origin = _peer_address(frames[-1])
            message = self._router.verify([frame.bytes for frame in frames[1:]], origin)
            if message is not ipc.DROPPED:
                self._handle(routing_id, message, origin)

    def _handle(self, routing_id: bytes, message: object, origin: str) -> None:
        if isinstance(message, AttachHello):
            self._hello(routing_id, message, origin)
            return
        session = self._sessions.get(routing_id)
        if session is None:  # it was taken for gone (its requests were aborted): it must know
            reason = "this frontend is not attached (the owner took it for gone, or restarted)"
            self._send(routing_id, AttachmentEnded(reason, engine_dead=False))
            return
        session.last_heard = time.monotonic()
        if isinstance(message, GenerationRequest):
            self._submit(session, message)
        elif isinstance(message, AbortRequest):
            if frontend_of(message.request_id) == session.frontend_id:
                self._executor.abort(message.request_id, message.seq_index)
        elif isinstance(message, Detach):
            self._gone(session, "it detached")
        elif not isinstance(message, Heartbeat):
            logger.warning(
                "unexpected message from frontend %d: %r", session.frontend_id, type(message).__name__
            )

    def _hello(self, routing_id: bytes, hello: AttachHello, origin: str) -> None:
        old = self._sessions.get(routing_id)
        if old is not None:
            self._gone(old, "it attached again")
        refusal = self._refusal(hello)
        if refusal is not None:
            if refusal != self._last_refusal:  # a frontend asks again every second: log it once
                logger.info(
                    "refused a frontend (pid %s on %s, %s): %s", hello.pid, hello.host, origin, refusal
                )
                self._last_refusal = refusal
            self._send(routing_id, AttachRefused(refusal))
            return
        session = _Session(
            self._allocate_frontend_id(),
            routing_id,
            f"pid {hello.pid} on {hello.host} ({origin})",
            time.monotonic(),
        )
        with self._sessions_lock:
            self._sessions[routing_id] = session
            self._by_frontend[session.frontend_id] = session
        executor = self._executor
        welcome = AttachWelcome(
            session.frontend_id,
            self._info,
            self._as_owner_says(executor.stats),
            executor.admission_state,
            HEARTBEAT_SECONDS,
            HEARTBEAT_TIMEOUT,
        )
        logger.info("frontend %d attached: %s", session.frontend_id, session.who)
        self._send(routing_id, welcome)

    def _refusal(self, hello: AttachHello) -> str | None:
        if hello.protocol != ATTACH_PROTOCOL:
            return (
                f"attach protocol {hello.protocol} is not this engine's ({ATTACH_PROTOCOL}): "
                "run the same berth version as the engine's owner"
            )
        if self._ended_reason is not None:
            return self._ended_reason
        if self._executor.is_closed or self._executor.admission_state == "shutdown":
            return "the engine's owner is shutting down"
        if len(self._sessions) >= MAX_FRONTEND_ID:
            return f"this engine already serves {MAX_FRONTEND_ID} frontends"
        return None

    def _allocate_frontend_id(self) -> int:
        # Never an id in use, and not one used recently either: the engine may still hold
        # requests of a frontend that just left, whose ids a newcomer must not repeat.
        while True:
            candidate = self._next_frontend_id
            self._next_frontend_id = candidate % MAX_FRONTEND_ID + 1
            if candidate not in self._by_frontend:
                return candidate

    def _submit(self, session: _Session, request: GenerationRequest) -> None:
        if frontend_of(request.request_id) != session.frontend_id:
            error = RequestError(
                f"request id {request.request_id} is not in frontend {session.frontend_id}'s namespace",
                "internal",
            )
            self._send(
                session.routing_id,
                StepResults([Response(request.request_id, 0, [], error=error)], self._owner_stats()),
            )
            return
        with self._sessions_lock:  # before it is sent: its first response may come back at once
            session.live[request.request_id] = request.sampling_params.n
        try:
            self._executor.forward(request)
        except (RequestError, EngineDeadError) as error:
            with self._sessions_lock:
                session.live.pop(request.request_id, None)
            if not isinstance(error, RequestError):  # dead (everyone hears it at once), or shutting down
                error = RequestError(str(error), "admission_closed")
            response = Response(request.request_id, 0, [], error=error)
            self._send(session.routing_id, StepResults([response], self._owner_stats()))

    def _gone(self, session: _Session, why: str) -> None:
        """The frontend is gone: its requests still in the engine are aborted, nothing else."""
        with self._sessions_lock:
            if self._sessions.get(session.routing_id) is not session:
                return
            del self._sessions[session.routing_id]
            del self._by_frontend[session.frontend_id]
            live = list(session.live)
        for request_id in live:
            self._executor.abort(request_id)
        logger.warning(
            "frontend %d (%s) is gone (%s): aborted its %d requests in the engine",
            session.frontend_id,
            session.who,
            why,
            len(live),
        )

    def _drain_monitor(self) -> None:
        # A connection closed. Which frontend's is not said; the next sends to each tell
        # (EHOSTUNREACH), once the socket has processed the closing (a few milliseconds).
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _heartbeat(self, now: float) -> None:
        beat = Heartbeat(self._owner_stats(), self._executor.admission_state)
        frames = self._router.sign(beat)
        for session in list(self._sessions.values()):
            if now - session.last_heard > HEARTBEAT_TIMEOUT:
                self._gone(session, f"no word from it for {HEARTBEAT_TIMEOUT:.0f} s")
            else:
                self._send_frames(session.routing_id, frames)

    def _check_engine(self) -> None:
        # A shutdown is not checked for here: it answers every request, the frontends' too, and
        # its answers must reach them; the attachments end when the owner closes the endpoint.
        if self._ended_reason is None and self._executor.is_dead:
            self._end_all(f"the engine is dead: {self._executor.fatal_error}", engine_dead=True)
        executor = self._executor
        if (
            executor.tokenizer is not self._info_tokenizer
            or str(executor.config.model) != self._info.model_path
        ):
            self._model_swapped()

    def _swaps_done(self) -> None:
        """The swaps `_check_engine` has acted on (the info is made from their tokenizer, or a
        later swap replaced it) are done; a swap made after that check waits for the next."""
        current = self._executor.tokenizer
        with self._sessions_lock:
            done = [event for tokenizer, event in self._swaps_waiting if tokenizer is self._info_tokenizer]
            done += [event for tokenizer, event in self._swaps_waiting if tokenizer is not current]
            self._swaps_waiting = [(t, e) for t, e in self._swaps_waiting if e not in done]
        for event in done:
            event.set()

    def _model_swapped(self) -> None:
        """A wakeup swapped the weights in (`LLM.wake_up(model)`): frontends attach from now on
        to the new revision. Its tokenizer may differ: a frontend still tokenizing and
        detokenizing with the old one would answer wrong, so each must attach again for it."""
        before, self._info = self._info, self._engine_info()
        if self._info.tokenizer_files == before.tokenizer_files:
            return
        reason = "the engine's model changed to one with another tokenizer: attach again for it"
        for session in list(self._sessions.values()):
            self._gone(session, reason)
            self._send(session.routing_id, AttachmentEnded(reason, engine_dead=False))

    def _end_all(self, reason: str, *, engine_dead: bool) -> None:
        """Every attachment is over (no request to abort: the engine is dead, or its shutdown
        answers every request); hellos from now on are refused with `reason`."""
        if self._ended_reason is None:
            self._ended_reason = reason
        with self._sessions_lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self._by_frontend.clear()
        for session in sessions:
            self._send(session.routing_id, AttachmentEnded(reason, engine_dead=engine_dead))
        if sessions:
            logger.warning("told %d frontends their attachment is over: %s", len(sessions), reason)


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:
        return "an unknown address"
