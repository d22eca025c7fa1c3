"""The single-process shape: the engine loop runs on a thread of the caller's process.

Simple to debug (one process, one debugger); the proxy + worker shape isolates the engine
from the caller and streams better under load.
"""

from __future__ import annotations

import os
import queue
import threading

from berth.engine.config import EngineConfig
from berth.engine.executor.errors import EngineDeadError
from berth.engine.executor.executor import GenerationExecutor
from berth.engine.executor.request import GenerationRequest
from berth.engine.pyexecutor.py_executor import PyExecutor

# A live engine may need long to release a big model; a dead one is not waited for long.
LIVE_SHUTDOWN_TIMEOUT = 180.0
DEAD_SHUTDOWN_TIMEOUT = 5.0


class InProcessExecutor(GenerationExecutor):
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        super().__init__(tokenizer)
        self.engine = PyExecutor.launch(config)
        self._batches: queue.SimpleQueue = queue.SimpleQueue()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="berth-dispatch", daemon=True)
        self._dispatcher.start()
        self.engine.start(on_responses=lambda r, s: self._batches.put((r, s)), on_fatal=self._set_fatal)

    def _dispatch_loop(self) -> None:
        while True:
            batches = [self._batches.get()]
            while not self._batches.empty():
                batches.append(self._batches.get_nowait())
            stop = None in batches
            self._dispatch([b for b in batches if b is not None])
            if stop:
                return

    @property
    def engine_pid(self) -> int:
        return os.getpid()

    @property
    def admission_state(self) -> str:
        return self.engine.request_queue.admission_state.value

    def _send_request(self, request: GenerationRequest) -> None:
        self.engine.request_queue.enqueue_request(request)

    def _send_abort(self, client_id: int, seq_index: int | None) -> None:
        self.engine.request_queue.enqueue_abort(client_id, seq_index)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.is_dead:
            self.engine.request_queue.enqueue_shutdown()  # the loop aborts what is in flight, then exits
        if not self.engine.join(DEAD_SHUTDOWN_TIMEOUT if self.is_dead else LIVE_SHUTDOWN_TIMEOUT):
            self._set_fatal(TimeoutError("the engine loop did not stop in time"))
        self._batches.put(None)
        self._dispatcher.join(DEAD_SHUTDOWN_TIMEOUT)
        self._fail_pending(EngineDeadError("the executor was shut down"))
