"""The default shape: a proxy in the caller's process, the engine in a worker process.

The caller's process keeps the Python-heavy client work (tokenizing, detokenizing, streaming,
an HTTP server); the worker runs the engine loop undisturbed by it. They talk over three
signed ZeroMQ queues (see `ipc.py`, `messages.py`, `worker.py`):

    requests     proxy -> worker   requests, aborts, the shutdown sentinel, in one order
    results      worker -> proxy   one message per engine step, with the engine's stats
    init status  worker <-> proxy  identity, config, READY or the failure, ACK

Death of the worker is noticed twice over: a watcher thread waits on the process (the event)
and the dispatch thread checks the worker's pid every few seconds (the backstop).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from berth.engine.config import EngineConfig
from berth.engine.executor import ipc
from berth.engine.executor.errors import EngineDeadError, RemoteTraceback, WorkerDiedError, how_it_exited
from berth.engine.executor.executor import GenerationExecutor
from berth.engine.executor.messages import (
    AbortRequest,
    Ack,
    InitFailed,
    ShutdownWorker,
    StepResults,
    WorkerClosed,
    WorkerFatal,
    WorkerIdentity,
    WorkerReady,
)
from berth.engine.executor.request import GenerationRequest

logger = logging.getLogger(__name__)

# A live worker may need long to release a big model; a dead or hung one is not waited for long.
LIVE_SHUTDOWN_TIMEOUT = 180.0
DEAD_SHUTDOWN_TIMEOUT = 5.0
WORKER_INIT_TIMEOUT = 900.0  # a safety net only: a worker that dies while loading is seen at once
POLL_MS = 100  # how often the dispatch thread looks up from the result queue
LIVENESS_CHECK_SECONDS = 2.0  # the polling backstop
LAST_WORDS_SECONDS = 2.0  # how long a dead worker's last messages (its root cause) may take to route


class ProxyExecutor(GenerationExecutor):
    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        *,
        transport: str = "ipc",
        init_timeout: float = WORKER_INIT_TIMEOUT,
    ) -> None:
        super().__init__(tokenizer)
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        self._key = ipc.new_key()
        self._context = zmq.Context()
        self._ipc_dir: Path | None = None
        if transport == "ipc":
            addresses, self._ipc_dir = ipc.ipc_addresses()
        else:
            addresses = ipc.tcp_addresses()
        self._init = ipc.open_socket(
            self._context, zmq.ROUTER, addresses["init_status"], self._key, ipc.INIT_STATUS, bind=True
        )
        self._results_socket = ipc.open_socket(
            self._context, zmq.PULL, addresses["results"], self._key, ipc.RESULTS, bind=True
        )
        self._requests_socket: ipc.SignedSocket | None = None  # connected once the worker says where
        self._send_lock = threading.Lock()  # client threads and the dispatch thread all send
        self._shutdown_lock = threading.Lock()
        self._closing = False  # set when shutdown starts: the worker's exit is then expected
        self._worker_gone = threading.Event()  # set by the watcher when the process has exited
        self._last_words_routed = threading.Event()  # set by the dispatcher after its final drain
        self.identities: list[WorkerIdentity] = []
        self._process: subprocess.Popen | None = None
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name="berth-proxy-dispatch", daemon=True
        )
        try:
            self._process = self._spawn_worker(self._init.address, self._results_socket.address, addresses)
            threading.Thread(target=self._watch_worker, name="berth-worker-watch", daemon=True).start()
            self._handshake(config, init_timeout)
        except BaseException as error:
            self._fail_initialization(error)
        self._dispatcher.start()
        atexit.register(self.shutdown)  # a dead or forgotten engine never hangs the interpreter's exit

    # ---- start -------------------------------------------------------------------------------

    def _spawn_worker(self, init_address: str, result_address: str, addresses: dict[str, str]):
        command = [
            sys.executable,
            "-m",
            "berth.engine.executor.worker",
            "--init-address",
            init_address,
            "--result-address",
            result_address,
            "--request-address",
            addresses["requests"],
            "--parent-pid",
            str(os.getpid()),
        ]
        env = dict(os.environ, **{ipc.KEY_ENV: self._key.hex()})
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)

    def _handshake(self, config: EngineConfig, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        routing_id, identity = self._await_init_message(deadline, "starting")
        if not isinstance(identity, WorkerIdentity):
            raise RuntimeError(f"the worker's first message must be its identity, got {identity!r}")
        self.identities.append(identity)
        self._requests_socket = ipc.open_socket(
            self._context, zmq.PUSH, identity.request_address, self._key, ipc.REQUESTS, bind=False
        )
        self._init.send(config, routing_id=routing_id)  # the answer to an identity is the config
        _, status = self._await_init_message(deadline, "loading the model")
        if isinstance(status, InitFailed):
            raise status.error from RemoteTraceback(status.traceback)
        if not isinstance(status, WorkerReady):
            raise RuntimeError(f"expected READY from the worker, got {status!r}")
        self.stats = status.stats
        self._init.send(Ack(), routing_id=routing_id)

    def _await_init_message(self, deadline: float, doing: str) -> tuple[bytes, object]:
        while True:
            received = self._init.recv(POLL_MS, with_routing_id=True)
            if received is not None:
                return received
            if self._worker_gone.is_set():
                # Its last words (an InitFailed) may still be on the way: they carry the root cause.
                received = self._init.recv(POLL_MS, with_routing_id=True)
                if received is not None:
                    return received
                raise WorkerDiedError(
                    f"the worker process {self._process.pid} {how_it_exited(self._process.returncode)} "
                    f"while {doing}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker did not finish {doing} in time")

    def _fail_initialization(self, error: BaseException) -> None:
        """Aborts the world first, then marks the engine dead, then raises the root cause."""
        self._closing = True
        try:
            self._kill_worker()
        finally:
            self._set_fatal(error)
            self._closed = True
            self._close_sockets()
        raise error

    # ---- the worker's liveness -----------------------------------------------------------------

    def _watch_worker(self) -> None:
        """The event: wakes the moment the worker process exits."""
        code = self._process.wait()
        self._worker_gone.set()
        if self._closing:
            if code != 0 and not self.is_dead:
                logger.warning(
                    "the worker process %d %s during shutdown", self._process.pid, how_it_exited(code)
                )
            return
        # The root cause (a WorkerFatal) may be queued just before the exit: let it win.
        self._last_words_routed.wait(LAST_WORDS_SECONDS)
        self._set_fatal(WorkerDiedError(f"the worker process {self._process.pid} {how_it_exited(code)}"))

    def _check_workers(self) -> None:
        """The backstop: a worker whose pid is gone is dead, whatever else was (not) noticed."""
        if self._closing or self._worker_gone.is_set():
            return  # expected, or the watcher is already recording it
        here = socket.gethostname()
        for identity in self.identities:
            if identity.host == here and not _pid_alive(identity.pid):
                self._set_fatal(WorkerDiedError(f"the worker process {identity.pid} is gone"))

    def _kill_worker(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._worker_gone.wait(DEAD_SHUTDOWN_TIMEOUT)

    # ---- sending -------------------------------------------------------------------------------

    def _send(self, message: object) -> bool:
        """False once the executor is closed (the socket is gone)."""
        with self._send_lock:
            if self._requests_socket is None:
                return False
            self._requests_socket.send(message)
            return True

    def _send_request(self, request: GenerationRequest) -> None:
        if not self._send(request):
            raise EngineDeadError("the executor has been shut down")

    def _send_abort(self, client_id: int, seq_index: int | None) -> None:
        self._send(AbortRequest(client_id, seq_index))  # after shutdown there is nothing to abort

    # ---- receiving ---------------------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        next_check = time.monotonic() + LIVENESS_CHECK_SECONDS
        try:
            while True:
                first = self._results_socket.recv(POLL_MS)
                if first is None:
                    if self._worker_gone.is_set():  # nothing more can come: route the stragglers
                        self._route(self._results_socket.recv_nowait_all())
                        return
                elif not self._route([first, *self._results_socket.recv_nowait_all()]):
                    return
                if time.monotonic() > next_check:
                    self._check_workers()
                    next_check = time.monotonic() + LIVENESS_CHECK_SECONDS
        except BaseException as error:  # a broken dispatcher leaves every result hanging: fatal
            logger.exception("the proxy's dispatch thread failed")
            self._set_fatal(error)
        finally:
            self._last_words_routed.set()

    def _route(self, messages: list) -> bool:
        """Dispatches everything received in one go (one wake-up per asyncio loop); False once the
        worker has said its last word."""
        batches = [(m.responses, m.stats) for m in messages if isinstance(m, StepResults)]
        if batches:
            self._dispatch(batches)
        more = True
        for message in messages:
            if isinstance(message, WorkerFatal):
                self._set_fatal(_with_remote_traceback(message.error, message.traceback))
                more = False
            elif isinstance(message, WorkerClosed):
                more = False
        return more

    # ---- state ---------------------------------------------------------------------------------

    @property
    def engine_pid(self) -> int:
        return self.identities[0].pid if self.identities else -1

    @property
    def admission_state(self) -> str:
        if self.is_dead:
            return "failed"
        return self.stats.admission if self.stats is not None else "running"

    # ---- shutdown ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True  # admission stops here: submit() refuses from now on
        atexit.unregister(self.shutdown)
        worker_can_read = self._notify_shutdown()
        self._wait_for_worker(LIVE_SHUTDOWN_TIMEOUT if worker_can_read else DEAD_SHUTDOWN_TIMEOUT)

    def _notify_shutdown(self) -> bool:
        """Step one, never blocks: the sentinel goes out only if a worker can still read it; the
        worker then aborts what is in flight and answers every request."""
        self._closing = True
        worker_can_read = not self.is_dead and not self._worker_gone.is_set()
        return worker_can_read and self._send(ShutdownWorker())

    def _wait_for_worker(self, timeout: float) -> None:
        """Step two: a live worker gets `timeout` to finish; after that it is killed (abandoned)."""
        if not self._worker_gone.wait(timeout):
            logger.error("the worker did not exit within %.0f s: killing it", timeout)
            self._set_fatal(TimeoutError(f"the worker did not stop within {timeout:.0f} s"))
            self._kill_worker()
        self._dispatcher.join(DEAD_SHUTDOWN_TIMEOUT)
        self._fail_pending(EngineDeadError("the executor was shut down"))
        if self._dispatcher.is_alive():
            logger.error("the dispatch thread did not stop: leaving its socket open")
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        with self._send_lock:
            sockets = [self._init, self._results_socket, self._requests_socket]
            self._requests_socket = None
        for sock in sockets:
            if sock is not None:
                sock.close()
        self._context.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _with_remote_traceback(error: BaseException, traceback: str) -> BaseException:
    error.__cause__ = RemoteTraceback(traceback)
    return error


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited process nobody has reaped yet still answers kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
