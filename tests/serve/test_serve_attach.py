"""Attached frontends: several `berth serve --attach tcp://OWNER:PORT` processes serve the one
engine that `berth serve MODEL --attach-port PORT` owns. Each gets its own results, only the
owner owns the engine's life (a frontend that closes or is killed loses its own requests and
nothing else), and frontends outlive the engine's worlds. Real processes, real kill -9."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zmq

from berth.engine import LLM, SamplingParams
from berth.engine.executor import EngineDeadError, ipc
from berth.engine.executor.attach import AttachEndpoint
from berth.engine.executor.messages import ATTACH_PROTOCOL, AttachHello
from berth.operator import render
from tests.serve.server_process import (
    ADMIN_TOKEN,
    ENGINE_ARGS,
    ENGINE_OPTIONS,
    MODEL_NAME,
    ServerProcess,
    long_context_copy,
)
from tests.support.engine_processes import call_with_timeout, wait_until
from tests.support.forgery import LeavesATrace
from tests.support.model_revisions import reversed_vocabulary

KEY = secrets.token_hex(32)
ENV = {"BERTH_ENGINE_KEY": KEY, "BERTH_ADMIN_TOKEN": ADMIN_TOKEN}
LONG = 900  # tokens: requests that are still running when a frontend goes
WORDS = ("rivers", "stars", "bread", "engines", "maps", "owls", "glass", "rain")


def start_owner(model: Path, *args: str) -> ServerProcess:
    return ServerProcess(
        model, *ENGINE_ARGS, "--served-model-name", MODEL_NAME, *args, env=ENV, admin_token=ADMIN_TOKEN
    )


def frontend_args(address: str) -> list[str]:
    """The command the operator renders for a frontend pod, pointed at `address` and a free port
    of 127.0.0.1 instead of the launcher's Service and port 8000 of a pod of its own."""
    rendered = render.frontend_command(render.Owner("llama", "default", "uid"), 0)
    assert rendered[:3] == ["berth", "serve", "--attach"]
    moved = {rendered[3]: address, "0.0.0.0": "127.0.0.1", "8000": "0"}
    return [moved.get(arg, arg) for arg in rendered[2:]]


def start_frontends(address: str, count: int) -> list[ServerProcess]:
    def start(_) -> ServerProcess:
        return ServerProcess(None, *frontend_args(address), env=ENV, admin_token=ADMIN_TOKEN)

    with ThreadPoolExecutor(count) as pool:  # they start in parallel: each takes seconds
        return list(pool.map(start, range(count)))


@pytest.fixture(scope="module")
def world(tiny_model: Path):
    """An owner and two frontends attached to it (the last test to use them kills one)."""
    owner = start_owner(tiny_model, "--attach-port", "0")
    frontends: list[ServerProcess] = []
    try:
        frontends = start_frontends(owner.attach_address, 2)
        yield owner, frontends
    finally:
        for server in (*frontends, owner):
            server.stop()


def completion(body_extra: dict | None = None, **fields) -> dict:
    return {"model": MODEL_NAME, "temperature": 0, **fields, **(body_extra or {})}


async def stream(
    client: httpx.AsyncClient,
    server: ServerProcess,
    body: dict,
    first_token: threading.Semaphore | None = None,
) -> dict:
    """One streamed completion, read to its end: its text, finish reason and token count.
    `first_token` is released when its first token arrives (it is in the engine then)."""
    text, finish, tokens = "", None, None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                if first_token is not None and not text and choice["text"]:
                    first_token.release()
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"text": text, "finish_reason": finish, "tokens": tokens}


def streams(jobs: list[tuple[ServerProcess, dict]], first_token: threading.Semaphore | None = None) -> list:
    async def main() -> list:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(stream(client, server, body, first_token) for server, body in jobs), return_exceptions=True
            )

    return asyncio.run(main())


