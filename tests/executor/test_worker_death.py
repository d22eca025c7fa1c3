"""Worker death, by kill -9, by a crash while loading, or by a fatal engine error: every
client hears `EngineDeadError` fast, nothing hangs (not even the interpreter's exit), and no
worker process is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import zmq
from safetensors.torch import load_file, save_file

from berth.engine import LLM, EngineConfig, SamplingParams
from berth.engine.engine_io import RequestError, Response
from berth.engine.executor import EngineDeadError, ipc
from berth.engine.executor.errors import RemoteTraceback, WorkerDiedError
from berth.engine.executor.messages import StepResults, namespaced_request_id
from berth.engine.executor.proxy import ProxyExecutor
from tests.support.engine_processes import call_with_timeout, pid_alive, wait_until, worker_pids

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


class HealthProbe:
    """Calls check_health over and over on a thread (as a probe would), timing every call, from
    before a death until it is noticed: the calls made while the death is being discovered are
    the ones that could block."""

    def __init__(self, llm: LLM, timeout: float) -> None:
        self.calls: list[tuple[float, bool, float]] = []  # (started, healthy, seconds)
        self._llm = llm
        self._thread = threading.Thread(target=self._run, args=(timeout,), daemon=True)
        self._thread.start()

    def _run(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            started = time.monotonic()
            healthy = self._llm.check_health()
            self.calls.append((started, healthy, time.monotonic() - started))
            if not healthy:
                return
            time.sleep(0.001)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def await_in_another_loop(coroutine_function) -> threading.Thread:
    """Runs `coroutine_function()` to its end on an event loop of a thread of its own."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = asyncio.run(coroutine_function())
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.outcome = outcome
    thread.start()
    return thread


def test_kill_9_during_a_batch_fails_every_request_fast(tiny_model):
    llm = LLM(tiny_model, max_batch_size=16, kv_cache_blocks=512)
    try:
        results = [
            llm.generate_async([5 + i % 50] * (1 + i % 20), LONG, streaming=i % 2 == 0) for i in range(64)
        ]
        first_stream = iter(results[0])
        call_with_timeout(lambda: next(first_stream), 30)  # the batch is running

        async def two_waiters():  # on one result: both must hear of the death
            outcomes = await asyncio.wait_for(
                asyncio.gather(results[3].aresult(), results[3].aresult(), return_exceptions=True), 15
            )
            return [type(outcome) for outcome in outcomes]

        waiters = await_in_another_loop(two_waiters)
        probe = HealthProbe(llm, timeout=10)
        assert wait_until(lambda: probe.calls, timeout=5)
        os.kill(llm.executor.engine_pid, signal.SIGKILL)
        killed_at = time.monotonic()

        def expect_dead(result, streaming: bool) -> float:
            with pytest.raises(EngineDeadError):
                if streaming:
                    for _ in result:
                        pass
                else:
                    result.result(timeout=10)
            return time.monotonic() - killed_at

        waits = [
            call_with_timeout(lambda r=r, s=i % 2 == 0: expect_dead(r, s), 12) for i, r in enumerate(results)
        ]
        assert max(waits) < 10

        probe.join(10)
        assert probe.calls[0][1] and probe.calls[0][0] < killed_at  # healthy before the kill
        assert not probe.calls[-1][1]  # and the death noticed
        assert max(seconds for _, _, seconds in probe.calls) < 0.1  # no call ever blocked
        assert isinstance(llm.executor.fatal_error, WorkerDiedError)
        assert llm.executor.admission_state == "failed"

        waiters.join(20)
        assert waiters.outcome == {"value": [EngineDeadError, EngineDeadError]}, waiters.outcome

        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate_async("hello", LONG)
        assert time.monotonic() - started < 0.05
    finally:
        started = time.monotonic()
        call_with_timeout(llm.shutdown, 10)
        assert time.monotonic() - started < 6  # a dead world is waited for a few seconds at most
    with pytest.raises(EngineDeadError):  # a terminal error is sticky, even after shutdown
        results[1].result(timeout=0)


def forge_results(executor, message: StepResults) -> None:
    """`message` on the proxy's result queue, signed with the engine's key, as rank 0 sends."""
    context = zmq.Context()
    forger = ipc.open_socket(
        context, zmq.PUSH, executor._results_socket.address, executor.key, ipc.RESULTS, bind=False
    )
    try:
        forger.send(message)
    finally:
        forger.close(linger_ms=5_000)
        context.term()


