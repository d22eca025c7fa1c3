"""Benchmark (run by hand, not collected by pytest): N LLMDeployments created at once against the
emulator; how long until every child of every one exists.

    .venv/bin/python tests/operator/bench_operator_scale.py [--count 100]

The operator runs for real (kopf, in-process, over HTTP) exactly as in the tests; the
StatefulSet controller and kubelet helpers run too (no engine servers: the worlds stay
Starting). The figure is dominated by the emulator and one CPU-bound event loop shared by the
emulator, the helpers and the operator, so it is a lower bound on the operator's throughput
rather than a prediction for a real API server.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from berth.operator import naming, render  # noqa: E402
from berth.operator.crd_model import parse_spec  # noqa: E402
from tests.support.cluster import ClusterSim, running_cluster  # noqa: E402
from tests.support.operator_runner import running_operator  # noqa: E402

RESOURCES = {
    "ConfigMap": "v1/configmaps",
    "Service": "v1/services",
    "StatefulSet": "apps/v1/statefulsets",
    "Pod": "v1/pods",
    "Deployment": "apps/v1/deployments",
    "Secret": "v1/secrets",
}


def expected_children(names: list[str], spec: dict[str, Any]) -> set[tuple[str, str]]:
    parsed = parse_spec(spec)
    wanted = set()
    for name in names:
        owner = render.Owner(name=name, namespace="default", uid="-")
        wanted |= {(child["kind"], child["metadata"]["name"]) for child in render.children(owner, parsed)}
        wanted |= {
            ("Secret", secret(name))
            for secret in (naming.engine_key_secret, naming.admin_token_secret, naming.ssh_secret)
        }
    return wanted


async def bench(count: int) -> None:
    example = yaml.safe_load((ROOT / "manifests" / "examples" / "llmdeployment.yaml").read_text())
    names = [f"bench-{index:03d}" for index in range(count)]
    wanted = expected_children(names, example["spec"])
    with tempfile.TemporaryDirectory() as tmp:
        async with running_cluster(Path(tmp)) as cluster:
            import os

            os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
            async with (
                ClusterSim(cluster, interval=0.2).running(),
                running_operator(cluster, lambda pod: None),
            ):
                documents = []
                for name in names:
                    document = copy.deepcopy(example)
                    document["metadata"]["name"] = name
                    documents.append(document)
                path = "/apis/berth.dev/v1alpha1/namespaces/default/llmdeployments"
                started = time.perf_counter()
                await asyncio.gather(*(cluster.api("POST", path, document) for document in documents))
                created = time.perf_counter() - started

                def existing() -> set[tuple[str, str]]:
                    return {
                        (kind, obj["metadata"]["name"])
                        for kind, resource in RESOURCES.items()
                        for obj in cluster.objects(resource)
                    }

                children_at = None
                while time.perf_counter() - started < 600:
                    if children_at is None and wanted <= existing():
                        children_at = time.perf_counter() - started
                    observed = [
                        (cluster.get("berth.dev/v1alpha1/llmdeployments", name).get("status") or {}).get(
                            "observedGeneration"
                        )
                        for name in names
                    ]
                    if children_at is not None and all(observed):
                        break
                    await asyncio.sleep(0.1)
                observed_at = time.perf_counter() - started
                # Measured. The harness stops kopf after a short grace, cancelling 100 daemons and
                # their HTTP sessions mid-poll: expected here, and not worth a screen of warnings.
                logging.getLogger("kopf").setLevel(logging.CRITICAL)
                logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    print(
        f"{count} LLMDeployments ({len(wanted)} children: {len(wanted) // count} each) "
        f"created in {created:.2f} s"
    )
    print(
        f"all children exist after {children_at:.2f} s" if children_at else "children incomplete after 600 s"
    )
    print(f"all statuses observed after {observed_at:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kopf").setLevel(logging.WARNING)
    asyncio.run(bench(args.count))


if __name__ == "__main__":
    main()
