"""A real Prometheus on 127.0.0.1 (Debian's `prometheus` package, `make setup`), and its HTTP
API: what the monitoring tests and the dashboard picture evaluate berth's queries against."""

from __future__ import annotations

import contextlib
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from berth.ports import free_port

READY_TIMEOUT = 30.0


class PrometheusError(RuntimeError):
    pass


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=10)

    def api(self, path: str, **params: Any) -> Any:
        response = self.http.get(f"/api/v1/{path}", params=params)
        body = response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant vector: [{metric: labels, value: [time, "text"]}, ...]."""
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        data = self.api("query", **params)
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr!r} is a {data['resultType']}, not an instant vector")
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range: [{metric: labels, values: [[time, "text"], ...]}, ...]."""
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

    def wait_for(self, expr: str, timeout: float, what: str) -> list[dict[str, Any]]:
        """The first non-empty result of `expr`, polled until `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {expr!r} still empty after {timeout:.0f} s")
            time.sleep(0.25)


def values(result: list[dict[str, Any]]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


def all_finite(result: list[dict[str, Any]]) -> bool:
    return bool(result) and all(math.isfinite(value) for value in values(result))


@contextlib.contextmanager
def running_prometheus(config: dict[str, Any], workdir: Path) -> Iterator[Prometheus]:
    """Prometheus with `config` (rule_files relative to `workdir`), stopped on exit."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise PrometheusError("prometheus is not installed: run `make setup` (Debian's prometheus package)")
    workdir.mkdir(parents=True, exist_ok=True)
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary, f"--config.file={config_file}", f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle",
            "--storage.tsdb.retention.time=1d", "--log.level=warn",
        ],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir,
    )  # fmt: skip
    prometheus = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if process.poll() is not None:
                raise PrometheusError(f"prometheus exited {process.returncode}: {_tail(workdir)}")
            with contextlib.suppress(httpx.HTTPError):
                if prometheus.http.get("/-/ready").status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus not ready in {READY_TIMEOUT:.0f} s: {_tail(workdir)}")
            time.sleep(0.1)
        yield prometheus
    finally:
        prometheus.http.close()
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _tail(workdir: Path) -> str:
    return (workdir / "prometheus.log").read_text(errors="replace")[-2000:]