@pytest.mark.slow  # long generations in a worker process
def test_a_response_its_request_cannot_apply_fails_that_request_alone(tiny_model):
    """A response the proxy cannot apply to its request (here: for a sequence the request does
    not have) fails that request alone with an internal error, the engine aborts it, and the
    other requests and the engine go on."""
    llm = LLM(tiny_model, max_batch_size=8)
    longest = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    try:
        running = llm.generate_async("hello", longest, streaming=True)
        neighbour = llm.generate_async("world", LONG, streaming=True)
        call_with_timeout(lambda: next(iter(running)), 30)
        worker = llm.executor.engine_pid
        forge_results(llm.executor, StepResults([Response(running.request_id, 99, [5])], llm.executor.stats))
        with pytest.raises(RequestError, match="postprocess") as failed:
            call_with_timeout(lambda: running.result(timeout=10), 12)
        assert failed.value.code == "internal" and failed.value.stage == "postprocess"
        output = call_with_timeout(lambda: neighbour.result(timeout=30), 32)
        assert output.outputs[0].finish_reason == "length"
        assert len(output.outputs[0].token_ids) == LONG.max_tokens
        assert llm.check_health() and pid_alive(worker)
        # The engine was told to stop the failed request: it ran a few of its 1000 tokens at most.
        assert wait_until(lambda: llm.executor.stats.num_running == 0, timeout=10), llm.executor.stats
        assert llm.executor.stats.num_computed_tokens < LONG.max_tokens + 300, llm.executor.stats
    finally:
        call_with_timeout(llm.shutdown, 10)


def test_a_failed_dispatcher_stops_the_worker(tiny_model):
    """Once the proxy cannot route results at all (here: the hook that hands other frontends'
    responses on raises), the engine is dead and its worker, which holds the model, goes too."""
    llm = LLM(tiny_model, max_batch_size=8)
    try:
        running = llm.generate_async("hello", LONG, streaming=True)
        call_with_timeout(lambda: next(iter(running)), 30)
        worker = llm.executor.engine_pid

        def broken_sink(responses, stats) -> None:
            raise RuntimeError("the foreign sink is broken")

        llm.executor.foreign_sink = broken_sink
        frontend_request = namespaced_request_id(3, 1)  # another frontend's: it goes to the sink
        forge_results(llm.executor, StepResults([Response(frontend_request, 0, [5])], llm.executor.stats))
        with pytest.raises(EngineDeadError, match="the foreign sink is broken"):
            call_with_timeout(lambda: running.result(timeout=10), 12)
        assert not llm.check_health()
        assert wait_until(lambda: not pid_alive(worker), timeout=10), "the worker outlived its dispatcher"
    finally:
        call_with_timeout(llm.shutdown, 10)


EXIT_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from berth.engine import LLM, SamplingParams

    llm = LLM(sys.argv[1], max_batch_size=8)
    params = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
    results = [llm.generate_async("hello world", params, streaming=i % 2 == 0) for i in range(8)]
    next(iter(results[0]))
    print(llm.executor.engine_pid, flush=True)
    if sys.argv[2] == "kill":
        os.kill(llm.executor.engine_pid, signal.SIGKILL)
    # Leave without shutdown(), requests in flight: the interpreter's exit must still be prompt.
    """
)


@pytest.mark.parametrize("worker", ["kill", "live"])
def test_the_interpreter_exits_promptly_without_shutdown(tiny_model, tmp_path, worker):
    script = tmp_path / "leave.py"
    script.write_text(EXIT_SCRIPT)
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, str(script), str(tiny_model), worker], stdout=subprocess.PIPE, text=True
    )
    try:
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0
    assert time.monotonic() - started < 30
    engine_pid = int(out.split()[0])
    assert wait_until(lambda: not pid_alive(engine_pid), timeout=5), "the worker outlived its proxy"


PROXY_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from berth.engine import LLM

    llm = LLM(sys.argv[1], max_batch_size=8)
    print(llm.executor.engine_pid, flush=True)
    time.sleep(120)  # killed by the test long before
    """
)