class Streams(threading.Thread):
    """Streamed completions read on a thread of their own: `outcome` once it is joined."""

    def __init__(self, jobs: list[tuple[ServerProcess, dict]]) -> None:
        super().__init__(daemon=True)
        self.jobs, self.outcome = jobs, []
        self._first_tokens = threading.Semaphore(0)

    def run(self) -> None:
        self.outcome.extend(streams(self.jobs, self._first_tokens))

    def all_generating(self, timeout: float) -> bool:
        """True once every stream has had its first token, i.e. all of them are in the engine.
        What the tests wait for before acting on requests in flight: the owner's running count,
        looked at over HTTP, can miss a request whole when a loaded machine slows the looks down
        (CI saw 900-token streams end between two looks)."""
        deadline = time.monotonic() + timeout
        return all(
            self._first_tokens.acquire(timeout=max(0.0, deadline - time.monotonic())) for _ in self.jobs
        )


def in_background(jobs: list[tuple[ServerProcess, dict]]) -> Streams:
    thread = Streams(jobs)
    thread.start()
    return thread


def successes(server: ServerProcess) -> float:
    """Sequences this server has finished (its own /metrics)."""
    metrics = server.get("/metrics").text
    return sum(float(v) for v in re.findall(r"^berth_request_success_total\{[^}]*\} (\S+)$", metrics, re.M))


# ---- one engine, two frontends --------------------------------------------------------------------


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
def test_two_frontends_serve_64_concurrent_streams_each_getting_its_own(world):
    owner, (a, b) = world
    bodies = [
        completion(
            prompt=f"Request {i} is about {WORDS[i % len(WORDS)]}", max_tokens=8 + i % 7, ignore_eos=True
        )
        for i in range(64)
    ]
    before = [successes(a), successes(b)]
    via_frontends = streams([((a, b)[i % 2], body) for i, body in enumerate(bodies)])
    via_owner = streams([(owner, body) for body in bodies])
    for body, got, expected in zip(bodies, via_frontends, via_owner):
        assert not isinstance(got, BaseException), got
        assert got == expected  # the text of its own prompt: nothing crossed between frontends
        assert got["finish_reason"] == "length" and got["tokens"] == body["max_tokens"]
    assert [successes(a) - before[0], successes(b) - before[1]] == [32, 32]  # each counted its own
    assert owner.wait_idle()
    for frontend in (a, b):
        assert frontend.wait_idle()  # nothing pending, nothing running in the shared engine


def test_a_frontend_serves_the_whole_api_for_the_owners_engine(world):
    owner, (a, _) = world
    models = a.get("/v1/models").json()
    assert [card["id"] for card in models["data"]] == [MODEL_NAME]  # the owner's name
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Name a river."}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    answers = [server.post("/v1/chat/completions", chat) for server in (owner, a)]
    assert all(answer.status_code == 200 for answer in answers), [answer.text for answer in answers]
    mine, owners = (answer.json()["choices"] for answer in reversed(answers))
    assert mine == owners  # text, logprobs and finish reason: the owner's own
    assert a.get("/live").status_code == 200
    assert a.get("/health").json() == {"status": "ok"}
    metrics = a.get("/metrics").text
    assert f'berth_num_requests_running{{model_name="{MODEL_NAME}"}}' in metrics
    assert f'berth_engine_admission_state{{model_name="{MODEL_NAME}",state="running"}} 1.0' in metrics
    for server in (owner, a):  # what Prometheus scrapes passes its own linter
        exported = server.get("/metrics").text
        lint = subprocess.run(
            ["promtool", "check", "metrics"], input=exported, capture_output=True, text=True, timeout=30
        )
        assert lint.returncode == 0, lint.stdout + lint.stderr
    state = a.admin_state()
    assert state["engine_pid"] == owner.engine_pid and state["admission"] == "running"


