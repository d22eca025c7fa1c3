"""berth's monitoring kit against a real Prometheus: the shipped scrape config (its Kubernetes
discovery replaced by files that carry the same pod labels), the shipped alert rules, a real
operator and a real `berth serve` per launcher pod. Traffic from `berth bench serve`, a sleep
and a wakeup through the operator, a `kill -9` of the engine: then every dashboard query
returns finite data, every alert expression evaluates, and the engine-dead alert's expression
was true while the engine lay dead."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import start_http_server

from berth.operator import naming
from berth.operator.monitoring import discovery
from berth.operator.monitoring.dashboard import expand, queries
from berth.operator.monitoring.picture import render_dashboard
from berth.operator.monitoring.prometheus import Prometheus, all_finite, running_prometheus, values
from tests.operator.test_operator_sleep import apply_one_world, patch_spec, world
from tests.support.cluster import Cluster, ClusterSim, sampling, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineFleet, free_port
from tests.support.operator_runner import running_operator

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "manifests" / "monitoring"
DASHBOARD = json.loads((MONITORING / "grafana" / "berth.json").read_text())
RULES = yaml.safe_load((MONITORING / "rules" / "berth.rules.yaml").read_text())
ENGINE_DEAD = next(r["expr"] for g in RULES["groups"] for r in g["rules"] if r["alert"] == "BerthEngineDead")
TIMEOUT = 60.0


def engine_targets(cluster: Cluster, fleet: EngineFleet) -> list[dict[str, Any]]:
    """What Kubernetes' pod discovery would list: every port of every pod, here at the
    address that serves it (a launcher's http port: its fleet server)."""

    def address_of(pod: Mapping[str, Any], port_name: str) -> tuple[str, int] | None:
        return fleet.resolve(pod) if port_name == "http" else None

    return [group for pod in cluster.objects("v1/pods") for group in discovery.pod_targets(pod, address_of)]


def operator_targets(port: int) -> list[dict[str, Any]]:
    pod = {
        "metadata": {
            "name": "berth-operator-7d9f-abcde",
            "namespace": "berth-system",
            "labels": {"app.kubernetes.io/name": "berth-operator"},
        },
        "spec": {
            "containers": [
                {"name": "operator", "ports": [{"name": "metrics", "containerPort": 8080},
                                               {"name": "healthz", "containerPort": 8081}]}
            ]
        },
    }  # fmt: skip
    return discovery.pod_targets(pod, lambda _, name: ("127.0.0.1", port) if name == "metrics" else None)


async def bench(url: str, model: Path, requests: int = 12) -> str:
    """`berth bench serve` against the deployment's engine (in a thread: the operator's loop runs on)."""
    result = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable, "-m", "berth", "bench", "serve", str(model), "--base-url", url,
            "--num-requests", str(requests), "--input-len", "8", "24", "--output-len", "4", "12",
            "--max-concurrency", "4", "--skip-offline",
        ],
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


