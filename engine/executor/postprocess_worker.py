"""Postprocess worker processes: the client side's text work, taken off the proxy's process.

    BERTH_ENGINE_KEY=<hex> python -m berth.engine.executor.postprocess_worker \\
        --index I --input-address A --result-address B --tokenizer DIR [--parent-pid P]

With `--num-postprocess-workers N` the proxy starts N of these. Rank 0 sends each one, on its
lane, the raw responses of the requests pinned to it (request_id % N, so a request's
incremental detokenizer lives in one place) with each request's parameters once; it runs
`postprocess.py` on them, exactly what the proxy would have, and sends the `SequenceUpdate`s
on to the proxy's result queue. A request's responses travel one lane in order, so its updates
arrive in order. A wakeup that swaps in a revision with another tokenizer sends the new one
down every lane first (`LaneTokenizer`): requests from then on detokenize with it, those
already held (none: the sleep before the wakeup drained or aborted them) with the one they began with.

A postprocess worker that dies takes the requests pinned to it down with it: the proxy treats
that as the engine's death (every pending request fails at once with the cause), never as a
silent loss.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import zmq

from berth.engine.engine_io import TransitionResult
from berth.engine.executor import ipc
from berth.engine.executor.errors import WorkerDiedError, how_it_exited
from berth.engine.executor.messages import (
    InitFailed,
    LaneStep,
    LaneTokenizer,
    PostprocessReady,
    StepResults,
    WorkerClosed,
    WorkerFatal,
    portable_error,
)
from berth.engine.executor.postprocess import RequestPostprocessor

logger = logging.getLogger("berth.engine.executor.postprocess_worker")

READY_TIMEOUT = 120.0  # loading a tokenizer takes seconds; a safety net only (deaths are seen at once)
POLL_MS = 200


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from berth.engine.executor.worker import start_as_child

    key = start_as_child(f"berth postprocess worker {args.index} ({os.getpid()})", args.parent_pid, None)
    context = zmq.Context()
    inputs = ipc.open_socket(context, zmq.PULL, args.input_address, key, ipc.LANE, bind=True)
    results = ipc.open_socket(context, zmq.PUSH, args.result_address, key, ipc.RESULTS, bind=False)
    try:
        try:
            from berth.engine.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
        except BaseException as error:
            logger.exception("cannot load the tokenizer")
            results.send(InitFailed(portable_error(error), _format(error)))
            return 1
        results.send(PostprocessReady(args.index, os.getpid(), inputs.address))
        return _serve(tokenizer, inputs, results)
    finally:
        inputs.close()
        results.close(linger_ms=5_000)  # the last updates and the last word must get out
        context.term()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m berth.engine.executor.postprocess_worker")
    parser.add_argument("--index", type=int, required=True, help="which of the N workers (request_id % N)")
    parser.add_argument("--input-address", required=True, help="where to listen for rank 0's responses")
    parser.add_argument("--result-address", required=True, help="the proxy's result queue")
    parser.add_argument("--tokenizer", required=True, help="the tokenizer's directory")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    return parser.parse_args(argv)


def _serve(tokenizer, inputs: ipc.SignedSocket, results: ipc.SignedSocket) -> int:
    requests: dict[int, RequestPostprocessor] = {}
    try:
        while True:
            message = inputs.recv(POLL_MS)
            if isinstance(message, LaneStep):
                for request_id, (params, streaming) in message.new_requests.items():
                    requests[request_id] = RequestPostprocessor(request_id, params, tokenizer, streaming)
                updates = []
                for response in message.responses:
                    request = requests.get(response.request_id)
                    if request is None:
                        continue  # the engine's last word for a request already done with
                    updates.append(request.process(response))
                    if request.engine_done:
                        del requests[response.request_id]
                results.send(StepResults(updates, message.stats))
            elif isinstance(message, LaneTokenizer):
                # Before the wakeup's result is passed on, so the caller hears of the wakeup only
                # once every worker has it. One that cannot load is fatal, with its cause.
                from berth.engine.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(message.tokenizer_dir)
            elif isinstance(message, TransitionResult):
                results.send(message)  # a sleep or wakeup, after the updates the engine sent first
            elif isinstance(message, (WorkerClosed, WorkerFatal)):
                results.send(message)  # after every update of the world it ends: pass it on
                return 0
            elif message is not None:
                logger.warning("unknown message on the lane: %r", type(message).__name__)
    except BaseException as error:  # as in the proxy's own dispatch thread: fatal, with its cause
        logger.exception("postprocessing failed")
        results.send(WorkerFatal(portable_error(error), _format(error)))
        return 1


def _format(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


class PostprocessWorkerDiedError(WorkerDiedError):
    """A postprocess worker exited while it held requests: the engine cannot finish them."""


class PostprocessWorkers:
    """The proxy's N postprocess worker processes: started before rank 0 (its lanes must
    exist), watched for death, stopped after it."""

    def __init__(
        self,
        count: int,
        *,
        tokenizer_dir: Path,
        result_address: str,
        lane_address: Callable[[int], str],
        key: bytes,
    ) -> None:
        env = dict(os.environ, **{ipc.KEY_ENV: key.hex()})
        self.processes = [
            subprocess.Popen(
                self._command(i, lane_address(i), result_address, tokenizer_dir),
                env=env,
                stdin=subprocess.DEVNULL,
            )
            for i in range(count)
        ]
        self.lanes: list[str] = [""] * count
        self.expected_exit = False  # set when the world ends: exits are then no news

    @staticmethod
    def _command(index: int, lane: str, result_address: str, tokenizer_dir: Path) -> list[str]:
        return [
            sys.executable, "-m", "berth.engine.executor.postprocess_worker", "--index", str(index),
            "--input-address", lane, "--result-address", result_address, "--tokenizer", str(tokenizer_dir),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip

    def await_ready(self, results: ipc.SignedSocket, timeout: float = READY_TIMEOUT) -> list[str]:
        """Each worker's lane address once all have loaded their tokenizer; raises if one fails
        or dies first."""
        deadline = time.monotonic() + timeout
        waiting = set(range(len(self.processes)))
        while waiting:
            message = results.recv(POLL_MS)
            if isinstance(message, PostprocessReady):
                self.lanes[message.index] = message.input_address
                waiting.discard(message.index)
            elif isinstance(message, InitFailed):
                raise RuntimeError(
                    f"a postprocess worker failed to start: {message.error}"
                ) from message.error
            for i in waiting:
                if self.processes[i].poll() is not None:
                    raise self._died(i, "while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"postprocess workers {sorted(waiting)} did not start in time")
        return self.lanes

    def watch(self, on_death: Callable[[BaseException], None]) -> None:
        """`on_death(error)` the moment one exits while it was not expected to."""

        def wait_for(index: int) -> None:
            self.processes[index].wait()
            if not self.expected_exit:
                on_death(self._died(index, "while it held requests: they cannot finish"))

        for index in range(len(self.processes)):
            threading.Thread(
                target=wait_for, args=(index,), name=f"berth-postprocess-watch-{index}", daemon=True
            ).start()

    def _died(self, index: int, when: str) -> PostprocessWorkerDiedError:
        process = self.processes[index]
        return PostprocessWorkerDiedError(
            f"postprocess worker {index} (pid {process.pid}) {how_it_exited(process.returncode)} {when}"
        )

    def stop(self, timeout: float) -> None:
        """Waits up to `timeout` for them to pass on the world's last word and exit; kills the rest."""
        self.expected_exit = True
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)

    def kill(self) -> None:
        self.expected_exit = True
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait(5)


if __name__ == "__main__":
    sys.exit(main())