def test_an_unsigned_or_wrongly_signed_attach_is_refused_before_unpickling(world, tmp_path):
    owner, frontends = world
    trace = tmp_path / "unpickled"
    payload = pickle.dumps(LeavesATrace(trace))
    context = zmq.Context()
    intruder = ipc.open_socket(
        context, zmq.DEALER, owner.attach_address, b"\x01" * 32, ipc.ATTACH, bind=False
    )
    try:
        intruder.send(AttachHello(ATTACH_PROTOCOL, os.getpid(), "intruder"))  # signed, with another key
        intruder.socket.send_multipart([bytes(32), payload])  # a made-up signature
        intruder.socket.send_multipart([payload])  # none at all
        assert intruder.socket.poll(2000) == 0  # no answer of any kind
        assert wait_until(lambda: owner.output.count("on the attach queue") >= 3, 10), owner.output
    finally:
        intruder.close()
        context.term()
    assert (
        "dropped a message from 127.0.0.1 on the attach queue: bad signature (not unpickled)" in owner.output
    )
    assert not trace.exists()
    # The engine never noticed: the owner and the frontends serve on.
    for server in (owner, *frontends):
        response = server.post("/v1/completions", completion(prompt="still here", max_tokens=3))
        assert response.status_code == 200, response.text
        assert server.get("/health").status_code == 200


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
def test_a_frontend_that_closes_aborts_its_own_requests_only(world):
    owner, (a, _) = world
    llm = LLM.attach(owner.attach_address, key=bytes.fromhex(KEY))  # a frontend in this process
    long = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    theirs = in_background([(a, completion(prompt="the other frontend's", max_tokens=LONG, ignore_eos=True))])
    try:
        assert llm.wait_attached(30)
        mine = [llm.generate_async(f"mine {i}", long, streaming=True) for i in range(3)]
        assert theirs.all_generating(30)
        assert wait_until(lambda: all(result.token_step_times for result in mine), 30)
    finally:
        call_with_timeout(llm.shutdown, 15)
    for result in mine:
        # Failed by the shutdown, or (when the owner's aborts came back first) ended by them.
        try:
            output = result.result(timeout=5).outputs[0]
        except EngineDeadError as error:
            assert "shut down" in str(error)
        else:
            assert output.finish_reason == "abort" and len(output.token_ids) < LONG, output
    theirs.join(120)
    [other] = theirs.outcome
    assert not isinstance(other, BaseException), other
    assert other["finish_reason"] == "length" and other["tokens"] == LONG
    # Its Detach, or the closed connection when the owner's next token for it was refused first
    # (the router forgets a peer's route at the close, before it has read the peer's last message).
    gone = r"frontend \d+ \(.*\) is gone \((it detached|its connection closed)\): aborted its 3 requests"
    assert re.search(gone, owner.output), owner.output


# ---- the owner sleeps, its frontends follow ----------------------------------------------------


def admin(server: ServerProcess, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers(ADMIN_TOKEN), timeout=300)


def refusal(server: ServerProcess) -> tuple:
    response = server.post("/v1/completions", completion(prompt="asleep?", max_tokens=2))
    return response.status_code, response.headers.get("Retry-After"), response.json()