async def promtool_check_metrics(url: str) -> str:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics", timeout=10)).text
    result = await asyncio.to_thread(
        subprocess.run,
        ["promtool", "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return result.stdout + result.stderr if result.returncode else ""


async def ask(prometheus: Prometheus, expr: str) -> list[dict[str, Any]]:
    return await asyncio.to_thread(prometheus.query, expr)


async def until(
    prometheus: Prometheus, expr: str, what: str, timeout: float = TIMEOUT
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while not (result := await ask(prometheus, expr)):
        assert time.monotonic() < deadline, f"{what}: {expr!r} still empty after {timeout:.0f} s"
        await asyncio.sleep(0.25)
    return result


@pytest.fixture
def operator_metrics_port():
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1")
    yield port
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.mark.slow  # a real Prometheus scraping a served world
async def test_every_dashboard_query_and_alert_against_a_real_prometheus(
    cluster: Cluster,
    sim: ClusterSim,
    fleet: EngineFleet,
    tiny_model: Path,
    tmp_path: Path,
    operator_metrics_port: int,
) -> None:
    sd = tmp_path / "sd"
    sd.mkdir()
    config = discovery.scrape_config(sd, interval="1s")

    def discover() -> None:
        discovery.write_targets(sd / "berth-engines.json", engine_targets(cluster, fleet))
        discovery.write_targets(sd / "berth-operator.json", operator_targets(operator_metrics_port))

    # While closed, the operator's health round waits at its launcher's address: a dead engine is
    # then scraped before the operator restarts its world (whose new pod drops the old target).
    polls = asyncio.Event()
    polls.set()

    async def resolve(pod: dict[str, Any]) -> Any:
        await polls.wait()
        return fleet.resolve(pod)

    with running_prometheus(config, tmp_path / "prometheus") as prometheus:
        async with running_operator(cluster, resolve), sampling(discover, 0.2):
            await apply_one_world(cluster, tmp_path)
            await wait_for(lambda: world(cluster).get("phase") == "Ready", START_TIMEOUT, "the world Ready")
            engine = fleet.for_pod("llama-w0-launcher")
            started = time.time()

            # What Prometheus scrapes is clean: the engine's and the operator's /metrics.
            assert await promtool_check_metrics(engine.url) == ""
            assert await promtool_check_metrics(f"http://127.0.0.1:{operator_metrics_port}") == ""

            # The shipped relabel rules keep one engine target (the http port, not attach or
            # the workers' ssh) with the pod's labels, and one operator target.
            up = await until(prometheus, 'up{job="berth-engines"} == 1', "the engine scraped")
            assert [s["metric"] for s in up] == [
                {"__name__": "up", "job": "berth-engines", "instance": f"{engine.host}:{engine.port}",
                 "namespace": "default", "pod": "llama-w0-launcher", "deployment": "llama", "world": "0",
                 "role": "launcher"}
            ]  # fmt: skip
            await until(prometheus, 'up{job="berth-operator"} == 1', "the operator scraped")
            jobs = [
                (t["labels"]["job"], t["scrapePool"]) for t in await asyncio.to_thread(prometheus.targets)
            ]
            assert sorted(job for job, _ in jobs) == ["berth-engines", "berth-operator"]

            await bench(engine.url, tiny_model)
            await patch_spec(cluster, {"sleep": {"sleeping": True, "level": 1}})
            await wait_for(lambda: world(cluster).get("phase") == "Sleeping", TIMEOUT, "the world asleep")
            await patch_spec(cluster, {"sleep": {"sleeping": False}})
            await wait_for(lambda: world(cluster).get("phase") == "Ready", TIMEOUT, "the world awake")
            await bench(engine.url, tiny_model, requests=8)

            # kill -9: the alert's expression turns true while the engine lies dead, then the
            # operator restarts the world.
            polls.clear()
            await engine.kill_engine()
            await until(prometheus, ENGINE_DEAD, "BerthEngineDead's expression", timeout=30)
            polls.set()
            await wait_for(
                lambda: world(cluster).get("phase") == "Ready" and world(cluster).get("restarts") == 1,
                START_TIMEOUT,
                "the world Ready after its restart",
            )
            await bench(fleet.for_pod("llama-w0-launcher").url, tiny_model, requests=8)
            await until(
                prometheus, 'berth_operator_world_restarts_total{deployment="llama"}', "the restart scraped"
            )
            await asyncio.sleep(2)  # a few more scrapes of the restarted engine
            ended = time.time()

            # Every query of the dashboard, as Grafana sends it with "All" selected: non-empty
            # and finite (the rate window spans the last traffic).
            span = f"{math.ceil(ended - started) + 5}s"
            empty = {}
            for title, expr in queries(DASHBOARD):
                result = await ask(prometheus, expand(expr, rate_interval=span))
                if not all_finite(result):
                    empty[title] = (expr, [(s["metric"], s["value"][1]) for s in result])
            assert not empty, f"dashboard queries without finite data: {json.dumps(empty, indent=1)}"
            # With the variables set to this deployment, as a user picks it.
            filtered = expand(
                queries(DASHBOARD)[0][1], span, namespace="default", deployment="llama", model=".+"
            )
            assert values(await ask(prometheus, filtered))

            # Every alert rule is loaded and evaluates without error; none but the dead
            # engine's (already resolved) and those about time has anything to say here.
            rules = await asyncio.to_thread(prometheus.rules)
            shipped = [r["alert"] for g in RULES["groups"] for r in g["rules"]]
            assert sorted(r["name"] for r in rules) == sorted(shipped)
            assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
            for group in RULES["groups"]:
                for rule in group["rules"]:
                    await ask(prometheus, rule["expr"])  # raises on an error
            assert await ask(prometheus, ENGINE_DEAD) == []  # the restarted engine lives
            assert await ask(prometheus, "berth_operator_world_restart_budget_remaining") != []

            picture = tmp_path / "dashboard.png"
            await asyncio.to_thread(render_dashboard, prometheus, started, ended, picture, "default")
            assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_discovery_targets_carry_the_labels_kubernetes_gives_them() -> None:
    pod = {
        "metadata": {"name": "llama-w0-launcher", "namespace": "llm",
                     "labels": naming.role_labels("llama", 0, "launcher")},
        "spec": {"containers": [{"name": "launcher", "ports": [{"name": "http", "containerPort": 8000}]}]},
    }  # fmt: skip
    (group,) = discovery.pod_targets(pod, lambda _, name: ("10.0.0.7", 8000))
    assert group["targets"] == ["10.0.0.7:8000"]
    assert group["labels"]["__meta_kubernetes_pod_label_berth_dev_world"] == "0"
    assert group["labels"]["__meta_kubernetes_pod_label_app_kubernetes_io_managed_by"] == "berth"
    assert group["labels"]["__meta_kubernetes_pod_container_port_name"] == "http"
