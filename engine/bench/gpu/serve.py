"""`berth serve` on CUDA: the server (its carried FastAPI / uvicorn / pydantic / pyzmq wheels
included) starts on the tiny model, reports the GPU in /admin/state, answers a chat completion
and a streamed completion with the same greedy text, and stops on SIGTERM with exit 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from berth.engine.bench.gpu.result import CheckResult, check_main

LISTENING = "berth serve: listening on "
STARTUP_SECONDS = 120
ADMIN_TOKEN = "gpu-check"


def check(result: CheckResult, dry_run: bool, workdir: Path) -> None:
    from berth.engine.models.tiny_model import make_tiny_model

    model = make_tiny_model(workdir / "tiny-llama", seed=0)
    device = "cpu" if dry_run else "cuda"
    log_path = workdir / "serve.log"
    env = dict(os.environ, BERTH_ADMIN_TOKEN=ADMIN_TOKEN)
    command = [
        sys.executable, "-m", "berth", "serve", str(model), "--port", "0", "--device", device,
        "--dtype", "bfloat16", "--kv-cache-memory", "256Mi", "--served-model-name", "tiny",
    ]  # fmt: skip
    started = time.perf_counter()
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        url = _wait_for_url(server, log_path, started)
        result.add("berth serve up", f"{time.perf_counter() - started:.1f} s at {url}")
        with httpx.Client(base_url=url, timeout=60) as client:
            state = client.get("/admin/state", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
            plan = state["kv_cache"]
            result.add(
                "/admin/state",
                f"healthy {state['healthy']}, admission {state['admission']}, KV cache "
                f"{plan['num_blocks']} blocks of {plan['block_size']} ({plan['dtype']})",
                "healthy, running",
                state["healthy"] and state["admission"] == "running",
            )
            body = {"model": "tiny", "max_tokens": 12, "temperature": 0}
            chat = client.post("/v1/completions", json=body | {"prompt": "the quick brown fox"})
            chat.raise_for_status()
            text = chat.json()["choices"][0]["text"]
            streamed = ""
            with client.stream(
                "POST", "/v1/completions", json=body | {"prompt": "the quick brown fox", "stream": True}
            ) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        streamed += json.loads(line[6:])["choices"][0]["text"]
            result.add(
                "completion, whole and streamed",
                f"{text!r} / {streamed!r}",
                "equal",
                text == streamed and bool(text),
            )
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            code = server.wait()
        result.add("SIGTERM", f"exit {code}", "exit 0", code == 0)
        if code != 0 or not result.passed:
            result.note(f"server log tail: {log_path.read_text()[-1500:]}")


def _wait_for_url(server: subprocess.Popen, log_path: Path, started: float) -> str:
    while time.perf_counter() - started < STARTUP_SECONDS:
        for line in log_path.read_text().splitlines():
            if line.startswith(LISTENING):
                return line.removeprefix(LISTENING).strip()
        if server.poll() is not None:
            raise RuntimeError(f"berth serve exited {server.returncode}: {log_path.read_text()[-1500:]}")
        time.sleep(0.2)
    raise TimeoutError(
        f"berth serve did not listen within {STARTUP_SECONDS} s: {log_path.read_text()[-1500:]}"
    )


def main(argv: list[str] | None = None) -> int:
    return check_main("serve", __doc__.split("\n")[0], check, argv)


if __name__ == "__main__":
    sys.exit(main())