def test_frontends_follow_the_owners_sleep_and_wakeup_and_cannot_drive_them(world):
    owner, frontends = world
    a = frontends[0]
    # A drain lets a frontend's stream in flight finish, as it does the owner's own.
    in_flight = in_background([(a, completion(prompt="drained", max_tokens=LONG, ignore_eos=True))])
    assert in_flight.all_generating(30)
    slept = admin(owner, "/admin/sleep", {"level": 1, "mode": "drain"})
    assert slept.status_code == 200 and slept.json()["admission"] == "parked", slept.text
    in_flight.join(120)
    [drained] = in_flight.outcome
    assert not isinstance(drained, BaseException), drained
    assert drained["finish_reason"] == "length" and drained["tokens"] == LONG
    owners = refusal(owner)
    assert owners[0] == 503 and int(owners[1]) > 0 and owners[2]["error"]["code"] == "admission_closed"
    for frontend in frontends:
        assert refusal(frontend) == owners  # the engine's own refusal, word for word
        assert wait_until(lambda f=frontend: f.get("/ready").json()["admission"] == "parked", 10)
        ready = frontend.get("/ready")
        assert ready.status_code == 503 and not ready.json()["ready"], ready.text
        assert frontend.get("/health").json() == {"status": "ok"}  # asleep is not dead
        state = frontend.admin_state()
        assert state["admission"] == "parked" and state["sleep_level"] == 1, state
        assert state["model_revision"] == owner.admin_state()["model_revision"]
    # Sleep and wakeup are the owner's: a frontend refuses them, and the engine is untouched.
    for path in ("/admin/wakeup", "/admin/sleep"):
        refused = admin(a, path)
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "not_engine_owner" and owner.attach_address in error["message"], error
    assert owner.admin_state()["admission"] == "parked"
    woken = admin(owner, "/admin/wakeup")
    assert woken.status_code == 200 and woken.json()["admission"] == "running", woken.text
    for frontend in frontends:
        assert wait_until(lambda f=frontend: serving(f), 10, interval=0.2), frontend.output
    assert admin(a, "/admin/sleep").status_code == 403  # awake or asleep: never a frontend's
    assert owner.admin_state()["admission"] == "running"


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
def test_kill_9_of_a_frontend_aborts_exactly_its_requests(world):
    owner, (a, b) = world
    body = completion(prompt="a long one", max_tokens=LONG, ignore_eos=True)
    of_a = in_background([(a, body)] * 4)
    of_b = in_background([(b, body)] * 4)
    assert of_a.all_generating(30) and of_b.all_generating(30)
    a.process.kill()  # kill -9: no goodbye, the connection just closes
    a.process.wait(10)
    gone = r"frontend \d+ \(.*\) is gone \(its connection closed\): aborted its 4 requests"
    assert wait_until(lambda: re.search(gone, owner.output), 10), owner.output
    of_b.join(120)
    assert len(of_b.outcome) == 4
    for result in of_b.outcome:
        assert not isinstance(result, BaseException), result
        assert result["finish_reason"] == "length" and result["tokens"] == LONG
    assert all(isinstance(result, BaseException) for result in of_a.outcome)
    assert owner.get("/health").status_code == 200 and owner.wait_idle()


# ---- frontends outlive worlds ----------------------------------------------------------------------


def unavailable(server: ServerProcess) -> bool:
    response = server.post("/v1/completions", completion(prompt="anyone?", max_tokens=2))
    return response.status_code == 503 and response.headers.get("Retry-After") is not None


def serving(server: ServerProcess) -> bool:
    response = server.post("/v1/completions", completion(prompt="anyone?", max_tokens=2))
    return response.status_code == 200 and server.get("/ready").status_code == 200


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
def test_frontends_outlive_their_world_and_attach_to_the_next(tiny_model, tmp_path):
    # 6,000 tokens: CI saw a 900-token stream end inside the second owner's half-second drain.
    tiny_model, longest = long_context_copy(tiny_model, tmp_path, 8192), 6000
    owner = start_owner(tiny_model, "--attach-port", "0")
    servers = [owner]
    try:
        frontends = start_frontends(owner.attach_address, 2)
        servers += frontends
        pids = [frontend.pid for frontend in frontends]
        port = owner.attach_address.rsplit(":", 1)[1]
        os.kill(owner.engine_pid, signal.SIGKILL)
        for frontend in frontends:
            assert wait_until(lambda f=frontend: unavailable(f), 10, interval=0.2)
            assert frontend.get("/ready").status_code == 503
            health = frontend.get("/health")
            assert health.status_code == 503 and "killed by signal 9" in health.json()["error"], health.text
        # The operator restarts the world whole: a new owner at the same address.
        owner.stop()
        # (A drain short enough that the frontend's long stream below outlasts it.)
        owner = start_owner(tiny_model, "--attach-port", port, "--shutdown-timeout", "0.5")
        servers.append(owner)
        for frontend in frontends:
            assert wait_until(lambda f=frontend: serving(f), 30, interval=0.2), frontend.output
            assert frontend.admin_state()["engine_pid"] == owner.engine_pid  # the new engine's
        assert [frontend.pid for frontend in frontends] == pids
        assert all(frontend.process.poll() is None for frontend in frontends)  # never restarted
        # An owner that stops cleanly drains the frontends' requests with its own; what its
        # drain timeout leaves is aborted and answered; then it tells them: they are unavailable
        # again, and wait for the next world.
        stream_running = in_background(
            [(frontends[0], completion(prompt="late", max_tokens=longest, ignore_eos=True))]
        )
        assert stream_running.all_generating(30)
        owner.terminate()
        stream_running.join(60)
        [aborted] = stream_running.outcome
        assert not isinstance(aborted, BaseException), aborted
        assert aborted["finish_reason"] == "abort" and aborted["tokens"] < longest
        assert owner.wait(30) == 0
        assert all(wait_until(lambda f=frontend: unavailable(f), 10, interval=0.2) for frontend in frontends)
    finally:
        for server in reversed(servers):
            server.stop()


