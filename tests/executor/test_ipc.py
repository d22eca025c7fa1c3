"""The wire: signed messages, and what happens to a message that is not (it is never unpickled)."""

from __future__ import annotations

import hashlib
import hmac
import pickle
import time

import numpy as np
import pytest
import zmq

from berth.engine import EngineConfig, SamplingParams
from berth.engine.executor import GenerationRequest, ipc
from berth.engine.executor.proxy import ProxyExecutor
from berth.engine.tokenizer import load_tokenizer
from tests.support.engine_processes import call_with_timeout, wait_until
from tests.support.forgery import LeavesATrace


def forgeries(key: bytes, payload: bytes) -> list[list[bytes]]:
    """Every way a message can fail to be authentic, each carrying `payload`."""
    wrong_key = hmac.new(b"x" * 32, ipc.REQUESTS + payload, hashlib.sha256).digest()
    other_queue = hmac.new(key, ipc.RESULTS + payload, hashlib.sha256).digest()
    return [
        [payload],  # no signature at all
        [b"\0" * 32, payload],  # a made-up one
        [wrong_key, payload],  # signed with another key
        [other_queue, payload],  # a genuine signature from another queue: no replay across queues
        [b"", b"", payload],  # malformed
    ]


@pytest.fixture
def socket_pair():
    context = zmq.Context()
    key = ipc.new_key()
    address = f"inproc://test-{time.monotonic_ns()}"
    receiver = ipc.open_socket(context, zmq.PULL, address, key, ipc.REQUESTS, bind=True)
    sender = ipc.open_socket(context, zmq.PUSH, address, key, ipc.REQUESTS, bind=False)
    yield key, sender, receiver
    sender.close()
    receiver.close()
    context.term()


def test_signed_messages_round_trip(socket_pair):
    _, sender, receiver = socket_pair
    request = GenerationRequest(np.arange(10), SamplingParams(max_tokens=3), streaming=True)
    sender.send(request)
    received = receiver.recv(1000)
    assert isinstance(received, GenerationRequest) and received.streaming
    assert received.prompt_token_ids.dtype == np.int32
    assert received.prompt_token_ids.tolist() == list(range(10))


def test_forged_messages_are_dropped_without_unpickling(socket_pair, tmp_path):
    key, sender, receiver = socket_pair
    trace = tmp_path / "unpickled"
    payload = pickle.dumps(LeavesATrace(trace))
    for frames in forgeries(key, payload):
        sender.socket.send_multipart(frames)
    sender.send("genuine")
    assert receiver.recv(1000) == "genuine"  # the forgeries before it were skipped
    assert receiver.num_dropped == 5
    assert not trace.exists()


def test_a_long_prompt_travels_as_one_int32_buffer():
    request = GenerationRequest(list(range(32_768)), SamplingParams())
    assert len(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)) < 32_768 * 4 + 2_000


def test_a_forged_request_never_reaches_the_worker_and_the_engine_keeps_serving(tiny_model, tmp_path, capfd):
    # tcp here (the cross-host transport); the other tests use ipc.
    executor = ProxyExecutor(
        EngineConfig(model=str(tiny_model), max_batch_size=4), load_tokenizer(tiny_model), transport="tcp"
    )
    try:
        request_address = executor.identities[0].request_address
        assert request_address.startswith("tcp://127.0.0.1:")
        trace = tmp_path / "unpickled"
        payload = pickle.dumps(LeavesATrace(trace))
        context = zmq.Context()
        intruder = context.socket(zmq.PUSH)
        # Long enough for the connection to come up on a loaded machine (sends before it are
        # queued, and dropped when the linger runs out).
        intruder.setsockopt(zmq.LINGER, 15_000)
        intruder.connect(request_address)
        for frames in forgeries(executor.key, payload):
            intruder.send_multipart(frames)
        intruder.close()
        context.term()  # waits (up to the linger) until the forgeries are on the wire
        worker_log: list[str] = []  # the worker inherited our stderr: capfd sees what it logs

        def all_dropped() -> bool:
            worker_log.append(capfd.readouterr().err)
            return "".join(worker_log).count("not unpickled") == 5

        assert wait_until(all_dropped, timeout=30)
        result = executor.submit(GenerationRequest([5, 6, 7], SamplingParams(temperature=0, max_tokens=4)))
        assert len(result.result(timeout=30).outputs[0].token_ids) == 4
        assert executor.check_health()
        assert not trace.exists()
    finally:
        call_with_timeout(executor.shutdown, 30)
