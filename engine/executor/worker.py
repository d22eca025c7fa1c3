"""The worker process: rank 0 owns the engine and talks to the proxy over the three queues.

    BERTH_ENGINE_KEY=<hex> python -m berth.engine.executor.worker \\
        --init-address A --result-address B --request-address C [--parent-pid P]
    BERTH_ENGINE_KEY=<hex> mpiexec -n N python -m berth.engine.executor.worker ... --world-size N

Everything a worker needs arrives explicitly: addresses on the command line, the key in the
environment (never on the command line, where `ps` shows it), the engine config over the signed
init queue. So the proxy can spawn it on this machine, and `mpirun` can start it on another.

Results go back on one lane, raw, to the proxy; or, with postprocess workers, on one lane per
postprocess worker, each carrying the responses of the requests pinned to it (request_id % N),
and each the result of every sleep / wakeup and the worker's last word, behind them.

Order of the handshake: identity first, then the model load (which can take minutes), then
READY. A worker that dies while loading is therefore noticed at once, not after a timeout.
Torch's import (seconds) comes between the identity and the setup: it overlaps the proxy's own
start (its tokenizer), and a failed import is reported as a failed start once the setup is in.

In an MPI world (tensor parallelism) every rank runs this module; rank 0 alone talks to the
proxy. It names every rank's process in its identity, hands the config to the others, and each
rank then loads its shard (`mpi_rank.py`, `pyexecutor/rank.py`); the others follow rank 0's
steps until it stops them (an ordered shutdown) or the world is aborted (any other end).
"""

from __future__ import annotations

import argparse
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

from berth.engine.engine_io import (
    AbortRequest,
    Control,
    GenerationRequest,
    RequestError,
    Response,
    Shutdown,
    Sleep,
    TransitionError,
    TransitionResult,
    Wakeup,
)
from berth.engine.executor import ipc
from berth.engine.executor.messages import (
    InitFailed,
    LaneStep,
    LaneTokenizer,
    StepResults,
    WakeupWithTokenizer,
    WorkerClosed,
    WorkerFatal,
    WorkerIdentity,
    WorkerReady,
    WorkerSetup,
    portable_error,
)
from berth.engine.executor.processes import pid_alive

logger = logging.getLogger("berth.engine.executor.worker")

CONFIG_TIMEOUT_MS = 120_000  # a proxy that never answers our identity is gone
ACK_TIMEOUT_MS = 120_000
POLL_MS = 200  # how often the request loop looks up from the socket to check the engine
FLUSH_MS = 5_000  # on exit, how long unsent results may hold the process
PARENT_CHECK_SECONDS = 0.5
LEADER_REPORT_SECONDS = 30  # a failed start: how long the other ranks leave rank 0 to report it


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    world = None
    if args.world_size > 1:
        from berth.engine.executor.mpi_rank import MpiRank

        world = MpiRank(args.world_size)
    # A rank on another host than the proxy cannot watch its pid (mpiexec ends it instead).
    watches = args.parent_pid and (args.parent_host is None or args.parent_host == socket.gethostname())
    key = start_as_child(
        f"berth worker {os.getpid()}",
        args.parent_pid if watches else 0,
        _ipc_folder(args.request_address),
        # Started by mpiexec (which passes the parent's host), the proxy is not the parent.
        by_pid=args.parent_host is not None,
        end=world.abort if world is not None else os._exit,
    )
    if world is not None and not world.is_leader:
        code = _follow(world)
    else:
        code = _lead(args, key, world)
        if code and world is not None:
            # The proxy has heard why (the sockets are flushed by now); the other ranks may be
            # waiting for this one in a collective that will never complete.
            world.abort(code)
    if world is not None and "torch.distributed" in sys.modules:
        from berth.engine.pyexecutor.rank import leave_world

        leave_world()  # on every way out, a failed start's too
    return code


