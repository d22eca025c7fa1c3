"""The worker process: rank 0 owns the engine and talks to the proxy over the three queues.

    BERTH_ENGINE_KEY=<hex> python -m berth.engine.executor.worker \\
        --init-address A --result-address B --request-address C [--parent-pid P]

Everything a worker needs arrives explicitly: addresses on the command line, the key in the
environment (never on the command line, where `ps` shows it), the engine config over the signed
init queue. So the proxy can spawn it on this machine, and `mpirun` can start it on another.

Order of the handshake: identity first, then the model load (which can take minutes), then
READY. A worker that dies while loading is therefore noticed at once, not after a timeout.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import zmq

from berth.engine.config import EngineConfig
from berth.engine.executor import ipc
from berth.engine.executor.errors import RequestError
from berth.engine.executor.messages import (
    AbortRequest,
    InitFailed,
    ShutdownWorker,
    StepResults,
    WorkerClosed,
    WorkerFatal,
    WorkerIdentity,
    WorkerReady,
    portable_error,
)
from berth.engine.executor.request import GenerationRequest
from berth.engine.executor.response import Response

logger = logging.getLogger("berth.engine.executor.worker")

CONFIG_TIMEOUT_MS = 120_000  # a proxy that never answers our identity is gone
ACK_TIMEOUT_MS = 120_000
POLL_MS = 200  # how often the request loop looks up from the socket to check the engine
FLUSH_MS = 5_000  # on exit, how long unsent results may hold the process
PARENT_CHECK_SECONDS = 0.5


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("BERTH_LOG_LEVEL", "WARNING"),
        format=f"berth worker {os.getpid()}: %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.parent_pid:
        _exit_with_parent(args.parent_pid, _ipc_folder(args.request_address))
    # Ctrl-C reaches the whole terminal's process group; the proxy owns the shutdown (it lets
    # in-flight requests end), so the worker leaves only when told to or when its proxy is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    key = ipc.key_from_env()
    context = zmq.Context()
    init = ipc.open_socket(context, zmq.DEALER, args.init_address, key, ipc.INIT_STATUS, bind=False)
    requests = ipc.open_socket(context, zmq.PULL, args.request_address, key, ipc.REQUESTS, bind=True)
    results = ipc.open_socket(context, zmq.PUSH, args.result_address, key, ipc.RESULTS, bind=False)
    try:
        engine = _initialize(init, args.rank, requests.address)
        if engine is None:
            return 1
        return Worker(engine, requests, results).serve()
    finally:
        for sock in (init, requests, results):
            sock.close(linger_ms=FLUSH_MS)  # the last results and the init failure must get out
        context.term()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m berth.engine.executor.worker")
    parser.add_argument("--init-address", required=True, help="the proxy's init status queue")
    parser.add_argument("--result-address", required=True, help="the proxy's result queue")
    parser.add_argument(
        "--request-address", required=True, help="where to listen for requests (tcp://HOST:* picks a port)"
    )
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    return parser.parse_args(argv)


def _initialize(init: ipc.SignedSocket, rank: int, request_address: str):
    """The handshake; returns the loaded engine, or None after telling the proxy why not."""
    identity = WorkerIdentity(rank, os.getpid(), socket.gethostname(), request_address)
    init.send(identity)
    config = init.recv(CONFIG_TIMEOUT_MS)
    if not isinstance(config, EngineConfig):
        logger.error("no engine config from the proxy (got %r): exiting", config)
        return None
    try:  # the import too: a broken torch install is a failed start the proxy must hear about
        from berth.engine.pyexecutor.py_executor import PyExecutor

        engine = PyExecutor.launch(config)
    except BaseException as error:
        logger.exception("the engine failed to start")
        init.send(InitFailed(portable_error(error), _format(error)))
        return None
    init.send(WorkerReady(engine.stats()))
    if init.recv(ACK_TIMEOUT_MS) is None:
        logger.error("the proxy did not acknowledge READY: exiting")
        return None
    return engine


def _ipc_folder(address: str) -> Path | None:
    """The proxy's private socket folder (`ipc_addresses`), if the queues are Unix sockets."""
    if not address.startswith("ipc://"):
        return None
    folder = Path(address.removeprefix("ipc://")).parent
    return folder if folder.name.startswith(ipc.IPC_FOLDER_PREFIX) else None


