"""The README's picture of the dashboard, drawn from real data: the main panels' queries, as
the dashboard JSON has them, run through a real Prometheus' range API and drawn with
matplotlib in Grafana's dark colours.

    python -m berth.operator.monitoring.picture [--model DIR] [--out docs/images/dashboard.png]

starts `berth serve MODEL` (default: SmolLM2 from `make real-model`) and a real Prometheus that
scrapes it through the shipped scrape config (operator/monitoring/discovery.py gives the target
the labels of a launcher pod), sends `berth bench serve` traffic in waves with a sleep and a
wakeup between them, and draws what Prometheus recorded. `render_dashboard` is the drawing
alone (the monitoring test draws from its own Prometheus with it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from berth.operator import naming
from berth.operator.monitoring import discovery
from berth.operator.monitoring.dashboard import expand
from berth.operator.monitoring.prometheus import Prometheus, running_prometheus

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "manifests" / "monitoring" / "grafana" / "berth.json"
PANELS = (
    "Request rate",
    "Tokens per second",
    "Time to first token",
    "Inter-token latency",
    "Running and waiting requests",
    "KV cache usage",
    "Admission state",
    "Memory",
)
# Grafana's dark theme, roughly: page, panel, text, grid, and its classic palette.
PAGE, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
PALETTE = ("#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#f2495c", "#b877d9", "#8ab8ff", "#ffb357")
STATE_COLOURS = {"running": "#73bf69", "parking": "#ff780a", "parked": "#5794f2", "waking": "#f2cc0c",
                 "failed": "#f2495c", "shutdown": "#8e8e8e"}  # fmt: skip
UNITS = {"bytes": (2**20, "MiB"), "s": (1e-3, "ms"), "percentunit": (0.01, "%")}


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def render_dashboard(
    prometheus: Prometheus,
    start: float,
    end: float,
    out: Path,
    namespace: str = ".*",
    rate_interval: str = "10s",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = json.loads(DASHBOARD.read_text())
    panels = {panel["title"]: panel for panel in board["panels"] if panel["type"] != "row"}
    step = max((end - start) / 240, 1.0)
    figure, axes = plt.subplots(2, 4, figsize=(18, 7.5), facecolor=PAGE)
    for ax, title in zip(axes.flat, PANELS):
        panel = panels[title]
        ax.set_facecolor(PANEL)
        ax.set_title(title, color=TEXT, loc="left", fontsize=11)
        ax.tick_params(colors=TEXT, labelsize=8)
        for spine in ax.spines.values():
            spine.set_color(GRID)
        ax.grid(color=GRID, linewidth=0.6)
        scale, unit = UNITS.get(panel["fieldConfig"]["defaults"]["unit"], (1, ""))
        series = []
        for target in panel["targets"]:
            expr = expand(target["expr"], rate_interval, namespace=namespace)
            for result in prometheus.query_range(expr, start, end, step):
                points = [(float(t) - start, float(v)) for t, v in result["values"]]
                series.append((legend(target["legendFormat"], result["metric"]), result["metric"], points))
        if panel["type"] == "state-timeline":
            _draw_states(ax, series)
        else:
            for i, (label, _, points) in enumerate(series):
                ax.plot([t for t, _ in points], [v / scale for _, v in points], label=label,
                        color=PALETTE[i % len(PALETTE)], linewidth=1.4)  # fmt: skip
            if unit:
                ax.set_ylabel(unit, color=TEXT, fontsize=8)
            if series:
                ax.legend(fontsize=7, facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT, loc="upper left")
        ax.set_xlim(0, end - start)
        ax.set_xlabel("seconds", color=TEXT, fontsize=8)
    figure.suptitle("berth: LLM deployments (manifests/monitoring/grafana/berth.json)", color=TEXT, x=0.01,
                    ha="left", fontsize=13)  # fmt: skip
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80, facecolor=PAGE)
    plt.close(figure)


def _draw_states(ax: Any, series: list[tuple[str, dict[str, str], list[tuple[float, float]]]]) -> None:
    """One lane per world, coloured by the admission state it was in."""
    worlds = sorted({f"{m.get('deployment', '')} w{m.get('world', '')}" for _, m, _ in series})
    for _, metric, points in series:
        lane = worlds.index(f"{metric.get('deployment', '')} w{metric.get('world', '')}")
        state = metric.get("state", "")
        times = [t for t, v in points if v > 0]
        spans = [(t, 1.0) for t in times]
        ax.broken_barh(spans, (lane + 0.1, 0.8), color=STATE_COLOURS.get(state, "#8e8e8e"))
    ax.set_yticks([i + 0.5 for i in range(len(worlds))], worlds)
    ax.set_ylim(0, max(len(worlds), 1))
    for state, colour in STATE_COLOURS.items():
        ax.bar(0, 0, color=colour, label=state)
    ax.legend(fontsize=7, facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT, loc="upper left", ncol=3)


# ---- the demo run --------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(model: Path, workdir: Path, admin_token: str) -> Iterator[str]:
    log = (workdir / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "berth", "serve", str(model), "--host", "127.0.0.1", "--port", "0",
         "--served-model-name", model.name],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "BERTH_ADMIN_TOKEN": admin_token},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        url = None
        while url is None:
            found = re.search(r"berth serve: listening on (\S+)", (workdir / "serve.log").read_text())
            url = found.group(1) if found else None
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"berth serve did not come up: {(workdir / 'serve.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        while httpx.get(f"{url}/ready").status_code != 200:
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(60)
        log.close()


def bench(url: str, model: Path, requests: int, rate: float) -> None:
    subprocess.run(
        [sys.executable, "-m", "berth", "bench", "serve", str(model), "--base-url", url, "--skip-offline",
         "--num-requests", str(requests), "--request-rate", str(rate), "--input-len", "32", "256",
         "--output-len", "16", "96", "--max-concurrency", "16"],
        check=True, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "smollm2")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images" / "dashboard.png")
    parser.add_argument("--workdir", type=Path, default=REPO / ".cache" / "dashboard-picture")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    pod = {
        "metadata": {"name": "smollm2-w0-launcher", "namespace": "demo",
                     "labels": naming.role_labels("smollm2", 0, "launcher")},
        "spec": {"containers": [{"name": "launcher", "ports": [{"name": "http", "containerPort": 8000}]}]},
    }  # fmt: skip
    sd = args.workdir / "sd"
    sd.mkdir(exist_ok=True)
    with serving(args.model, args.workdir, token) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        discovery.write_targets(
            sd / "berth-engines.json", discovery.pod_targets(pod, lambda *_: (host, int(port)))
        )
        with running_prometheus(discovery.scrape_config(sd, "1s"), args.workdir / "prometheus") as prometheus:
            started = time.time()
            admin = {"Authorization": f"Bearer {token}"}
            time.sleep(5)
            bench(url, args.model, 48, 1.0)
            bench(url, args.model, 64, 3.0)
            httpx.post(f"{url}/admin/sleep", json={"level": 1}, headers=admin, timeout=120).raise_for_status()
            time.sleep(8)
            httpx.post(f"{url}/admin/wakeup", json={}, headers=admin, timeout=120).raise_for_status()
            time.sleep(3)
            bench(url, args.model, 96, 6.0)
            time.sleep(5)
            render_dashboard(prometheus, started, time.time(), args.out, namespace="demo")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
