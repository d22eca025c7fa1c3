"""Sleep and wakeup through a real `berth serve` (proxy + worker processes) over HTTP: 32
streams in flight drain (or are aborted), requests meanwhile get 503 + Retry-After, readiness
follows admission while liveness and health stay up, greedy outputs after a wakeup are the ones
before it, concurrent transitions get 409, a new revision shows where it serves, and a wakeup
that cannot restore the engine leaves it dead (and /health says so)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from berth.engine.models.tiny_model import make_tiny_model
from tests.serve.server_process import ADMIN_TOKEN, ServerProcess
from tests.serve.test_serve_lifecycle import Stream
from tests.support.engine_processes import pid_alive, wait_until
from tests.support.hung_file import HungFile

STREAMS = 32
SLEEP_ARGS = ("--max-batch-size", str(STREAMS), "--kv-blocks", "1024", "--kv-block-size", "16")
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], list(range(100, 130)), [9] * 17, [300, 200, 100], [77]]


# Sequences long enough that a stream runs for many seconds: it is surely in flight when a test
# puts the engine to sleep, however slow or fast the machine.
MAX_POSITIONS = 8192


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("long-tiny"), max_position_embeddings=MAX_POSITIONS)


@pytest.fixture(scope="module")
def sleeper(long_model: Path):
    """A server whose engine the tests put to sleep; each test leaves it awake."""
    process = ServerProcess(
        long_model, *SLEEP_ARGS, "--served-model-name", "tiny", "--model-revision", "v1",
        env={"BERTH_ADMIN_TOKEN": ADMIN_TOKEN},
        admin_token=ADMIN_TOKEN,
    )  # fmt: skip
    yield process
    assert process.stop() == 0, process.output


@pytest.fixture(autouse=True)
def awake_after_each_test(request):
    yield
    if "sleeper" in request.fixturenames:
        server = request.getfixturevalue("sleeper")
        # A test that failed mid-drain leaves a sleep under way: let it end (bounded), so that its
        # failure is not the next test's too.
        wait_until(lambda: server.admin_state()["admission"] not in ("parking", "waking"), 120)
        if server.admin_state()["admission"] == "parked":
            admin(server, "/admin/wakeup")
        assert server.admin_state()["admission"] == "running"


def admin(server: ServerProcess, path: str, body: dict | None = None, timeout: float = 300) -> httpx.Response:
    return httpx.post(
        server.url + path, json=body, headers=server.headers(server.admin_token), timeout=timeout
    )


def in_background(function) -> tuple[threading.Thread, dict]:
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("value", function()), daemon=True)
    thread.start()
    return thread, outcome


def completions(server: ServerProcess) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        response = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def assert_refused_while(server: ServerProcess, state: str) -> None:
    refused = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["Retry-After"]) > 0
    error = refused.json()["error"]
    assert error["code"] == "admission_closed" and f"admission state: {state}" in error["message"]
    ready = server.get("/ready")
    assert ready.status_code == 503 and ready.json()["admission"] == state
    assert server.get("/health").json() == {"status": "ok"}  # asleep is not dead
    assert server.get("/live").status_code == 200


def start_streams(server: ServerProcess, max_tokens: int) -> list[Stream]:
    body = {"max_tokens": max_tokens, "ignore_eos": True, "stream_options": {"include_usage": True}}
    streams = [Stream(server, {**body, "prompt": [5 + i, 6, 7]}) for i in range(STREAMS)]
    assert all(stream.started.wait(60) for stream in streams)
    assert all(stream.status == 200 for stream in streams)
    return streams


def completion_tokens(stream: Stream) -> int:
    return next(e["usage"]["completion_tokens"] for e in reversed(stream.events) if isinstance(e, dict))


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
def test_a_drain_lets_32_streams_finish_while_new_requests_get_503(sleeper):
    streams = start_streams(sleeper, max_tokens=300)  # outlasting the sleep's way to the engine
    asleep, outcome = in_background(lambda: admin(sleeper, "/admin/sleep", {"mode": "drain", "timeout": 300}))
    assert wait_until(lambda: sleeper.admin_state()["admission"] == "parking", 30)
    # The drain has something to drain: requests this server admitted and the engine has not
    # finished (the engine's own counts may not show them yet: its last stats came with the turn
    # that took the sleep up, and requests still on their way to it join the batch after).
    assert sleeper.admin_state()["num_pending"] > 0
    assert_refused_while(sleeper, "parking")

    asleep.join(300)
    response = outcome["value"]
    assert response.status_code == 200, response.text
    assert response.json()["admission"] == "parked" and response.json()["num_aborted"] == 0
    for stream in streams:
        assert stream.join(30) and stream.events[-1] == "[DONE]"
        assert stream.finish_reasons() == {0: "length"} and completion_tokens(stream) == 300
    assert_refused_while(sleeper, "parked")

    woken = admin(sleeper, "/admin/wakeup")
    assert woken.status_code == 200 and woken.json()["admission"] == "running", woken.text
    assert sleeper.get("/ready").status_code == 200


def test_abort_mode_ends_every_stream_with_abort(sleeper):
    streams = start_streams(sleeper, max_tokens=8000)
    response = admin(sleeper, "/admin/sleep", {"mode": "abort"})
    assert response.status_code == 200 and response.json()["num_aborted"] == STREAMS, response.text
    for stream in streams:
        assert stream.join(30) and stream.events[-1] == "[DONE]"
        assert stream.finish_reasons() == {0: "abort"} and completion_tokens(stream) < 8000
    assert_refused_while(sleeper, "parked")


def test_a_drain_whose_timeout_passes_aborts_what_is_left(sleeper):
    streams = start_streams(sleeper, max_tokens=8000)  # far more than a second's worth
    response = admin(sleeper, "/admin/sleep", {"mode": "drain", "timeout": 1})
    assert response.status_code == 200, response.text
    slept = response.json()
    assert slept["admission"] == "parked" and slept["num_aborted"] == STREAMS, slept
    assert slept["drain_seconds"] >= 1, slept
    for stream in streams:
        assert stream.join(30) and stream.events[-1] == "[DONE]"
        assert stream.finish_reasons() == {0: "abort"} and completion_tokens(stream) < 8000


def metric_samples(server: ServerProcess) -> dict:
    families = text_string_to_metric_families(server.get("/metrics").text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": "tiny", **labels}.items()))), 0.0)


@pytest.mark.parametrize("level", [1, 2])
def test_greedy_outputs_after_a_wakeup_are_the_ones_before_the_sleep(sleeper, level):
    before = completions(sleeper)
    metrics_before = metric_samples(sleeper)
    asked_at = time.time()
    response = admin(sleeper, "/admin/sleep", {"level": level})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["level"] == level and body["memory_after"]["kv_cache_bytes"] == 0

    state = sleeper.admin_state()
    assert state["admission"] == "parked" and state["sleep_level"] == level
    assert state["admission_since"] >= asked_at - 1
    assert state["kv_cache_bytes"] == 0  # level 1 on a CPU keeps the weights; level 2 drops them
    assert (state["weight_bytes"] > 0) == (level == 1)
    asleep = metric_samples(sleeper)
    assert metric(asleep, "berth_engine_admission_state", state="parked") == 1
    assert metric(asleep, "berth_engine_admission_state", state="running") == 0

    assert admin(sleeper, "/admin/wakeup", {}).status_code == 200
    assert completions(sleeper) == before
    after = metric_samples(sleeper)
    for to in ("parking", "parked", "waking", "running"):
        name = "berth_sleep_transitions_total"
        assert metric(after, name, to=to) - metric(metrics_before, name, to=to) == 1, to
    for kind in ("sleep", "wakeup"):
        name = "berth_sleep_transition_duration_seconds_count"
        assert metric(after, name, transition=kind) - metric(metrics_before, name, transition=kind) == 1
    state = sleeper.admin_state()
    assert state["sleep_level"] == 0 and state["kv_cache_bytes"] > 0 and state["weight_bytes"] > 0


def test_of_concurrent_transitions_exactly_one_runs_the_others_get_409(sleeper):
    # The winning sleep drains until this stream ends, and only the test ends it (it hangs up):
    # a drain that a timeout or the stream's own end closed raced the checks below (CI).
    stream = Stream(sleeper, {"prompt": [5, 6, 7], "max_tokens": 8000, "ignore_eos": True})
    assert stream.started.wait(60) and stream.status == 200
    start = threading.Barrier(2)

    def sleep_now() -> httpx.Response:
        start.wait()
        return admin(sleeper, "/admin/sleep", {"mode": "drain", "timeout": 120})

    sleeps = [in_background(sleep_now) for _ in range(2)]
    assert wait_until(lambda: sleeper.admin_state()["admission"] == "parking", 30)
    early = admin(sleeper, "/admin/wakeup")  # while the drain runs: another transition is running
    assert early.status_code == 409 and early.json()["error"]["code"] == "transition_conflict", early.text
    assert "another transition is running" in early.json()["error"]["message"]
    assert sleeper.admin_state()["admission"] == "parking"  # the refused wakeup changed nothing
    stream.hang_up()  # the server aborts the request: the drain has nothing left to wait for
    for thread, _ in sleeps:
        thread.join(300)
    statuses = sorted(outcome["value"].status_code for _, outcome in sleeps)
    assert statuses == [200, 409], [o["value"].text for _, o in sleeps]
    assert stream.join(30) and stream.finish_reasons() == {}  # it was still running when hung up
    slept = next(o["value"].json() for _, o in sleeps if o["value"].status_code == 200)
    assert slept["admission"] == "parked" and slept["drain_seconds"] < 120, slept

    again = admin(sleeper, "/admin/sleep")
    assert again.status_code == 409 and "already asleep" in again.json()["error"]["message"]
    start = threading.Barrier(2)

    def wake_now() -> httpx.Response:
        start.wait()
        return admin(sleeper, "/admin/wakeup")

    wakeups = [in_background(wake_now) for _ in range(2)]
    for thread, _ in wakeups:
        thread.join(300)
    assert sorted(outcome["value"].status_code for _, outcome in wakeups) == [200, 409]
    assert sleeper.admin_state()["admission"] == "running"  # never a half-done state


def test_a_new_revision_is_served_and_shown_and_one_that_does_not_fit_is_refused(
    sleeper, long_model, tmp_path
):
    second, narrow = tmp_path / "second", tmp_path / "narrow"
    make_tiny_model(second, seed=5, max_position_embeddings=MAX_POSITIONS)
    make_tiny_model(narrow, hidden_size=32, max_position_embeddings=MAX_POSITIONS)
    first = sleeper.admin_state()["model_revision"]
    assert first["path"] == str(long_model) and first["digest"].startswith("sha256:")
    assert first["label"] == "v1"  # --model-revision
    before = completions(sleeper)
    assert admin(sleeper, "/admin/sleep", {"level": 2}).status_code == 200
    for bad, what in (
        (narrow, "hidden_size 32 (serving: 64)"),
        (tmp_path / "missing", "not a model directory"),
    ):
        refused = admin(sleeper, "/admin/wakeup", {"model": str(bad)})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_model" and error["param"] == "model" and what in error["message"]
        assert sleeper.admin_state()["admission"] == "parked"

    woken = admin(sleeper, "/admin/wakeup", {"model": str(second), "revision": "v2"})
    assert woken.status_code == 200 and woken.json()["model_revision"]["label"] == "v2", woken.text
    card = sleeper.get("/v1/models").json()["data"][0]
    state = sleeper.admin_state()
    assert card["id"] == "tiny" and card["root"] == str(second) == state["model_revision"]["path"]
    assert card["revision"] == state["model_revision"]["digest"] != first["digest"]
    assert state["model_revision"]["label"] == "v2"
    second_texts = completions(sleeper)
    assert second_texts != before

    # The same directory rewritten (as a sync job would), re-read in place under a new name.
    make_tiny_model(second, seed=6, max_position_embeddings=MAX_POSITIONS)
    assert admin(sleeper, "/admin/sleep").status_code == 200
    assert admin(sleeper, "/admin/wakeup", {"model": str(second), "revision": "v3"}).status_code == 200
    rewritten = sleeper.admin_state()["model_revision"]
    assert rewritten["path"] == str(second) and rewritten["label"] == "v3"
    assert rewritten["digest"] != state["model_revision"]["digest"]
    assert completions(sleeper) not in (before, second_texts)

    assert admin(sleeper, "/admin/sleep").status_code == 200  # and back to the first, unnamed
    assert admin(sleeper, "/admin/wakeup", {"model": str(long_model)}).status_code == 200
    assert sleeper.admin_state()["model_revision"] == {**first, "label": None}
    assert completions(sleeper) == before


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/admin/sleep", {"level": 3}, "level"),
        ("/admin/sleep", {"level": True}, "level"),
        ("/admin/sleep", {"mode": "nap"}, "mode"),
        ("/admin/sleep", {"timeout": -1}, "timeout"),
        ("/admin/sleep", {"levle": 2}, "levle"),
        ("/admin/wakeup", {"model": ""}, "model"),
        ("/admin/wakeup", {"revision": "v2"}, "revision"),  # names weights it would not load
        ("/admin/wakeup", {"model": "/m", "revision": ""}, "revision"),
        ("/admin/wakeup", '{"model": "\\ud800"}', "model"),  # a lone surrogate: not a path
    ],
)
def test_bad_transition_parameters_get_a_400_and_change_nothing(sleeper, path, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        sleeper.url + path,
        content=content,
        headers={**sleeper.headers(sleeper.admin_token), "content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert sleeper.admin_state()["admission"] == "running"


def test_transitions_need_the_admin_token(sleeper):
    for path in ("/admin/sleep", "/admin/wakeup"):
        assert httpx.post(sleeper.url + path, json={}, timeout=10).status_code == 401
    assert sleeper.admin_state()["admission"] == "running"


def test_a_wakeup_that_cannot_restore_the_engine_leaves_it_dead_and_health_says_so(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    server = ServerProcess(model, *SLEEP_ARGS)
    try:
        assert admin(server, "/admin/sleep", {"level": 2}).status_code == 200
        (model / "model.safetensors").unlink()  # the weights to reload are gone
        response = admin(server, "/admin/wakeup")
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead", (
            response.text
        )
        assert "wakeup failed" in response.json()["error"]["message"]
        health = server.get("/health")
        assert health.status_code == 503 and "FileNotFoundError" in health.json()["error"]
        assert server.admin_state()["admission"] == "failed"
        samples = metric_samples(server)
        name = str(model)
        assert samples[("berth_sleep_transitions_total", (("model_name", name), ("to", "failed")))] == 1
        assert samples[("berth_engine_admission_state", (("model_name", name), ("state", "failed")))] == 1
        refused = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
        server.terminate()
        assert server.wait(30) == 0, server.output  # a dead world never hangs the exit
    finally:
        server.stop()


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
def test_a_wakeup_whose_weight_read_hangs_is_declared_stalled_within_its_deadline(tiny_model, tmp_path):
    """A level-2 wakeup reads its weights from the model directory; here opening them never
    returns (a file held by a lease nobody gives up: `HungFile`, what a hung network mount does).
    Past --transition-timeout the engine is dead with reason "stalled" naming the wakeup, its world
    is killed, and the server says so for as long as it lives (the operator restarts dead worlds)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    deadline = 3.0
    server = ServerProcess(model, *SLEEP_ARGS, "--transition-timeout", str(deadline))
    try:
        worker = server.engine_pid
        assert admin(server, "/admin/sleep", {"level": 2}).status_code == 200
        with HungFile(model / "model.safetensors"):
            started = time.monotonic()
            response = admin(server, "/admin/wakeup", timeout=deadline + 30)
            took = time.monotonic() - started
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead", (
            response.text
        )
        assert deadline <= took < deadline + 5, took
        health = server.get("/health")
        assert health.status_code == 503 and health.json()["reason"] == "stalled", health.text
        error = health.json()["error"]
        assert f"the wakeup did not complete in {deadline:g} s" in error and "rank 0" in error, error
        assert wait_until(lambda: not pid_alive(worker), 10), "the stalled world was left running"
        assert server.admin_state()["admission"] == "failed"
        server.terminate()
        assert server.wait(30) == 0, server.output
    finally:
        server.stop()
