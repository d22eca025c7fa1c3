"""The single-process shape: the engine loop runs on a thread of the caller's process.

Simple to debug (one process, one debugger); the proxy + worker shape isolates the engine
from the caller and streams better under load.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

from berth.engine.config import EngineConfig
from berth.engine.engine_io import AbortRequest, Control, GenerationRequest, ProgressSink
from berth.engine.executor.errors import EngineDeadError
from berth.engine.executor.executor import GenerationExecutor
from berth.engine.pyexecutor.py_executor import PyExecutor
from berth.engine.tokenizer import loaded

logger = logging.getLogger(__name__)

# A live engine may need long to release a big model; a dead one is not waited for long.
LIVE_SHUTDOWN_TIMEOUT = 180.0
DEAD_SHUTDOWN_TIMEOUT = 5.0


class InProcessExecutor(GenerationExecutor):
    def __init__(self, config: EngineConfig, tokenizer, on_progress: ProgressSink | None = None) -> None:
        super().__init__(loaded(tokenizer))
        self.config = config
        self.engine = PyExecutor.launch(config, on_progress=on_progress)
        self.limits, self._stats = self.engine.limits, self.engine.stats()  # as READY says them
        self._batches: queue.SimpleQueue = queue.SimpleQueue()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="berth-dispatch", daemon=True)
        self._dispatcher.start()
        # Step batches and transition results share one queue: they are routed in the order
        # the engine produced them.
        self.engine.start(
            on_responses=lambda r, s: self._batches.put((r, s)),
            on_fatal=self._set_fatal,
            on_transition=self._batches.put,
        )
        # A blocked step cannot be interrupted on its thread: the engine is declared dead, and
        # stops if it ever resumes.
        self._watch_for_stalls(on_stall=self.engine.request_queue.enqueue_shutdown)

    def _dispatch_loop(self) -> None:
        try:
            while True:
                items = [self._batches.get()]
                while not self._batches.empty():
                    items.append(self._batches.get_nowait())
                stop = None in items
                self._deliver([item for item in items if item is not None])
                if stop:
                    return
        except BaseException as error:  # nobody would route results any more: the engine is dead
            logger.exception("the dispatch thread failed")
            self._set_fatal(error)
            self.engine.request_queue.enqueue_shutdown()  # and it stops, instead of computing for nobody

    @property
    def engine_pid(self) -> int:
        return os.getpid()

    def _engine_admission_state(self) -> str:
        return self.engine.request_queue.admission_state.value

    def _send_request(self, request: GenerationRequest) -> None:
        self.engine.request_queue.enqueue_request(request)

    def _send_abort(self, request_id: int, seq_index: int | None) -> None:
        self.engine.request_queue.enqueue_abort(AbortRequest(request_id, seq_index))

    def _send_control(self, control: Control) -> None:
        self.engine.request_queue.enqueue_control(control)  # a conflict raises here, at once

    def shutdown(self) -> None:
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True  # admission stops here: submit() refuses from now on
        if not self.is_dead:
            self.engine.request_queue.enqueue_shutdown()  # the loop aborts what is in flight, then exits
        if not self.engine.join(DEAD_SHUTDOWN_TIMEOUT if self.is_dead else LIVE_SHUTDOWN_TIMEOUT):
            self._set_fatal(TimeoutError("the engine loop did not stop in time"))
        self._batches.put(None)
        self._dispatcher.join(DEAD_SHUTDOWN_TIMEOUT)
        self._fail_pending(EngineDeadError("the executor was shut down"))
