"""`berth bench wake MODEL_DIR`: the first request to a deployment whose only world sleeps, or
was released, against what it waits for.

On this machine, without Kubernetes: a `berth serve` process is the world, a `berth activator`
process the deployment's endpoint, and the operator's own code plays the operator (its long
poll on the activator, operator/demand.py, and its admin calls, operator/engine_admin.py).
Each figure is a streaming completion sent to the activator, timed to its first token:

- awake: the world serves (the baseline: the activator's hop included);
- asleep: the world sleeps at `--level`; the request is held, its demand wakes the world, the
  activator forwards it: next to the wake time the engine reports;
- released: no world runs; the demand starts one (`berth serve` from nothing): next to that
  cold start (process start to a ready engine).

On a CPU the weights never leave host memory, so a level-1 wake is a KV pool allocation; on a
GPU it moves the weights back to the device, and a cold start loads them from disk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from berth.operator import engine_admin
from berth.operator.demand import DemandWatcher
from berth.operator.health import Address
from berth.ports import free_port, free_ports

LOGGER = logging.getLogger("berth.bench.wake")


@dataclass
class Figure:
    scenario: str
    ttft: float
    waited_for: str
    waited: float | None

    def row(self) -> str:
        ratio = f"{self.ttft / self.waited:6.1f}x" if self.waited else "      -"
        waited = f"{self.waited:8.3f} s" if self.waited is not None else "         -"
        return f"{self.scenario:<9} {self.ttft:8.3f} s   {self.waited_for:<28} {waited}   {ratio}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory")
    parser.add_argument("--level", type=int, choices=(1, 2), default=1, help="sleep level (default 1)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds a world may take to start"
    )
    parser.add_argument(
        "--serve-args", default="", help='extra `berth serve` arguments, one string (e.g. "--dtype bfloat16")'
    )


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_bench(args))


class _Process:
    """A child process of this benchmark, ended (SIGTERM, then SIGKILL) when done."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        import os

        self.popen = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


async def _ready(http: httpx.AsyncClient, url: str, process: _Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{url}: the process ended with code {process.popen.returncode}")
        try:
            if (await http.get(f"{url}/ready", timeout=2)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.02)
    raise TimeoutError(f"{url} not ready within {timeout:g} s")


async def _first_token(http: httpx.AsyncClient, url: str, request: dict) -> float:
    """Seconds to the first token of a streamed completion (the whole answer is read)."""
    started = time.monotonic()
    first = math.nan
    async with http.stream("POST", f"{url}/v1/completions", json=request, timeout=None) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:300]}")
        async for line in reply.aiter_lines():
            data = line.removeprefix("data: ")
            if (
                data != line
                and data != "[DONE]"
                and math.isnan(first)
                and json.loads(data)["choices"][0]["text"]
            ):
                first = time.monotonic() - started
    return first


async def _bench(args: argparse.Namespace) -> int:
    token = secrets.token_hex(16)
    env = {"BERTH_ADMIN_TOKEN": token}
    extra = shlex.split(args.serve_args)
    request = {
        "model": "bench",
        "prompt": "the quick brown fox",
        "max_tokens": args.max_tokens,
        "stream": True,
    }
    request["ignore_eos"] = True
    activator_port, admin_port = free_ports(2)
    activator = _Process(
        [sys.executable, "-m", "berth", "activator", "--port", str(activator_port),
         "--admin-port", str(admin_port), "--wake-timeout", str(args.startup_timeout)],
        env,
    )  # fmt: skip
    admin = Address("127.0.0.1", admin_port)
    public = f"http://127.0.0.1:{activator_port}"
    worlds: list[_Process] = []
    demand = asyncio.Event()

    async def held_request() -> asyncio.Future[float]:
        """A request sent while no world serves, once the activator told the operator of it."""
        demand.clear()
        held = asyncio.ensure_future(_first_token(http, public, request))
        told = asyncio.ensure_future(demand.wait())
        done, _ = await asyncio.wait({held, told}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        told.cancel()
        if held in done:
            held.result()  # raises: it was answered without a wake
        if told not in done:
            raise TimeoutError("the activator did not report the held request within 60 s")
        return held

    async def start_world() -> tuple[str, Address, float]:
        port = free_port()
        started = time.monotonic()
        world = _Process(
            [sys.executable, "-m", "berth", "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
             "--served-model-name", "bench", *extra],
            env,
        )  # fmt: skip
        worlds.append(world)
        url = f"http://127.0.0.1:{port}"
        await _ready(http, url, world, args.startup_timeout)
        return url, Address("127.0.0.1", port), time.monotonic() - started

    async with httpx.AsyncClient() as http:
        watcher = DemandWatcher(http, demand.set, LOGGER)
        try:
            await _ready(http, public, activator, 60)
            url, address, cold = await start_world()
            watcher.update(admin, [url], None, token)
            await asyncio.sleep(0.2)  # the activator has heard of the world
            figures = [Figure("awake", await _first_token(http, public, request), "(no wait)", None)]

            slept = await engine_admin.sleep(http, address, token, args.level, 30)
            if not slept.ok:
                raise RuntimeError(f"sleep: {slept.message}")
            watcher.update(admin, [], None, token)
            held = await held_request()
            woke = await engine_admin.wakeup(http, address, token, args.startup_timeout)
            if not woke.ok:
                raise RuntimeError(f"wakeup: {woke.message}")
            watcher.update(admin, [url], None, token)
            wake = woke.engine_seconds if woke.engine_seconds is not None else woke.seconds
            figures.append(Figure("asleep", await held, f"engine wake (level {args.level})", wake))

            worlds.pop().stop()
            watcher.update(admin, [], None, token)
            held = await held_request()
            url, address, cold_again = await start_world()
            watcher.update(admin, [url], None, token)
            figures.append(Figure("released", await held, "cold world start", cold_again))
        finally:
            watcher.close()
            for process in (*worlds, activator):
                process.stop()
    print(f"model {args.model}; first world's cold start {cold:.3f} s")
    print("scenario  first token   waits for                        that took    ratio")
    for figure in figures:
        print(figure.row())
    asleep, released = figures[1], figures[2]
    print(f"released / asleep: {released.ttft / asleep.ttft:.1f}x (time to first token)")
    return 0
