"""Benchmark (run by hand, not collected by pytest): N LLMDeployments created at once against the
emulator; how long until every child of every one exists and every status is written, then a
spec change across all of them: how long until every world runs pods of the new spec.

    .venv/bin/python tests/operator/bench_operator_scale.py [--count 100] [--operator in-process]
        [--pods-from watch|list|both] [--steady 60]

By default the operator runs as it is deployed: `berth operator` in a process of its own (kopf
over HTTP to the emulator). The emulator, the StatefulSet controller and the stand-in kubelet
share this process (no engine servers: the worlds stay Starting, and each one's health daemon
polls a loopback address where nothing listens, so every poll is a real, refused connection).
`--operator in-process` runs the operator in this process's event loop, as the tests do.

It prints the CPU seconds each side spent while measured (the split: operator process vs the
emulator and the helpers), so a slow figure says whose time it was.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from berth.operator import naming, render  # noqa: E402
from berth.operator.crd_model import parse_spec  # noqa: E402
from tests.support.cluster import Cluster, ClusterSim, running_cluster  # noqa: E402
from tests.support.operator_runner import running_operator  # noqa: E402
from tests.support.rbac import attributes  # noqa: E402

LLMD = "berth.dev/v1alpha1/llmdeployments"
LLMD_PATH = "/apis/berth.dev/v1alpha1/namespaces/default/llmdeployments"
RESOURCES = {
    "ConfigMap": "v1/configmaps",
    "Service": "v1/services",
    "StatefulSet": "apps/v1/statefulsets",
    "Pod": "v1/pods",
    "Deployment": "apps/v1/deployments",
    "Secret": "v1/secrets",
    "NetworkPolicy": "networking.k8s.io/v1/networkpolicies",
    "PodGroup": "scheduling.x-k8s.io/v1alpha1/podgroups",
    "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
}
OPERATOR_AGENTS = ("kopf/", "berth-operator")
TICKS = os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class LoopbackSim(ClusterSim):
    """Pod IPs on the loopback network: the health daemons' polls stay on this machine."""

    def running_status(self, pod: dict[str, Any]) -> dict[str, Any]:
        status = super().running_status(pod)
        _, _, third, fourth = status["podIP"].split(".")
        status["podIP"] = f"127.77.{third}.{fourth}"
        return status


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


def operator_requests(cluster: Cluster) -> Counter[str]:
    """The operator's API requests so far, by verb and resource (the emulator keeps them all)."""
    counts: Counter[str] = Counter()
    for request in list(cluster.emulator):
        if not request.headers.get("User-Agent", "").startswith(OPERATOR_AGENTS):
            continue
        wanted = attributes(request)
        if wanted is not None:
            counts[f"{wanted.verb} {wanted.resource}"] += 1
    return counts


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# `berth operator` that reads its children from the API server (the code before watches: the
# health rounds LIST pods and StatefulSets every round, a resync reads every child and lists every
# kind): the same process, with the handlers' memo setting the baseline reads.
LISTING_OPERATOR = (
    "import argparse, sys; from berth.operator.cli import add_arguments, run_operator; "
    "parser = argparse.ArgumentParser(); add_arguments(parser); "
    "sys.exit(run_operator(parser.parse_args(), {'list_children': True}))"
)


@contextlib.asynccontextmanager
async def operator_process(
    cluster: Cluster, log: Path, listed: bool, profile: Path | None = None
) -> AsyncIterator[int]:
    # Under cProfile if asked (it writes the profile when the operator exits on SIGTERM).
    profiled = ["-m", "cProfile", "-o", str(profile)] if profile else []
    code = ["-c", LISTING_OPERATOR] if listed else [*profiled, "-m", "berth", "operator"]
    command = [sys.executable, *code]
    command += ["--kubeconfig", str(cluster.kubeconfig)]
    command += ["-n", cluster.namespace, "--metrics-port", "0", "--liveness", ""]
    # The emulator is one Python event loop, shared with the simulated controllers and this
    # bench's checks: at 1,000 deployments it answers some requests only after 10 s or more. A
    # real API server serves Lease requests at a priority level of their own (APF's
    # "leader-election"); here the Lease is given the time the emulator takes instead.
    command += ["--lease-duration", "300", "--lease-renew-interval", "2", "--lease-renew-deadline", "280"]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        yield process.pid
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def until(predicate: Callable[[], bool], timeout: float, started: float) -> float | None:
    """Seconds from `started` until `predicate()` holds (None after `timeout`). The checks share
    this process with the operator: each waits four times what the last one took, so they take
    at most a fifth of its time (at 1,000 deployments one check takes a second or more)."""
    while time.perf_counter() - started < timeout:
        checking = time.perf_counter()
        if predicate():
            return time.perf_counter() - started
        await asyncio.sleep(max(0.1, 4 * (time.perf_counter() - checking)))
    return None


