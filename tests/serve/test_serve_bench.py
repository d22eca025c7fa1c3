"""`berth bench serve` end to end: it starts `berth serve` itself, loads it, stops it, measures
the offline baseline, and prints vLLM-style figures and the served / offline ratio."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

REPORTED = (
    "Successful requests",
    "Request throughput (req/s)",
    "Output token throughput (tok/s)",
    "Median TTFT (ms)",
    "P99 TTFT (ms)",
    "P90 ITL (ms)",
    "P99 ITL (ms)",
    "Median TPOT (ms)",
    "P99 E2EL (ms)",
    "Offline output throughput (tok/s)",
    "Served / offline output throughput",
    "Median, reused connection (ms)",
    "Median, new connection (ms)",
)


def figure(stdout: str, label: str) -> float:
    match = re.search(rf"^{re.escape(label)}:\s+([\d.]+)$", stdout, re.MULTILINE)
    assert match, f"{label!r} missing from:\n{stdout}"
    return float(match.group(1))


def bench_serve(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`berth bench serve ARGS`, its output captured."""
    command = [sys.executable, "-m", "berth", "bench", "serve", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.slow  # `berth bench serve` against servers it starts (two setups per run)
def test_bench_serve_reports_latencies_throughput_and_the_offline_ratio(tiny_model, tmp_path):
    plot = tmp_path / "latency.png"
    result = bench_serve(
        str(tiny_model), "--num-requests", "12", "--input-len", "4", "16", "--output-len", "4", "16",
        "--batch-size", "8", "--max-concurrency", "6", "--dtype", "bfloat16", "--plot", str(plot),
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    values = {label: figure(result.stdout, label) for label in REPORTED}
    assert values["Successful requests"] == 12
    assert figure(result.stdout, "Failed requests") == 0
    assert figure(result.stdout, "Maximum request concurrency") == 6
    assert all(value > 0 for value in values.values()), values
    assert values["P99 TTFT (ms)"] >= values["Median TTFT (ms)"]
    assert "dtype bfloat16" in result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_refuses_bad_arguments(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "berth", "bench", "serve", str(tmp_path), "--max-concurrency", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--max-concurrency" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # `berth bench serve` against servers it starts (two setups per run)
def test_bench_serve_compares_frontends_and_postprocess_workers_with_the_single_process_server(tiny_model):
    result = bench_serve(
        str(tiny_model), "--num-requests", "8", "--input-len", "4", "8", "--output-len", "4", "8",
        "--batch-size", "8", "--skip-offline", "--frontends", "2", "--num-postprocess-workers", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    single, shape = result.stdout.split(" Serving Benchmark Result: ")[1:]
    assert single.startswith("single-process server")
    assert shape.startswith("2 attached frontends, 2 postprocess workers")
    for section in (single, shape):
        assert figure(section, "Successful requests") == 8 and figure(section, "Failed requests") == 0
    assert result.stdout.count("server: frontend") == 2  # the load went through two frontends
    for label in ("Output throughput ratio (shape / single)", "Median TTFT ratio (shape / single)"):
        assert figure(result.stdout, label) > 0


def test_bench_serve_refuses_frontends_against_a_given_server(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "berth",
            "bench",
            "serve",
            str(tmp_path),
            "--frontends",
            "2",
            "--base-url",
            "http://x",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr


def bench_against_one_server(model, num_requests: int, *args: str) -> str:
    """`berth bench serve` of a small workload, compared with one server (`args` say how): stdout."""
    result = bench_serve(
        str(model), "--num-requests", str(num_requests), "--input-len", "4", "24", "--output-len", "4", "8",
        "--batch-size", "8", "--skip-offline", *args,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow  # `berth bench serve` against servers it starts (two setups per run)
def test_bench_serve_compares_the_enqueue_window_on_and_off_in_one_run(tiny_model):
    stdout = bench_against_one_server(
        tiny_model,
        8,
        "--request-rate",
        "40",
        "--batch-wait-timeout-ms",
        "20",
        "--batch-wait-max-tokens-ratio",
        "0.5",
        "--rounds",
        "2",
    )
    assert stdout.count("server: berth serve (enqueue window 20 ms, token ratio 0.5,") == 2  # one a round
    assert stdout.count("server: berth serve (single-process server,") == 2
    assert "each shape's fastest of 2 rounds, run in turn" in stdout
    off, on = stdout.split(" Serving Benchmark Result: ")[1:]
    assert off.startswith("single-process server") and on.startswith("enqueue window 20 ms, token ratio 0.5")
    for section in (off, on):
        assert figure(section, "Successful requests") == 8 and figure(section, "Failed requests") == 0
    side_by_side = re.search(r"^Median TTFT \(ms\):\s+([\d.]+)\s+([\d.]+)$", stdout, re.MULTILINE)
    assert side_by_side, stdout
    assert all(float(value) > 0 for value in side_by_side.groups())
    assert re.search(r"^Output throughput \(tok/s\):\s+[\d.]+\s+[\d.]+$", stdout, re.MULTILINE)


@pytest.mark.slow  # `berth bench serve` against servers it starts (two setups per run)
def test_bench_serve_compares_disaggregated_serving_with_one_server(tiny_model):
    stdout = bench_against_one_server(tiny_model, 6, "--disaggregated")
    single, split = stdout.split(" Serving Benchmark Result: ")[1:]
    assert split.startswith("context + generation servers behind the router")
    for section in (single, split):
        assert figure(section, "Successful requests") == 6 and figure(section, "Failed requests") == 0
    for server in ("context server", "generation server", "router"):
        assert f"server: {server} (pid" in stdout
    for label in ("Median TTFT", "P99 TTFT", "Median ITL", "P99 ITL"):
        side_by_side = re.search(rf"^{label} \(ms\):\s+([\d.]+)\s+([\d.]+)$", stdout, re.MULTILINE)
        assert side_by_side and all(float(value) > 0 for value in side_by_side.groups()), stdout


def openai_stub() -> FastAPI:
    """A minimal OpenAI-compatible server that is not berth: `/v1/models` and streamed
    `/v1/completions` behind an API key, no `/live` (as vLLM's or llama.cpp's)."""
    app = FastAPI()
    app.state.gets = []

    def authorized(request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {STUB_KEY}"

    @app.get("/v1/models")
    def models(request: Request):
        app.state.gets.append("/v1/models")
        if not authorized(request):
            return JSONResponse({"error": {"message": "no key"}}, status_code=401)
        return {"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "test"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if not authorized(request):
            return JSONResponse({"error": {"message": "no key"}}, status_code=401)
        n = body["max_tokens"]

        def chunk(**fields) -> str:
            return "data: " + json.dumps({"id": "cmpl-stub", "object": "text_completion", **fields}) + "\n\n"

        def events():
            for i in range(n):
                yield chunk(choices=[{"index": 0, "text": f" t{i}", "finish_reason": None}])
            yield chunk(choices=[], usage={"prompt_tokens": len(body["prompt"]), "completion_tokens": n})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


STUB_KEY = "stub-key"


@pytest.mark.slow  # `berth bench serve` against servers it starts (two setups per run)
def test_bench_serve_measures_a_server_that_is_not_berth(tiny_model):
    """Its keep-alive probe falls back to `/v1/models` (with the API key) where `/live` is 404."""
    app = openai_stub()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the stub server did not start"
            time.sleep(0.05)
        result = subprocess.run(
            [
                sys.executable, "-m", "berth", "bench", "serve", str(tiny_model), "--num-requests", "6",
                "--input-len", "4", "8", "--output-len", "3", "6", "--skip-offline",
                "--base-url", f"http://127.0.0.1:{port}", "--api-key", STUB_KEY,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        server.should_exit = True
        thread.join(10)
    assert result.returncode == 0, result.stdout + result.stderr
    assert figure(result.stdout, "Successful requests") == 6 and figure(result.stdout, "Failed requests") == 0
    assert "Keep-alive request latency (GET /v1/models)" in result.stdout
    assert figure(result.stdout, "Median, reused connection (ms)") > 0
    assert figure(result.stdout, "Median, new connection (ms)") > 0
    # The model lookup, then the keep-alive probes: 1 to open the connection, 50 reused, 50 fresh.
    assert app.state.gets.count("/v1/models") == 1 + 2 * 50
