"""Worker death, by kill -9, by a crash while loading, or by a fatal engine error: every
client hears `EngineDeadError` fast, nothing hangs (not even the interpreter's exit), and no
worker process is left behind."""

from __future__ import annotations

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

from berth.engine import LLM, EngineConfig, SamplingParams
from berth.engine.executor import EngineDeadError, GenerationRequest
from berth.engine.executor.errors import RemoteTraceback, WorkerDiedError
from berth.engine.executor.proxy import ProxyExecutor
from tests.support.engine_processes import call_with_timeout, pid_alive, wait_until, worker_pids

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def test_kill_9_during_a_batch_fails_every_request_fast(tiny_model):
    llm = LLM(tiny_model, max_batch_size=16, kv_cache_blocks=512)
    try:
        results = [
            llm.generate_async([5 + i % 50] * (1 + i % 20), LONG, streaming=i % 2 == 0) for i in range(64)
        ]
        first_stream = iter(results[0])
        call_with_timeout(lambda: next(first_stream), 30)  # the batch is running
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

        calls = []

        def timed_health() -> bool:
            started = time.perf_counter()
            healthy = llm.check_health()
            calls.append(time.perf_counter() - started)
            return healthy

        assert wait_until(lambda: not timed_health(), timeout=5)
        assert max(calls) < 0.05
        assert isinstance(llm.executor.fatal_error, WorkerDiedError)
        assert llm.executor.admission_state == "failed"

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


def test_a_worker_killed_during_a_slow_load_is_noticed_at_once(tiny_model, tmp_path):
    model = tmp_path / "slow"
    shutil.copytree(tiny_model, model)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")  # reading it blocks: a model load that never ends
    outcome: dict[str, BaseException] = {}

    def start() -> None:
        try:
            ProxyExecutor(EngineConfig(model=str(model)), tokenizer=None)
        except BaseException as error:
            outcome["error"] = error

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    # The worker said who it is before loading, so the proxy already watches it.
    assert wait_until(lambda: worker_pids(), timeout=30)
    time.sleep(0.3)
    os.kill(worker_pids()[0], signal.SIGKILL)
    killed_at = time.monotonic()
    starter.join(10)
    assert not starter.is_alive()
    assert time.monotonic() - killed_at < 2
    assert isinstance(outcome["error"], WorkerDiedError)
    assert "loading the model" in str(outcome["error"])


def test_a_fatal_engine_error_reaches_every_client_with_its_root_cause(tiny_model):
    llm = LLM(tiny_model, max_batch_size=8)
    try:
        running = llm.generate_async("hello", LONG, streaming=True)
        call_with_timeout(lambda: next(iter(running)), 30)
        # A request that is signed and well-formed enough to be admitted, but breaks the engine
        # loop's stop check: not a RequestError, so the whole engine dies, and says why first.
        poison = GenerationRequest([5, 6], SamplingParams(max_tokens=4))
        poison.sampling_params.stop_token_ids = None
        poison.client_id = 10**9
        llm.executor._send(poison)
        with pytest.raises(EngineDeadError, match="not iterable"):
            call_with_timeout(lambda: running.result(timeout=10), 12)
        root = llm.executor.fatal_error
        assert isinstance(root, TypeError) and isinstance(root.__cause__, RemoteTraceback)
        assert "_check_stop" in root.__cause__.traceback
        assert not llm.check_health()
    finally:
        call_with_timeout(llm.shutdown, 10)