def test_a_weight_swap_to_another_tokenizer_sends_the_frontends_to_attach_again(tiny_model, tmp_path):
    """A frontend tokenizes and detokenizes itself: after a wakeup with a revision whose
    tokenizer differs, it must not go on with the old one. The owner ends its attachment and it
    attaches again, to the new tokenizer."""
    retemplated = shutil.copytree(tiny_model, tmp_path / "retemplated")
    with open(retemplated / "chat_template.jinja", "a") as template:
        template.write("{# another revision #}")
    with LLM(tiny_model, **ENGINE_OPTIONS) as owner:
        endpoint = AttachEndpoint("tcp://127.0.0.1:0", bytes.fromhex(KEY))
        endpoint.start(owner.executor, MODEL_NAME)
        frontend = LLM.attach(endpoint.address, key=bytes.fromhex(KEY))
        try:
            assert frontend.wait_attached(30)
            first = frontend.executor.frontend_id
            assert "another revision" not in frontend.tokenizer.chat_template
            call_with_timeout(lambda: owner.sleep(2), 120)
            call_with_timeout(lambda: owner.wake_up(retemplated), 120)
            assert wait_until(lambda: frontend.executor.frontend_id not in (None, first), 30)
            assert "another revision" in frontend.tokenizer.chat_template
            params = SamplingParams(temperature=0, max_tokens=4)
            assert frontend.generate("again", params)[0].outputs[0].text == (
                owner.generate("again", params)[0].outputs[0].text
            )
        finally:
            call_with_timeout(frontend.shutdown, 15)
            endpoint.close()


# Long enough that the first streams still run when the last of the 16 is admitted (CI saw
# 200-token ones end first on a loaded machine) and while the test checks admission; the
# 16 fit the owner's 1,024 KV blocks at once.
DRAIN_TOKENS = LONG


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
def test_sigterm_on_the_owner_drains_every_frontends_streams_then_exits_0(tiny_model):
    """SIGTERM to the owner stops admission for every frontend at once (503 + Retry-After, not
    ready), lets the 16 streams the two frontends have in flight finish, and only then shuts the
    engine down and exits 0."""
    owner = start_owner(tiny_model, "--attach-port", "0", "--kv-blocks", "1024", "--shutdown-timeout", "120")
    frontends: list[ServerProcess] = []
    try:
        frontends = start_frontends(owner.attach_address, 2)
        bodies = [
            completion(prompt=f"Drain {i}: {WORDS[i % len(WORDS)]}", max_tokens=DRAIN_TOKENS, ignore_eos=True)
            for i in range(16)
        ]
        streaming = in_background([(frontends[i % 2], body) for i, body in enumerate(bodies)])
        assert streaming.all_generating(60), owner.admin_state()
        owner.terminate()
        for frontend in frontends:
            assert wait_until(lambda f=frontend: f.get("/ready").status_code == 503, 5), frontend.get(
                "/ready"
            )
            assert frontend.get("/ready").json()["admission"] == "shutdown"
            refused = frontend.post("/v1/completions", completion(prompt="too late", max_tokens=2))
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "admission_closed", refused.text
            assert int(refused.headers["Retry-After"]) > 0
        assert owner.post("/v1/completions", completion(prompt="too late", max_tokens=2)).status_code == 503
        assert streaming.is_alive(), "the streams ended before admission was checked: make them longer"
        streaming.join(120)
        assert not streaming.is_alive()
        for outcome in streaming.outcome:
            assert not isinstance(outcome, BaseException), outcome
            assert outcome["finish_reason"] == "length" and outcome["tokens"] == DRAIN_TOKENS, outcome
        assert owner.wait(30) == 0, owner.output
    finally:
        for server in (*frontends, owner):
            server.stop()