def observed(cluster: Cluster, names: list[str]) -> bool:
    return all(
        ((cluster.get(LLMD, name) or {}).get("status") or {}).get("observedGeneration") for name in names
    )


Hashes = dict[tuple[str, int], tuple[str, str]]  # (deployment, world) -> launcher's, workers' spec hash


def spec_hashes(cluster: Cluster, names: list[str]) -> Hashes:
    """What each world's pods carry once on the current spec (rendered once, not every check)."""
    hashes: Hashes = {}
    for name in names:
        raw = cluster.get(LLMD, name)
        spec = parse_spec(raw["spec"], name)
        owner = render.Owner(name=name, namespace="default", uid=raw["metadata"]["uid"])
        for world in range(spec.replicas):
            launcher = render.launcher_pod(owner, spec, world)["metadata"]["annotations"][naming.SPEC_HASH]
            hashes[(name, world)] = (launcher, render.spec_hash(render.worker_pod_spec(owner, spec, world)))
    return hashes


def on_new_spec(cluster: Cluster, hashes: Hashes, nodes_per_world: int) -> int:
    """How many worlds run a launcher and workers of their deployment's current spec."""
    launchers: dict[tuple[str, int], str | None] = {}
    workers: dict[tuple[str, int], list[str | None]] = {}
    for pod in cluster.objects("v1/pods"):
        labels = pod["metadata"].get("labels") or {}
        if naming.WORLD not in labels or naming.DEPLOYMENT not in labels:
            continue
        world = (labels[naming.DEPLOYMENT], int(labels[naming.WORLD]))
        carried = pod["metadata"].get("annotations", {}).get(naming.SPEC_HASH)
        if labels.get(naming.ROLE) == "launcher":
            launchers[world] = carried
        elif labels.get(naming.ROLE) == "worker":
            workers.setdefault(world, []).append(carried)
    return sum(
        launchers.get(world) == launcher and workers.get(world, []) == [worker] * nodes_per_world
        for world, (launcher, worker) in hashes.items()
    )


# Writes in flight at once, as a client (kubectl, Argo CD) sends them: a thousand at once would
# wait past the client's timeout for a connection.
IN_FLIGHT = 50


async def at_most(limit: int, calls: list[Coroutine[Any, Any, Any]]) -> None:
    gate = asyncio.Semaphore(limit)

    async def one(call: Coroutine[Any, Any, Any]) -> None:
        async with gate:
            await call

    await asyncio.gather(*(one(call) for call in calls))


