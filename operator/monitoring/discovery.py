"""The shipped scrape config (manifests/monitoring/prometheus.yml) run where no Kubernetes API
is: each `kubernetes_sd_configs` becomes a `file_sd_configs` whose targets carry the labels
Kubernetes' pod discovery would give them, so the shipped relabel rules run unchanged."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

SCRAPE_CONFIG = Path(__file__).resolve().parents[2] / "manifests" / "monitoring" / "prometheus.yml"
# Where a pod's port answers here (host, port), or None: that target is unreachable.
AddressOf = Callable[[Mapping[str, Any], str], "tuple[str, int] | None"]


def sanitize(name: str) -> str:
    """A Kubernetes label name as a Prometheus label name (what its discovery does)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_targets(pod: Mapping[str, Any], address_of: AddressOf) -> list[dict[str, Any]]:
    """Kubernetes pod discovery's targets for `pod`: one per declared container port."""
    meta = pod["metadata"]
    labels = {
        "__meta_kubernetes_namespace": meta.get("namespace", "default"),
        "__meta_kubernetes_pod_name": meta["name"],
        **{f"__meta_kubernetes_pod_label_{sanitize(k)}": v for k, v in (meta.get("labels") or {}).items()},
    }
    groups = []
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            address = address_of(pod, port.get("name", ""))
            groups.append(
                {
                    # Prometheus' address for a port nobody serves here: scraped and found down.
                    "targets": [f"{address[0]}:{address[1]}" if address else "127.0.0.1:9"],
                    "labels": {
                        **labels,
                        "__meta_kubernetes_pod_container_name": container["name"],
                        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    },
                }
            )
    return groups


def write_targets(path: Path, groups: list[dict[str, Any]]) -> None:
    """Atomically, so Prometheus never reads half a file."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(groups))
    os.replace(partial, path)


def scrape_config(sd_dir: Path, interval: str = "1s") -> dict[str, Any]:
    """The shipped config with file discovery from `sd_dir/JOB.json`, scraping every `interval`."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
    config["rule_files"] = [str(SCRAPE_CONFIG.parent / path) for path in config.get("rule_files", [])]
    for job in config["scrape_configs"]:
        job.pop("kubernetes_sd_configs")
        path = sd_dir / f"{job['job_name']}.json"
        if not path.exists():
            write_targets(path, [])
        job["file_sd_configs"] = [{"files": [str(path)], "refresh_interval": "1s"}]
    return config