def _exit_with_parent(parent_pid: int, ipc_folder: Path | None) -> None:
    """A worker outlives its proxy by at most a moment: nobody could read its results. A proxy
    that was killed could not remove its socket folder: the worker does it on the way out."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_SECONDS)
        logger.warning("the proxy process %d is gone: exiting", parent_pid)
        if ipc_folder is not None:
            shutil.rmtree(ipc_folder, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="berth-parent-watch", daemon=True).start()


class Worker:
    """Feeds the engine from the request queue and sends each step's responses back.

    The engine knows requests by its own `request_id`; the proxy knows them by `client_id`.
    This class keeps the map between the two (both ways) for as long as a request lives.
    """

    def __init__(self, engine, requests: ipc.SignedSocket, results: ipc.SignedSocket) -> None:
        self.engine = engine
        self._requests = requests
        self._results = results
        self._send_lock = threading.Lock()  # the engine thread and the request loop both send
        self._request_ids = itertools.count(1)
        self._request_of: dict[int, int] = {}  # client_id -> request_id (for aborts)
        # request_id -> [client_id, sequences not finished yet]. Written by the request loop when a
        # request arrives and by the engine thread when it ends: different keys, atomic dict ops.
        self._client_of: dict[int, list[int]] = {}
        self._engine_done = threading.Event()
        self._fatal = False

    def serve(self) -> int:
        self.engine.start(on_responses=self._send_step, on_fatal=self._on_fatal)
        try:
            self._request_loop()
        except BaseException as error:  # this loop feeds the engine: without it, the engine is dead
            logger.exception("the worker's request loop failed")
            self._on_fatal(error)
        self.engine.join(0 if self._fatal else None)
        if self._fatal:
            return 1
        with self._send_lock:
            self._results.send(WorkerClosed())
        return 0

    def _request_loop(self) -> None:
        while not self._engine_done.is_set():
            message = self._requests.recv(POLL_MS)
            if message is None:
                if self.engine.join(0):
                    break  # the loop ended without being asked to: on_fatal has said why
            elif isinstance(message, GenerationRequest):
                self._submit(message)
            elif isinstance(message, AbortRequest):
                self._abort(message.client_id, message.seq_index)
            elif isinstance(message, ShutdownWorker):
                # The loop aborts what is in flight (each client hears back), then exits.
                self.engine.request_queue.enqueue_shutdown()
                break
            else:
                logger.warning("unknown message on the request queue: %r", type(message).__name__)

    # ---- the request loop's side ---------------------------------------------------------------

    def _submit(self, request: GenerationRequest) -> None:
        client_id = request.client_id
        request_id = next(self._request_ids)
        self._client_of[request_id] = [client_id, request.sampling_params.n]
        self._request_of[client_id] = request_id
        request.client_id = request_id
        try:
            self.engine.request_queue.enqueue_request(request)
        except RequestError as error:  # fails this request only; the engine goes on
            self._forget(request_id)
            response = Response(client_id, 0, [], error=str(error), error_code=error.code)
            with self._send_lock:
                self._results.send(StepResults([response], self.engine.stats()))

    def _abort(self, client_id: int, seq_index: int | None) -> None:
        request_id = self._request_of.get(client_id)
        if request_id is None:
            logger.debug("abort for request %d, which is finished or unknown: nothing to do", client_id)
            return
        self.engine.request_queue.enqueue_abort(request_id, seq_index)

    # ---- the engine thread's side --------------------------------------------------------------

    def _send_step(self, responses: list[Response], stats) -> None:
        for response in responses:
            entry = self._client_of.get(response.client_id)
            if entry is None:
                continue  # cannot happen while the map is kept right; never send a stranger's id
            request_id, response.client_id = response.client_id, entry[0]
            if response.error is not None:
                entry[1] = 0  # an error ends every sequence of the request
            elif response.finish_reason is not None:
                entry[1] -= 1
            if entry[1] <= 0:
                self._forget(request_id)
        with self._send_lock:
            self._results.send(StepResults(responses, stats))

    def _on_fatal(self, error: BaseException) -> None:
        self._fatal = True
        try:
            with self._send_lock:
                self._results.send(WorkerFatal(portable_error(error), _format(error)))
        finally:
            self._engine_done.set()

    def _forget(self, request_id: int) -> None:
        entry = self._client_of.pop(request_id, None)
        if entry is not None and self._request_of.get(entry[0]) == request_id:
            del self._request_of[entry[0]]


def _format(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


if __name__ == "__main__":
    sys.exit(main())
