"""The attached shape: serving an engine another process owns, through its attach endpoint.

    FrontendExecutor   outlives worlds: attaches, notices the end of an attachment, attaches
                       again (to the next owner at the same address), without a restart
    Attachment         one attachment to one engine: a GenerationExecutor like the others,
                       whose death (the engine's, or the loss of its owner) is sticky

An attachment is one DEALER connection to the owner (see `attach.py`): requests and aborts
go out on it, and it is this frontend's result lane. Its request ids carry the frontend id
the owner gave it in their high bits. Closing it detaches: the owner aborts the requests it
still runs; the engine itself is never this process's to stop.

The owner's death is seen at once (the connection's monitor reports it closed) or, for an
owner that falls silent, after `heartbeat_timeout`; either fails every pending request with
`EngineUnreachableError` (an `EngineDeadError`: a 503 for the server) and starts reattaching.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import zmq

from berth.engine.engine_io import (
    AbortRequest,
    Control,
    EngineLimits,
    EngineStats,
    GenerationRequest,
    TransitionError,
)
from berth.engine.executor import ipc
from berth.engine.executor.errors import EngineDeadError, EngineUnreachableError
from berth.engine.executor.executor import GenerationExecutor
from berth.engine.executor.messages import (
    ATTACH_PROTOCOL,
    AttachHello,
    AttachmentEnded,
    AttachRefused,
    AttachWelcome,
    Detach,
    EngineInfo,
    Heartbeat,
    StepResults,
)
from berth.engine.executor.result import GenerationResult
from berth.engine.tokenizer import write_tokenizer_files

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT = 10.0  # how long an owner may take to answer a hello (its welcome holds the tokenizer)
RETRY_SECONDS = 1.0  # between two attempts to attach
MAX_WAIT_MS = 1000


class Attachment(GenerationExecutor):
    def __init__(
        self,
        address: str,
        context: zmq.Context,
        sock: ipc.SignedSocket,
        welcome: AttachWelcome,
        tokenizer,
    ) -> None:
        super().__init__(tokenizer)
        self.address = address
        self.frontend_id = welcome.frontend_id
        self.info: EngineInfo = welcome.info
        self.config = welcome.info.config
        self.limits = welcome.info.limits
        self._stats = welcome.stats
        self._admission = welcome.admission
        self._heartbeat_seconds = welcome.heartbeat_seconds
        self._heartbeat_timeout = welcome.heartbeat_timeout
        self._socket = sock
        self._monitor = sock.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # Client threads hand their signed messages to the attachment's thread, the only one
        # that touches the connection.
        self._outbox = ipc.Outbox(context)
        self.ended = threading.Event()  # set once this attachment is over, whatever ended it
        self._thread = threading.Thread(
            target=self._run, name=f"berth-attachment-{self.frontend_id}", daemon=True
        )
        self._thread.start()

    # ---- GenerationExecutor -------------------------------------------------------------------

    @property
    def engine_pid(self) -> int:
        return self.info.engine_pid

    def _engine_admission_state(self) -> str:
        return self._admission

    def _send_request(self, request: GenerationRequest) -> None:
        if not self._outbox.post(self._socket.sign(request)):
            raise EngineDeadError("the attachment is closed")

    def _send_abort(self, request_id: int, seq_index: int | None) -> None:
        self._outbox.post(self._socket.sign(AbortRequest(request_id, seq_index)))

    def _send_control(self, control: Control) -> None:
        raise TransitionError(
            f"a frontend cannot {control.kind} the engine at {self.address}: its owner does that",
            "not_engine_owner",
            self.admission_state,
        )

    def shutdown(self) -> None:
        """Detaches (the owner aborts this frontend's requests still in the engine)."""
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True  # admission stops here
        if not self.ended.is_set():
            self._outbox.post(self._socket.sign(Detach()))
            self._outbox.post_stop()  # the thread sends the Detach, then stops
        self._thread.join(5)
        self._fail_pending(EngineDeadError("this frontend was shut down"))

    # ---- the attachment's thread -----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._socket.socket, self._outbox.reader, self._monitor):
            poller.register(sock, zmq.POLLIN)
        last_heard = next_heartbeat = time.monotonic()
        owner = self.address
        try:
            while True:
                wait = max(0.0, min(next_heartbeat - time.monotonic(), MAX_WAIT_MS / 1000))
                ready = dict(poller.poll(wait * 1000))
                if self._outbox.reader in ready and not self._send_outbox():
                    return  # shutdown: the Detach is out
                if self._socket.socket in ready:
                    last_heard = time.monotonic()
                    self._receive()
                if self._monitor in ready:
                    raise EngineUnreachableError(f"lost the connection to the engine's owner at {owner}")
                now = time.monotonic()
                if now - last_heard > self._heartbeat_timeout:
                    silence = self._heartbeat_timeout
                    raise EngineUnreachableError(
                        f"no word from the engine's owner at {owner} for {silence:.0f} s"
                    )
                if now >= next_heartbeat:
                    self._socket.send(Heartbeat())
                    next_heartbeat = now + self._heartbeat_seconds
        except BaseException as error:
            if not isinstance(error, EngineDeadError):
                logger.exception("the attachment to %s failed", self.address)
            self._set_fatal(error)
        finally:
            self._outbox.close()
            self._monitor.close(linger=0)
            self._socket.close(linger_ms=1000)
            self.ended.set()

    def _send_outbox(self) -> bool:
        for frames in self._outbox.take():
            if ipc.Outbox.is_stop(frames):
                return False
            self._socket.send_frames(frames)
        return True

    def _receive(self) -> None:
        """Routes everything waiting, in one go; raises once the owner has ended the attachment."""
        batches = []
        for message in self._socket.recv_nowait_all():
            if isinstance(message, StepResults):
                batches.append((message.responses, message.stats))
                # A heartbeat may have brought a newer state already: the latest snapshot wins.
                if self._stats is None or message.stats.seq >= self._stats.seq:
                    self._admission = message.stats.admission
            elif isinstance(message, Heartbeat):
                if message.stats is not None:
                    self._take_stats(message.stats)
                if message.admission is not None:
                    self._admission = message.admission
            elif isinstance(message, AttachmentEnded):
                if batches:
                    self._dispatch(batches)
                raise EngineUnreachableError(message.reason)
        if batches:
            self._dispatch(batches)


class FrontendExecutor:
    """The executor of an attached frontend: the current attachment, and the next one.

    It answers what any executor does (submit, check_health, stats, admission_state, ...) for
    the engine it is attached to now; while it is attached to none, the engine is "dead" for
    it (`EngineUnreachableError`, with the reason) and a thread keeps trying to attach.
    """

    def __init__(self, address: str, key: bytes, *, retry_seconds: float = RETRY_SECONDS) -> None:
        self.address = address
        self._key = key
        self._retry_seconds = retry_seconds
        self._context = zmq.Context()
        self._attachment: Attachment | None = None
        self._reason: BaseException = EngineUnreachableError(f"not attached to {address} yet")
        self._attached = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self.info: EngineInfo | None = None
        self.tokenizer = None
        self.limits: EngineLimits | None = None
        self._tokenizer_folders: list[Path] = []
        self._thread = threading.Thread(target=self._attach_forever, name="berth-reattach", daemon=True)
        self._thread.start()

    # ---- attaching --------------------------------------------------------------------------------

    def wait_attached(self, timeout: float | None = None) -> bool:
        return self._attached.wait(timeout)

    def _attach_forever(self) -> None:
        last_logged = None
        while not self._stop.is_set():
            try:
                attachment = self._attach_once()
            except Exception as error:
                if not isinstance(error, EngineUnreachableError):  # a bug, or a broken tokenizer
                    logger.exception("attaching to %s failed", self.address)
                    error = EngineUnreachableError(f"attaching to {self.address} failed: {error}")
                self._reason = error
                if str(error) != last_logged:  # once per reason, not once a second
                    logger.warning("cannot attach: %s; trying again every %.0f s", error, self._retry_seconds)
                    last_logged = str(error)
                self._stop.wait(self._retry_seconds)
                continue
            last_logged = None
            self._attachment = attachment
            self._attached.set()
            logger.info(
                "attached to %s as frontend %d (engine pid %d)",
                self.address,
                attachment.frontend_id,
                attachment.engine_pid,
            )
            while not attachment.ended.wait(0.5):
                if self._stop.is_set():
                    return
            self._attached.clear()
            self._reason = attachment.fatal_error or EngineUnreachableError("the attachment ended")
            self._attachment = None
            attachment.shutdown()  # already over: this only releases what it holds
            if not self._stop.is_set():
                logger.warning("detached from %s: %s; attaching again", self.address, self._reason)

    def _attach_once(self) -> Attachment:
        sock = ipc.open_socket(self._context, zmq.DEALER, self.address, self._key, ipc.ATTACH, bind=False)
        try:
            sock.send(AttachHello(ATTACH_PROTOCOL, os.getpid(), socket.gethostname()))
            answer = sock.recv(int(ATTACH_TIMEOUT * 1000))
            if answer is None:
                raise EngineUnreachableError(
                    f"no answer from {self.address} in {ATTACH_TIMEOUT:.0f} s: is the engine's owner up, "
                    "and is BERTH_ENGINE_KEY its key? (it drops what another key signed)"
                )
            if isinstance(answer, AttachRefused):
                raise EngineUnreachableError(
                    f"the engine at {self.address} refused to attach: {answer.reason}"
                )
            if not isinstance(answer, AttachWelcome):
                raise EngineUnreachableError(
                    f"unexpected answer from {self.address}: {type(answer).__name__}"
                )
            tokenizer = self._tokenizer_for(answer.info)
            attachment = Attachment(self.address, self._context, sock, answer, tokenizer)
        except BaseException:
            sock.close()
            raise
        self.info, self.limits = answer.info, answer.info.limits
        return attachment

    def _tokenizer_for(self, info: EngineInfo):
        """The owner's tokenizer, rebuilt from its files (kept while they do not change)."""
        if (
            self.tokenizer is not None
            and self.info is not None
            and self.info.tokenizer_files == info.tokenizer_files
        ):
            return self.tokenizer
        folder = Path(tempfile.mkdtemp(prefix="berth-frontend-tokenizer-"))
        self._tokenizer_folders.append(folder)
        self.tokenizer = write_tokenizer_files(info.tokenizer_files, folder)
        return self.tokenizer

    # ---- what any executor answers ----------------------------------------------------------------

    @property
    def current(self) -> Attachment | None:
        return self._attachment

    @property
    def config(self):
        return self.info.config if self.info is not None else None

    @property
    def frontend_id(self) -> int | None:
        attachment = self._attachment
        return attachment.frontend_id if attachment is not None else None

    def submit(
        self, request: GenerationRequest, *, prompt: str | None = None, tokenized_with=None
    ) -> GenerationResult:
        attachment = self._attachment
        if self._closed:
            raise EngineDeadError("the executor has been shut down")
        if attachment is None:
            raise EngineUnreachableError(f"{self._reason} (this frontend attaches again by itself)")
        # A prompt tokenized before the owner swapped the model in is refused by the attachment
        # for the new tokenizer: its tokenizer is not the one the prompt was tokenized with.
        return attachment.submit(request, prompt=prompt, tokenized_with=tokenized_with)

    def abort(self, request_id: int, seq_index: int | None = None) -> None:
        attachment = self._attachment
        if attachment is not None:
            attachment.abort(request_id, seq_index)

    def check_health(self) -> bool:
        attachment = self._attachment
        return not self._closed and attachment is not None and attachment.check_health()

    @property
    def is_dead(self) -> bool:
        attachment = self._attachment
        return attachment is None or attachment.is_dead

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def fatal_error(self) -> BaseException | None:
        attachment = self._attachment
        return attachment.fatal_error if attachment is not None else self._reason

    @property
    def stats(self) -> EngineStats | None:
        attachment = self._attachment
        if attachment is None:
            return EngineStats.of_dead_engine(self.limits.num_kv_blocks if self.limits else 0)
        return attachment.stats

    @property
    def model_revision(self):
        attachment = self._attachment
        return attachment.model_revision if attachment is not None else None

    @property
    def admission_state(self) -> str:
        attachment = self._attachment
        if self._closed:
            return "shutdown"
        return attachment.admission_state if attachment is not None else "failed"

    @property
    def num_pending(self) -> int:
        attachment = self._attachment
        return attachment.num_pending if attachment is not None else 0

    @property
    def engine_pid(self) -> int:
        attachment = self._attachment
        return attachment.engine_pid if attachment is not None else -1

    def shutdown(self) -> None:
        """Detaches and stops attaching; the engine goes on serving its owner and the others."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(ATTACH_TIMEOUT + 5)
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            attachment.shutdown()
        # Closes what a stuck thread may still hold, each socket with its linger (the Detach
        # must get out), instead of waiting for them forever.
        self._context.destroy()
        for folder in self._tokenizer_folders:
            shutil.rmtree(folder, ignore_errors=True)