async def bench(
    count: int, mode: str, steady: float, listed: bool, timeout: float, profile: Path | None = None
) -> None:
    example = yaml.safe_load((ROOT / "manifests" / "examples" / "llmdeployment.yaml").read_text())
    names = [f"bench-{index:03d}" for index in range(count)]
    wanted = expected_children(names, example["spec"])
    nodes_per_world = parse_spec(example["spec"]).nodes_of(0)
    unknown = {kind for kind, _ in wanted} - RESOURCES.keys()
    if unknown:  # a child this bench would wait for and never see
        raise SystemExit(f"bench_operator_scale: add {sorted(unknown)} to RESOURCES")

    def document(name: str) -> dict[str, Any]:
        doc = copy.deepcopy(example)
        doc["metadata"]["name"] = name
        return doc

    with tempfile.TemporaryDirectory() as tmp:
        async with running_cluster(Path(tmp)) as cluster:
            os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
            log = Path(tmp) / "operator.log"
            operator = (
                operator_process(cluster, log, listed, profile)
                if mode == "process"
                else running_operator(cluster, **({"list_children": True} if listed else {}))
            )
            async with LoopbackSim(cluster, interval=0.2).running(), operator as handle:
                pid = handle if mode == "process" else None
                # Warm-up (not measured): the operator is up and has reconciled one deployment.
                await cluster.api("POST", LLMD_PATH, document("warm-up"))
                if await until(lambda: observed(cluster, ["warm-up"]), 120, time.perf_counter()) is None:
                    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                    raise SystemExit(f"the operator did not reconcile a first deployment in 120 s\n{tail}")

                def existing() -> set[tuple[str, str]]:
                    return {
                        (kind, name)
                        for kind, resource_path in RESOURCES.items()
                        for name in cluster.names(resource_path)
                    }

                cpu_before = (own_cpu(), cpu_of(pid) if pid else 0.0)
                started = time.perf_counter()
                await at_most(IN_FLIGHT, [cluster.api("POST", LLMD_PATH, document(name)) for name in names])
                created = time.perf_counter() - started
                children_at = await until(lambda: wanted <= existing(), timeout, started)
                observed_at = await until(lambda: observed(cluster, names), timeout, started)
                # Where it stood if it did not get there: how far it got in the time given.
                children_had = len(wanted & existing())
                observed_had = sum(observed(cluster, [name]) for name in names)
                cpu_after = (own_cpu(), cpu_of(pid) if pid else 0.0)

                change = {"spec": {"env": [{"name": "BENCH_ROLLOUT", "value": "1"}]}}
                rollout_started = time.perf_counter()
                await at_most(
                    IN_FLIGHT, [cluster.api("PATCH", f"{LLMD_PATH}/{name}", change) for name in names]
                )
                hashes = spec_hashes(cluster, names)
                rolled_at = await until(
                    lambda: on_new_spec(cluster, hashes, nodes_per_world) == len(hashes),
                    timeout,
                    rollout_started,
                )
                rolled_had = on_new_spec(cluster, hashes, nodes_per_world)
                cpu_rolled = (own_cpu(), cpu_of(pid) if pid else 0.0)
                # Steady state: what the operator asks of the API server while nothing changes
                # (its engine polls go to the launchers, not to the API server).
                requests_before = operator_requests(cluster)
                await asyncio.sleep(steady)
                per_minute = operator_requests(cluster) - requests_before
                # Measured. Stopping kopf cancels 100 daemons mid-poll: expected, not worth warnings.
                logging.getLogger("kopf").setLevel(logging.CRITICAL)
                logging.getLogger("asyncio").setLevel(logging.CRITICAL)

    def when(seconds: float | None, had: int, of: int) -> str:
        if seconds is not None:
            return f"{seconds:.2f} s"
        return f"not within {timeout:.0f} s ({had} of {of} by then)"

    def split(before: tuple[float, float], after: tuple[float, float]) -> str:
        here, there = after[0] - before[0], after[1] - before[1]
        if mode != "process":
            return f"CPU {here:.1f} s in one process (operator, emulator and helpers together)"
        total = max(here + there, 1e-9)
        return (
            f"CPU: operator process {there:.1f} s ({100 * there / total:.0f} %), emulator + helpers "
            f"{here:.1f} s ({100 * here / total:.0f} %)"
        )

    reads = "read from the API server (the code before watches)" if listed else "from the watches"
    print(
        f"operator: {'its own process (berth operator)' if mode == 'process' else 'in-process'}; "
        f"children {reads}"
    )
    print(
        f"{count} LLMDeployments ({len(wanted)} children: {len(wanted) // count} each) created in "
        f"{created:.2f} s; all children exist after {when(children_at, children_had, len(wanted))}; all "
        f"statuses observed after {when(observed_at, observed_had, count)}; {split(cpu_before, cpu_after)}"
    )
    print(
        f"rollout (a spec change on all {count}, 2 worlds each, none Ready: each replaced at once): every "
        f"world on the new spec after {when(rolled_at, rolled_had, len(hashes))}; "
        f"{split(cpu_after, cpu_rolled)}"
    )
    scale = 60.0 / steady / count
    top = ", ".join(f"{what} {n * scale:.1f}" for what, n in per_minute.most_common(6))
    print(
        f"steady state ({steady:.0f} s, nothing changing): {sum(per_minute.values()) * scale:.1f} API "
        f"requests per deployment per minute ({top})"
        + ("" if rolled_at is not None else "; not converged: the operator was still catching up")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--operator", choices=("process", "in-process"), default="process")
    parser.add_argument("--steady", type=float, default=60.0, help="seconds of steady state measured")
    parser.add_argument(
        "--pods-from",
        choices=("watch", "list", "both"),
        default="watch",
        help="how the operator reads its children: the watches' cache, the API server (the code before "
        "watches: LISTs every round, GETs and LISTs every resync), or both one after the other in this run",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds each phase may take (1,000 deployments: 1800)"
    )
    parser.add_argument(
        "--profile-operator",
        type=Path,
        help="write a cProfile of the operator's process (--operator process, reading from the watches) here",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kopf").setLevel(logging.WARNING)
    for listed in {"watch": [False], "list": [True], "both": [True, False]}[args.pods_from]:
        asyncio.run(
            bench(args.count, args.operator, args.steady, listed, args.timeout, args.profile_operator)
        )


if __name__ == "__main__":
    main()