def test_a_worker_whose_proxy_is_killed_exits_and_removes_the_socket_folder(tiny_model, tmp_path):
    sockets = tmp_path / "tmp"
    sockets.mkdir()
    script = tmp_path / "proxy.py"
    script.write_text(PROXY_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(script), str(tiny_model)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(sockets)},  # where the proxy makes its ipc:// folder
    )
    try:
        engine_pid = int(call_with_timeout(process.stdout.readline, 60))
        assert [p.name[:6] for p in sockets.iterdir()] == ["berth-"]
        process.kill()
        process.wait(timeout=10)
        assert wait_until(lambda: not pid_alive(engine_pid), timeout=5), "the worker outlived its proxy"
        assert list(sockets.iterdir()) == [], "the killed proxy's socket folder was left behind"
    finally:
        process.kill()


def truncated_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return target


def test_a_worker_crashing_while_loading_raises_the_root_cause(tiny_model, tmp_path):
    model = truncated_checkpoint(tiny_model, tmp_path / "corrupt")
    started = time.monotonic()
    with pytest.raises(Exception) as raised:
        call_with_timeout(lambda: LLM(model), 30)
    assert time.monotonic() - started < 15
    error = raised.value
    assert not isinstance(error, (WorkerDiedError, TimeoutError, EngineDeadError))
    assert isinstance(error.__cause__, RemoteTraceback)
    assert "load_model" in error.__cause__.traceback  # the worker's own traceback comes along
    assert wait_until(lambda: not worker_pids(), timeout=5)


def test_a_worker_whose_torch_import_fails_reports_it_as_the_failed_start(tiny_model, tmp_path, monkeypatch):
    # The worker imports torch while the proxy gets its setup ready, before it has a setup to
    # load: the failure must still reach the proxy as the start's root cause, not as a death.
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))  # the worker's; this process has its torch
    with pytest.raises(ImportError, match="this torch is broken") as raised:
        call_with_timeout(lambda: ProxyExecutor(EngineConfig(model=str(tiny_model)), tokenizer=None), 60)
    assert isinstance(raised.value.__cause__, RemoteTraceback)
    assert "_import_engine" in raised.value.__cause__.traceback
    assert wait_until(lambda: not worker_pids(), timeout=5)


def loading_torch(pid: int) -> bool:
    """True once the worker maps torch's library: it imports torch only after it sent the proxy
    its identity, so the proxy then waits for the engine to load."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_a_worker_killed_while_loading_is_noticed_at_once(tiny_model):
    outcome: dict[str, BaseException] = {}

    def start() -> None:
        try:
            ProxyExecutor(EngineConfig(model=str(tiny_model)), tokenizer=None)
        except BaseException as error:
            outcome["error"] = error

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    # The worker said who it is before loading, so the proxy already watches it.
    assert wait_until(lambda: worker_pids(), timeout=30)
    (worker,) = worker_pids()
    assert wait_until(lambda: loading_torch(worker), timeout=30, interval=0.002)
    os.kill(worker, signal.SIGKILL)
    killed_at = time.monotonic()
    starter.join(10)
    assert not starter.is_alive()
    assert time.monotonic() - killed_at < 2
    assert isinstance(outcome["error"], WorkerDiedError)
    assert "loading the model" in str(outcome["error"])


def nan_checkpoint(source: Path, target: Path) -> Path:
    """The model with NaN input embeddings for every token but 0: it passes the engine's one-token
    check after loading (token 0), and every logit of every real prompt is NaN. The head gets a
    copy of its own (untied), so that its rows stay finite."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (target / "config.json").write_text(json.dumps(config))
    weights = load_file(target / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embedding.clone()
    embedding[1:] = float("nan")
    save_file(weights, target / "model.safetensors")
    return target


def test_a_fatal_engine_error_reaches_every_client_with_its_root_cause(tiny_model, tmp_path):
    # A failure no single request can be blamed for (every sequence's sampling fails, whatever
    # it asked) is fatal: the whole engine dies, and says why first.
    llm = LLM(nan_checkpoint(tiny_model, tmp_path / "nan"), max_batch_size=8)
    try:
        sampled = SamplingParams(temperature=1.0, max_tokens=4)
        results = [llm.generate_async(f"hello {i}", sampled) for i in range(3)]
        for result in results:
            with pytest.raises(EngineDeadError, match="probability tensor"):
                call_with_timeout(lambda r=result: r.result(timeout=10), 12)
        root = llm.executor.fatal_error
        assert isinstance(root, RuntimeError) and isinstance(root.__cause__, RemoteTraceback)
        assert "sample" in root.__cause__.traceback
        assert not llm.check_health()
    finally:
        call_with_timeout(llm.shutdown, 10)