SWAP_PROMPTS = ("rivers and stars", "bread in the rain", "owls over glass", "maps of engines")


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
def test_a_wakeup_with_another_tokenizer_never_serves_a_request_with_the_wrong_one(tiny_model, tmp_path):
    """Requests fired at the owner and a frontend all through wakeups that swap in a revision
    with another vocabulary (and back, and again): every answer is the revision's own (its
    tokenizer in, its weights, its tokenizer out); none is tokenized or detokenized with the
    other revision's tokenizer, whose ids read as other words."""
    revision = reversed_vocabulary(tiny_model, 7, tmp_path / "revision")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    texts = {}
    for model in (tiny_model, revision):
        with LLM(model, executor="in-process", **ENGINE_OPTIONS) as reference:
            outputs = reference.generate(list(SWAP_PROMPTS), params)
        texts[model] = {p: output.outputs[0].text for p, output in zip(SWAP_PROMPTS, outputs)}
    assert all(texts[revision][p] != texts[tiny_model][p] for p in SWAP_PROMPTS)  # they tell apart
    owner = start_owner(tiny_model, "--attach-port", "0")
    frontends: list[ServerProcess] = []
    try:
        frontends = start_frontends(owner.attach_address, 1)
        servers = (owner, *frontends)
        for model in (revision, tiny_model, revision):
            assert admin(owner, "/admin/sleep", {"level": 2}).status_code == 200
            answers = fire_through(
                servers, 6, lambda m=model: admin(owner, "/admin/wakeup", {"model": str(m)})
            )
            for url, prompt, status, text in answers:
                assert status in (200, 503), (url, prompt, status)
                if status == 200:
                    assert text == texts[model][prompt], (url, prompt, text, texts[model][prompt])
    finally:
        for server in (*frontends, owner):
            server.stop()


def fire_through(servers, threads_each: int, wake) -> list[tuple[str, str, int, str | None]]:
    """Completions fired at every server by `threads_each` threads each while `wake()` runs, and
    until each server has answered 20 of them since; every answer, as (url, prompt, status, text)."""
    answers: list[tuple[str, str, int, str | None]] = []
    stop = threading.Event()

    def fire(server: ServerProcess, offset: int) -> None:
        with httpx.Client(timeout=30) as client:
            for i in itertools.count(offset):
                if stop.is_set():
                    return
                prompt = SWAP_PROMPTS[i % len(SWAP_PROMPTS)]
                body = completion(prompt=prompt, max_tokens=6, ignore_eos=True)
                response = client.post(f"{server.url}/v1/completions", json=body)
                text = response.json()["choices"][0]["text"] if response.status_code == 200 else None
                answers.append((server.url, prompt, response.status_code, text))

    firing = [
        threading.Thread(target=fire, args=(server, i), daemon=True)
        for server in servers
        for i in range(threads_each)
    ]
    for thread in firing:
        thread.start()
    try:
        woken = wake()
        assert woken.status_code == 200, woken.text
        served = lambda url: sum(1 for a in answers if a[0] == url and a[2] == 200)  # noqa: E731
        assert wait_until(lambda: all(served(s.url) >= 20 for s in servers), 60), answers[-5:]
    finally:
        stop.set()
        for thread in firing:
            thread.join(30)
    return answers