def _lead(args: argparse.Namespace, key: bytes, world) -> int:
    """Rank 0 (or the only rank): the engine, fed from the proxy's queues."""
    context = zmq.Context()
    init = ipc.open_socket(context, zmq.DEALER, args.init_address, key, ipc.INIT_STATUS, bind=False)
    requests = ipc.open_socket(context, zmq.PULL, args.request_address, key, ipc.REQUESTS, bind=True)
    results = ipc.open_socket(context, zmq.PUSH, args.result_address, key, ipc.RESULTS, bind=False)
    lanes: list[ipc.SignedSocket] = []
    try:
        started = _initialize(init, ipc.reachable(requests.address, socket.getfqdn()), world)
        if started is None:
            return 1
        engine, setup = started
        lanes = [
            ipc.open_socket(context, zmq.PUSH, address, key, ipc.LANE, bind=False)
            for address in setup.result_lanes
        ]
        return Worker(engine, requests, lanes or [results], postprocessed=bool(lanes)).serve()
    finally:
        for sock in (init, requests, results, *lanes):
            sock.close(linger_ms=FLUSH_MS)  # the last results and the init failure must get out
        context.term()


def start_as_child(
    name: str, parent_pid: int, ipc_folder: Path | None, *, by_pid: bool = False, end=os._exit
) -> bytes:
    """What a process the proxy starts (a worker, a rank, a postprocess worker) does first: log
    as `name`, leave with its parent (`exit_with_parent`), ignore Ctrl-C; returns the engine's key."""
    logging.basicConfig(
        level=os.environ.get("BERTH_LOG_LEVEL", "WARNING"),
        format=f"{name}: %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if parent_pid:
        exit_with_parent(parent_pid, ipc_folder, by_pid, end)
    # Ctrl-C reaches the whole terminal's process group; the proxy owns the shutdown (it lets
    # in-flight requests end), so a child leaves only when told to or when its proxy is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return ipc.key_from_env()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m berth.engine.executor.worker")
    parser.add_argument("--init-address", required=True, help="the proxy's init status queue")
    parser.add_argument("--result-address", required=True, help="the proxy's result queue")
    parser.add_argument(
        "--request-address", required=True, help="where to listen for requests (tcp://HOST:* picks a port)"
    )
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    parser.add_argument(
        "--parent-host", help="the host the parent runs on: ranks elsewhere cannot watch it (default: here)"
    )
    parser.add_argument(
        "--world-size", type=int, default=1, help="ranks of the MPI world this process is one of (mpiexec -n)"
    )
    return parser.parse_args(argv)


def _initialize(init: ipc.SignedSocket, request_address: str, world):
    """The handshake; returns the loaded engine and its setup, or None after telling the proxy
    why not."""
    members = world.members() if world is not None else ((0, os.getpid(), socket.gethostname()),)
    init.send(WorkerIdentity(0, os.getpid(), socket.gethostname(), request_address, world=members))
    engine_class = _import_engine()  # while the proxy gets its setup ready
    setup = init.recv(CONFIG_TIMEOUT_MS)
    if not isinstance(setup, WorkerSetup):
        setup = None
    if world is not None:
        world.share(setup.config if setup is not None else None)  # None: the other ranks leave
    if setup is None:
        logger.error("no engine setup from the proxy: exiting")
        return None
    try:  # a broken torch install too is a failed start the proxy must hear about
        if isinstance(engine_class, BaseException):
            raise engine_class
        # While it loads, the proxy hears how far it has come (the init socket is idle until READY).
        if world is None:
            engine = engine_class.launch(setup.config, on_progress=init.send)
        else:
            engine = engine_class.launch(*world.join_collectives(setup.config), on_progress=init.send)
    except BaseException as error:
        logger.exception("the engine failed to start")
        # Another rank's failure carries that rank's own traceback.
        trace = getattr(error, "rank_traceback", "") or _format(error)
        init.send(InitFailed(portable_error(error), trace))
        return None
    init.send(WorkerReady(engine.limits, engine.stats()))
    if init.recv(ACK_TIMEOUT_MS) is None:
        logger.error("the proxy did not acknowledge READY: exiting")
        return None
    return engine, setup


def _import_engine():
    """`PyExecutor`, or the error its import raised (torch's import takes seconds: a worker does
    it while the proxy still gets ready, and reports a failure once it has its setup)."""
    try:
        from berth.engine.pyexecutor.py_executor import PyExecutor
    except BaseException as error:
        return error
    return PyExecutor


def _follow(world) -> int:
    """A rank other than 0: builds its shard and runs the steps rank 0 broadcasts."""
    world.members()
    try:  # while rank 0 waits for the config: torch's import takes seconds
        from berth.engine.pyexecutor.rank import build_rank, follow
    except BaseException:
        logger.exception("rank %d could not import the engine", world.rank)
        world.abort(1)
    config = world.share(None)
    if config is None:
        return 1  # rank 0 got no config: the world does not start
    try:
        config, tp = world.join_collectives(config)
    except BaseException:
        logger.exception("rank %d could not join the world", world.rank)
        world.abort(1)
    try:
        runner, _ = build_rank(config, tp)
    except Exception:
        # Every rank heard of it (build_rank shares failures) and rank 0 tells the proxy, then
        # ends the world. A rank that left first would have mpiexec end rank 0 before its report
        # is out, and the proxy would hear "killed" instead of why: wait to be ended.
        logger.exception("rank %d: the world failed to start", world.rank)
        time.sleep(LEADER_REPORT_SECONDS)
        return 1
    try:
        follow(runner, config)
    except BaseException:
        logger.exception("rank %d failed", world.rank)
        world.abort(1)
    return 0


def _ipc_folder(address: str) -> Path | None:
    """The proxy's private socket folder (`ipc_addresses`), if the queues are Unix sockets."""
    if not address.startswith("ipc://"):
        return None
    folder = Path(address.removeprefix("ipc://")).parent
    return folder if folder.name.startswith(ipc.IPC_FOLDER_PREFIX) else None


def exit_with_parent(parent_pid: int, ipc_folder: Path | None, by_pid: bool = False, end=os._exit) -> None:
    """A worker outlives its proxy by at most a moment: nobody could read its results. A proxy
    that was killed could not remove its socket folder: the worker does it on the way out.
    A rank of an MPI world is not the proxy's child (mpiexec's hydra proxy is its parent): it
    watches the proxy's pid instead, and ends the whole world (`end`) when it is gone."""

    def proxy_alive() -> bool:
        return pid_alive(parent_pid) if by_pid else os.getppid() == parent_pid

    def watch() -> None:
        while proxy_alive():
            time.sleep(PARENT_CHECK_SECONDS)
        logger.warning("the proxy process %d is gone: exiting", parent_pid)
        if ipc_folder is not None:
            shutil.rmtree(ipc_folder, ignore_errors=True)
        end(1)

    threading.Thread(target=watch, name="berth-parent-watch", daemon=True).start()


class Worker:
    """Feeds the engine from the request queue and sends each step's responses back.

    Requests keep the id the executor gave them, end to end: the worker passes messages
    through, so it keeps no map of its own. With postprocess workers (`postprocessed`), each
    lane is one of them: a request's responses all go, in order, to lane request_id % N, the
    first of them with the request's parameters (they cross once per request, not per token).
    """

    def __init__(
        self,
        engine,
        requests: ipc.SignedSocket,
        lanes: list[ipc.SignedSocket],
        *,
        postprocessed: bool = False,
    ) -> None:
        self.engine = engine
        self._requests = requests
        self._lanes = lanes
        self._postprocessed = postprocessed
        # Parameters of requests whose first response has not gone out yet (postprocessed only).
        self._unsent_params: dict[int, tuple] = {}
        # Wakeups that swap the postprocess workers' tokenizer: transition id -> its directory.
        self._lane_tokenizers: dict[int, str] = {}
        self._send_lock = threading.Lock()  # the engine thread and the request loop both send
        self._engine_done = threading.Event()
        self._fatal = False

    def serve(self) -> int:
        self.engine.start(
            on_responses=self._send_step, on_fatal=self._on_fatal, on_transition=self._transition_done
        )
        try:
            self._request_loop()
        except BaseException as error:  # this loop feeds the engine: without it, the engine is dead
            logger.exception("the worker's request loop failed")
            self._on_fatal(error)
        self.engine.join(0 if self._fatal else None)
        if self._fatal:
            return 1
        self._send_to_every_lane(WorkerClosed())
        return 0

    def _request_loop(self) -> None:
        queue = self.engine.request_queue
        while not self._engine_done.is_set():
            message = self._requests.recv(POLL_MS)
            if message is None:
                if self.engine.join(0):
                    break  # the loop ended without being asked to: on_fatal has said why
            elif isinstance(message, GenerationRequest):
                self._submit(message)
            elif isinstance(message, AbortRequest):
                queue.enqueue_abort(message)
            elif isinstance(message, (Sleep, Wakeup)):
                self._control(message)
            elif isinstance(message, WakeupWithTokenizer):
                if self._postprocessed:
                    self._lane_tokenizers[message.wakeup.transition_id] = message.tokenizer_dir
                self._control(message.wakeup)
            elif isinstance(message, Shutdown):
                # The loop aborts what is in flight (each client hears back), then exits.
                queue.enqueue_shutdown()
                break
            else:
                logger.warning("unknown message on the request queue: %r", type(message).__name__)

    def _submit(self, request: GenerationRequest) -> None:
        if self._postprocessed:  # before the engine has it: its first response may come at once
            self._unsent_params[request.request_id] = (request.sampling_params, request.streaming)
        try:
            self.engine.request_queue.enqueue_request(request)
        except RequestError as error:  # fails this request only (not admitting now); the engine goes on
            self._send_step([Response(request.request_id, 0, [], error=error)], self.engine.stats())

    def _control(self, control: Control) -> None:
        """Starts a sleep or wakeup (the engine loop carries it on), or refuses it here."""
        try:
            control.validate()  # an unpickled message ran no validation
            self.engine.request_queue.enqueue_control(control)
        except (TransitionError, ValueError) as error:
            state = self.engine.request_queue.admission_state.value
            if isinstance(error, ValueError):
                error = TransitionError(str(error), "invalid_request", state)
            self._transition_done(TransitionResult(control.transition_id, control.kind, state, error=error))

    def _transition_done(self, result: TransitionResult) -> None:
        """A transition's result goes down every lane. A wakeup that swapped the model's
        tokenizer sends the new one ahead of it, only if it succeeded: the engine admits again
        from then on, and every response of a request it admits travels behind it, so no
        request is detokenized with the other revision's tokenizer; one that failed leaves the
        postprocess workers theirs, as the proxy keeps its own."""
        tokenizer_dir = self._lane_tokenizers.pop(result.transition_id, None)
        if tokenizer_dir is not None and result.error is None:
            self._send_to_every_lane(LaneTokenizer(tokenizer_dir), result)
        else:
            self._send_to_every_lane(result)

    def _send_step(self, responses: list[Response], stats) -> None:
        with self._send_lock:
            if not self._postprocessed:
                self._lanes[0].send(StepResults(responses, stats))
                return
            shares: list[list[Response]] = [[] for _ in self._lanes]
            for response in responses:
                shares[response.request_id % len(self._lanes)].append(response)
            for index, share in enumerate(shares):
                if not share and (index or responses):
                    continue  # a step without responses still tells its stats, on lane 0
                new = {}
                for response in share:
                    params = self._unsent_params.pop(response.request_id, None)
                    if params is not None:
                        new[response.request_id] = params
                self._lanes[index].send(LaneStep(share, stats, new))

    def _send_to_every_lane(self, *messages: object) -> None:
        # Every lane ends with the worker's last word, and carries each transition's result, so
        # each postprocess worker passes it on after the results it holds: the proxy knows the
        # world is done (or a transition is) once all have.
        with self._send_lock:
            for lane in self._lanes:
                for message in messages:
                    lane.send(message)

    def _on_fatal(self, error: BaseException) -> None:
        self._fatal = True
        try:
            self._send_to_every_lane(WorkerFatal(portable_error(error), _format(error)))
        finally:
            self._engine_done.set()


def _format(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


if __name__ == "__main__":
    sys.exit(main())
