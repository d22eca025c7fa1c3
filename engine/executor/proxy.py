"""The default shape: a proxy in the caller's process, the engine in a worker process.

The caller's process keeps the Python-heavy client work (tokenizing, detokenizing, streaming,
an HTTP server); the worker runs the engine loop undisturbed by it. They talk over three
signed ZeroMQ queues (see `ipc.py`, `messages.py`, `worker.py`):

    requests     proxy -> worker   requests, aborts, sleep / wakeup, the shutdown sentinel, in
                                   one order
    results      worker -> proxy   one message per engine step, with the engine's stats, and
                                   the result of each sleep / wakeup
    init status  worker <-> proxy  identity, config, READY or the failure, ACK

Death of the worker is noticed twice over: a watcher thread waits on the process (the event)
and the dispatch thread checks the worker's pid every few seconds (the backstop).

With `num_postprocess_workers` N > 0 the proxy also starts N postprocess worker processes
(`postprocess_worker.py`) right after the worker, which waits for their lanes before it loads
the model: the worker sends each one its share of the responses (request_id % N), and they
send the results on, detokenized, to the result queue.
A sleep's or wakeup's result goes down every lane and is delivered with its last copy, behind
every response the engine sent before it. A wakeup that follows a tokenizer swap
(`replace_tokenizer`, a revision with another tokenizer) takes the new one to them: rank 0
sends it down every lane ahead of the wakeup's result if the wakeup succeeds. The death of
any of them ends the world as the worker's own death does.

With tensor parallelism the worker is an MPI world (`world.py`): the process the proxy starts
and watches is mpiexec, rank 0 is the only rank that talks to the proxy, and it names every
rank's process before the model load, so the backstop watches them all.
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from berth.engine.config import EngineConfig
from berth.engine.engine_io import (
    AbortRequest,
    Control,
    GenerationRequest,
    LoadProgress,
    ProgressSink,
    Shutdown,
    TransitionResult,
    Wakeup,
)
from berth.engine.executor import ipc
from berth.engine.executor.errors import (
    EngineDeadError,
    EngineStalledError,
    RemoteTraceback,
    WorkerDiedError,
    how_it_exited,
)
from berth.engine.executor.executor import GenerationExecutor
from berth.engine.executor.messages import (
    Ack,
    InitFailed,
    StepResults,
    WakeupWithTokenizer,
    WorkerClosed,
    WorkerFatal,
    WorkerIdentity,
    WorkerReady,
    WorkerSetup,
)
from berth.engine.executor.postprocess_worker import PostprocessWorkers
from berth.engine.executor.world import LocalWorker, MpiWorld, RunningWorld, World
from berth.engine.tokenizer import loaded

logger = logging.getLogger(__name__)

# A live worker may need long to release a big model; a dead or hung one is not waited for long.
LIVE_SHUTDOWN_TIMEOUT = 180.0
DEAD_SHUTDOWN_TIMEOUT = 5.0
WORKER_INIT_TIMEOUT = 900.0  # a safety net only: a worker that dies while loading is seen at once
POLL_MS = 100  # how often the dispatch thread looks up from the result queue
LIVENESS_CHECK_SECONDS = 2.0  # the polling backstop
LAST_WORDS_SECONDS = 2.0  # how long a dead worker's last messages (its root cause) may take to route


class ProxyExecutor(GenerationExecutor):
    """`world`: how the worker world starts (default: one worker process, or with
    `config.tensor_parallel_size` N > 1 an MPI world of N ranks on this machine). The queues are
    Unix sockets for a world on this machine, TCP for one on other hosts (the default
    `transport`). `tokenizer` may be a `TokenizerToLoad`: it is then loaded while the worker
    boots."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        *,
        transport: str | None = None,
        init_timeout: float = WORKER_INIT_TIMEOUT,
        num_postprocess_workers: int = 0,
        world: World | None = None,
        on_progress: ProgressSink | None = None,
    ) -> None:
        super().__init__(None)  # set once the worker process has started
        self.config = config
        self._on_progress = on_progress  # hears the world's load, step by step, until READY
        self.load_progress: LoadProgress | None = None
        self.world = world or default_world(config)
        if self.world.size != config.tensor_parallel_size:
            raise ValueError(
                f"a world of {self.world.size} ranks for tensor_parallel_size {config.tensor_parallel_size}"
            )
        transport = transport or ("ipc" if self.world.is_local else "tcp")
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        if not isinstance(num_postprocess_workers, int) or num_postprocess_workers < 0:
            raise ValueError(
                f"num_postprocess_workers must be an integer >= 0, got {num_postprocess_workers!r}"
            )
        self.key = ipc.engine_key()
        self._context = zmq.Context()
        self._ipc_dir: Path | None = None
        self._scratch_dirs: list[Path] = []  # removed with the sockets
        # Where the world reaches this process: only rank 0 connects, from this machine or from
        # one of the hosts (which reach it by the name mpiexec's hydra calls back to).
        self._reachable_host = "127.0.0.1"
        if transport == "ipc":
            addresses, self._ipc_dir = ipc.ipc_addresses()
        elif self.world.is_local:
            addresses = ipc.tcp_addresses()
        else:
            self._reachable_host = self.world.launcher_host or socket.getfqdn()
            # A name may resolve to any of this machine's addresses: listen on all of them.
            addresses = ipc.tcp_addresses(self._reachable_host if _is_ip(self._reachable_host) else "0.0.0.0")
        self._transport = transport
        self.num_postprocess_workers = num_postprocess_workers
        self._postprocess: PostprocessWorkers | None = None
        # Every lane ends with the worker's last word: the world is done once each has said it.
        self._lanes_open = max(1, num_postprocess_workers)
        self._transition_copies: dict[int, int] = {}  # transition id -> lanes that passed it on
        # The tokenizer the postprocess workers detokenize with, and where it is saved; and the
        # wakeups under way that take them another: transition id -> (tokenizer, its folder).
        self._lanes_tokenizer: tuple[object, Path] | None = None
        self._lane_tokenizer_swaps: dict[int, tuple[object, Path]] = {}
        self._init = ipc.open_socket(
            self._context, zmq.ROUTER, addresses["init_status"], self.key, ipc.INIT_STATUS, bind=True
        )
        self._results_socket = ipc.open_socket(
            self._context, zmq.PULL, addresses["results"], self.key, ipc.RESULTS, bind=True
        )
        self._requests_socket: ipc.SignedSocket | None = None  # connected once the worker says where
        self._send_lock = threading.Lock()  # client threads and the dispatch thread all send
        self._closing = False  # set when shutdown starts: the worker's exit is then expected
        self._last_words_routed = threading.Event()  # set by the dispatcher after its final drain
        self.identities: list[WorkerIdentity] = []
        self._running: RunningWorld | None = None  # once started: its processes, watched
        self._socket_handoff = threading.Lock()  # who closes the sockets: shutdown or the dispatcher
        self._dispatcher_done = False
        self._dispatcher_closes_sockets = False
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name="berth-proxy-dispatch", daemon=True
        )
        try:
            self._running = self._spawn_worker(self._init.address, self._results_socket.address, addresses)
            threading.Thread(target=self._watch_worker, name="berth-worker-watch", daemon=True).start()
            self.tokenizer = loaded(tokenizer)  # while the worker imports torch
            if num_postprocess_workers:  # the worker waits for their lanes before it loads the model
                self._spawn_postprocess_workers()
            lanes = self._await_postprocess_workers() if num_postprocess_workers else []
            self._handshake(WorkerSetup(config, tuple(lanes)), init_timeout)
        except BaseException as error:
            self._fail_initialization(error)
        self._dispatcher.start()
        # A stalled world cannot be trusted again and holds the model: it is killed.
        self._watch_for_stalls(detail=self._running.stuck_ranks, on_stall=self._abandon_world)
        atexit.register(self.shutdown)  # a dead or forgotten engine never hangs the interpreter's exit

    # ---- start -------------------------------------------------------------------------------

    def _spawn_postprocess_workers(self) -> None:
        """Each gets the proxy's own tokenizer (as saved by `save_pretrained`: the very one the
        proxy would detokenize with) and a lane to listen on."""
        folder = self._scratch_folder()
        tokenizer_dir = folder / "tokenizer"
        self.tokenizer.save_pretrained(str(tokenizer_dir))
        self._lanes_tokenizer = (self.tokenizer, tokenizer_dir)
        if self._transport == "ipc":
            lane_address = lambda i: f"ipc://{folder / f'lane-{i}'}"  # noqa: E731
        else:
            lane_address = lambda i: "tcp://127.0.0.1:*"  # noqa: E731
        self._postprocess = PostprocessWorkers(
            self.num_postprocess_workers,
            tokenizer_dir=tokenizer_dir,
            result_address=self._results_socket.address,
            lane_address=lane_address,
            key=self.key,
        )

    def _scratch_folder(self) -> Path:
        """A folder of this process's, removed with the sockets."""
        if self._ipc_dir is not None:
            return self._ipc_dir
        if not self._scratch_dirs:
            self._scratch_dirs.append(Path(tempfile.mkdtemp(prefix=ipc.IPC_FOLDER_PREFIX)))
        return self._scratch_dirs[0]

    def _await_postprocess_workers(self) -> list[str]:
        """Their lanes, once each listens; from then on, the death of one is the world's."""
        lanes = self._postprocess.await_ready(self._results_socket)
        self._postprocess.watch(self._on_postprocess_death)
        return lanes

    def _on_postprocess_death(self, error: BaseException) -> None:
        if self._closing:
            return
        self._set_fatal(error)
        self._abandon_world()

    def _spawn_worker(
        self, init_address: str, result_address: str, addresses: dict[str, str]
    ) -> RunningWorld:
        command = [
            sys.executable,
            "-m",
            "berth.engine.executor.worker",
            "--init-address",
            ipc.reachable(init_address, self._reachable_host),
            "--result-address",
            ipc.reachable(result_address, self._reachable_host),
            "--request-address",
            addresses["requests"],
            "--parent-pid",
            str(os.getpid()),
        ]
        if isinstance(self.world, MpiWorld):
            # Ranks on this host outlive the proxy by at most a moment (see the worker).
            command += ["--parent-host", socket.gethostname(), "--world-size", str(self.world.size)]
        env = dict(os.environ, **{ipc.KEY_ENV: self.key.hex()})
        return RunningWorld(self.world, command, env)

    def _world_ended(self) -> str:
        return self._running.how_it_ended(LAST_WORDS_SECONDS)

    def _handshake(self, setup: WorkerSetup, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        routing_id, identity = self._await_init_message(deadline, "starting")
        if not isinstance(identity, WorkerIdentity):
            raise RuntimeError(f"the worker's first message must be its identity, got {identity!r}")
        self.identities.append(identity)
        self._running.ranks = self.ranks  # named before the slow load: the backstop watches them all
        self._requests_socket = ipc.open_socket(
            self._context, zmq.PUSH, identity.request_address, self.key, ipc.REQUESTS, bind=False
        )
        self._init.send(setup, routing_id=routing_id)  # the answer to an identity is the setup
        _, status = self._await_init_message(deadline, "loading the model")
        while isinstance(status, LoadProgress):
            self.load_progress = status
            if self._on_progress is not None:
                self._on_progress(status)
            _, status = self._await_init_message(deadline, "loading the model")
        if isinstance(status, InitFailed):
            raise status.error from RemoteTraceback(status.traceback)
        if not isinstance(status, WorkerReady):
            raise RuntimeError(f"expected READY from the worker, got {status!r}")
        self.limits, self._stats = status.limits, status.stats
        self._init.send(Ack(), routing_id=routing_id)

    def _await_init_message(self, deadline: float, doing: str) -> tuple[bytes, object]:
        while True:
            received = self._init.recv(POLL_MS, with_routing_id=True)
            if received is not None:
                return received
            if self._running.gone.is_set():
                # Its last words (an InitFailed) may still be on the way: they carry the root cause.
                received = self._init.recv(POLL_MS, with_routing_id=True)
                if received is not None:
                    return received
                raise WorkerDiedError(f"{self._world_ended()} while {doing}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker did not finish {doing} in time")

    def _fail_initialization(self, error: BaseException) -> None:
        """Aborts the world first, then marks the engine dead, then raises the root cause."""
        self._closing = True
        try:
            self._abandon_world()
        finally:
            self._set_fatal(error)
            self._closed = True
            self._close_sockets()
        raise error

    # ---- the worker's liveness -----------------------------------------------------------------

    def _watch_worker(self) -> None:
        """The event: wakes the moment the worker process exits."""
        code = self._running.wait()
        if self._closing:
            if code != 0 and not self.is_dead:
                logger.warning(
                    "the worker process %d %s during shutdown", self._running.process.pid, how_it_exited(code)
                )
            return
        # The root cause (a WorkerFatal) may be queued just before the exit: let it win.
        self._last_words_routed.wait(LAST_WORDS_SECONDS)
        self._set_fatal(WorkerDiedError(self._world_ended()))

    def _check_workers(self) -> None:
        """The backstop: a worker whose pid is gone is dead, whatever else was (not) noticed."""
        if self._closing or self._running.gone.is_set():
            return  # expected, or the watcher is already recording it
        if (gone := self._running.gone_rank()) is not None:
            self._set_fatal(WorkerDiedError(gone))

    def _kill_worker(self) -> None:
        if self._running is not None:
            self._running.kill(DEAD_SHUTDOWN_TIMEOUT)

    def _abandon_world(self) -> None:
        """A world that can no longer serve must not go on holding the model: kill what is left."""
        self._closing = True
        self._kill_worker()
        if self._postprocess is not None:
            self._postprocess.kill()

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

    def _send_abort(self, request_id: int, seq_index: int | None) -> None:
        self._send(AbortRequest(request_id, seq_index))  # after shutdown there is nothing to abort

    def _send_control(self, control: Control) -> None:
        # The worker does the compare-and-set; a conflict comes back as a refused result.
        message = control
        if isinstance(control, Wakeup) and self._lanes_tokenizer is not None:
            tokenizer = self.tokenizer  # swapped in while parked, before this wakeup (see LLM)
            if tokenizer is not self._lanes_tokenizer[0]:
                folder = self._scratch_folder() / f"tokenizer-{control.transition_id}"
                tokenizer.save_pretrained(str(folder))
                # Registered before it is sent, like the transition itself.
                self._lane_tokenizer_swaps[control.transition_id] = (tokenizer, folder)
                message = WakeupWithTokenizer(control, str(folder))
        if not self._send(message):
            raise EngineDeadError("the executor has been shut down")

    def _lane_tokenizer_swapped(self, result: TransitionResult) -> None:
        """After a wakeup that took the postprocess workers another tokenizer: the one they
        detokenize with now (they had it before its result came), and the other's folder goes."""
        swap = self._lane_tokenizer_swaps.pop(result.transition_id, None)
        if swap is None:
            return
        if result.error is None:
            swap, self._lanes_tokenizer = self._lanes_tokenizer, swap
        shutil.rmtree(swap[1], ignore_errors=True)

    # ---- receiving ---------------------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        next_check = time.monotonic() + LIVENESS_CHECK_SECONDS
        try:
            while True:
                first = self._results_socket.recv(POLL_MS)
                if first is None:
                    if self._running.gone.is_set():  # nothing more can come: route the stragglers
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
            with self._socket_handoff:
                self._dispatcher_done = True
                if self._dispatcher_closes_sockets:
                    self._close_sockets()
            if self.is_dead:
                # Nobody routes the world's results any more (or it is dead already): it must not
                # go on holding the model.
                self._abandon_world()
            elif self._lanes_open and self._postprocess is not None:
                # The worker went without its last word (its watcher records why): its
                # postprocess workers would wait for it forever.
                self._postprocess.kill()

    def _route(self, messages: list) -> bool:
        """Dispatches everything received in one go (one wake-up per asyncio loop); False once the
        worker has said its last word."""
        items: list = []
        for m in messages:
            if isinstance(m, StepResults):
                items.append((m.responses, m.stats))
            elif isinstance(m, TransitionResult) and self._transition_complete(m):
                self._lane_tokenizer_swapped(m)
                items.append(m)
        self._deliver(items)
        more = True
        for message in messages:
            if isinstance(message, WorkerFatal):
                error = message.error
                if isinstance(error, EngineStalledError) and (stuck := self._running.stuck_ranks()):
                    error = EngineStalledError(f"{error}; {stuck}")  # read now: the world ends soon
                self._set_fatal(self._root_cause(_with_remote_traceback(error, message.traceback)))
                more = False
            elif isinstance(message, WorkerClosed):
                self._lanes_open -= 1
                more = more and self._lanes_open > 0
        return more

    def _root_cause(self, error: BaseException) -> BaseException:
        """Rank 0's fatal error, or in an MPI world where another rank died first (rank 0's next
        collective then fails too: its error is an echo), hydra's verdict on that rank, with
        rank 0's error after it. The world ends within moments of such a death."""
        if not isinstance(self.world, MpiWorld) or not self._running.gone.wait(LAST_WORDS_SECONDS):
            return error
        said = self._world_ended()
        if "a rank ended" not in said:
            return error  # rank 0 itself failed (it aborted the world): its error is the cause
        died = WorkerDiedError(f"{said}; rank 0 then failed: {type(error).__name__}: {error}")
        died.__cause__ = error
        return died

    def _transition_complete(self, result: TransitionResult) -> bool:
        """With postprocess workers a transition's result comes once per lane, after the
        responses that lane held: it is delivered with the last copy, so every response the
        engine sent before it (a drain's last tokens) is routed first."""
        if self.num_postprocess_workers <= 1:
            return True
        copies = self._transition_copies.get(result.transition_id, 0) + 1
        if copies < self.num_postprocess_workers:
            self._transition_copies[result.transition_id] = copies
            return False
        self._transition_copies.pop(result.transition_id, None)
        return True

    # ---- state ---------------------------------------------------------------------------------

    @property
    def engine_pid(self) -> int:
        return self.identities[0].pid if self.identities else -1

    @property
    def ranks(self) -> tuple[tuple[int, int, str], ...]:
        if not self.identities:
            return ()
        identity = self.identities[0]
        return identity.world or ((identity.rank, identity.pid, identity.host),)

    @property
    def world_process(self) -> subprocess.Popen | None:
        """The process the world is: the worker, or mpiexec (its exit code is the world's)."""
        return self._running.process if self._running is not None else None

    def _engine_admission_state(self) -> str:
        return self._stats.admission if self._stats is not None else "running"

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
        worker_can_read = not self.is_dead and not self._running.gone.is_set()
        return worker_can_read and self._send(Shutdown())

    def _wait_for_worker(self, timeout: float) -> None:
        """Step two: a live worker gets `timeout` to finish; after that it is killed (abandoned)."""
        if not self._running.gone.wait(timeout):
            logger.error("the worker did not exit within %.0f s: killing it", timeout)
            self._set_fatal(TimeoutError(f"the worker did not stop within {timeout:.0f} s"))
            self._kill_worker()
        if self._postprocess is not None:  # they pass the worker's last word on, then exit
            self._postprocess.stop(DEAD_SHUTDOWN_TIMEOUT)
        self._dispatcher.join(DEAD_SHUTDOWN_TIMEOUT)
        self._fail_pending(EngineDeadError("the executor was shut down"))
        with self._socket_handoff:
            if not self._dispatcher_done:
                # Its socket is not ours to close while it may still read it. It closes them
                # when it stops: a context left unclosed would deadlock whichever thread's
                # garbage collection meets it later (pyzmq terms it before its sockets close).
                logger.error("the dispatch thread did not stop: it closes the sockets when it does")
                self._dispatcher_closes_sockets = True
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
        for folder in [self._ipc_dir, *self._scratch_dirs]:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def default_world(config: EngineConfig) -> World:
    """One worker process, or an MPI world of `tensor_parallel_size` ranks on this machine."""
    if config.tensor_parallel_size == 1:
        return LocalWorker()
    return MpiWorld(config.tensor_parallel_size)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _with_remote_traceback(error: BaseException, traceback: str) -> BaseException:
    error.__cause__ = RemoteTraceback(traceback)
    return error
