"""Rendering a disaggregated deployment (spec.disaggregation): its worlds are the context pool's
then the generation pool's, each launcher runs its pool's `--role`, a router Deployment routes
over every world's launcher, and the endpoint Service selects the router alone."""

from __future__ import annotations

from typing import Any

import pytest

from berth.operator import naming, render
from berth.operator.crd_model import InvalidSpec, parse_spec
from tests.support.kube_emulator import matches_label_selector

OWNER = render.Owner(name="split", namespace="ml", uid="5678-uid")


def spec(context: int = 2, generation: int = 1, **changes: Any):
    raw: dict[str, Any] = {
        "model": {"path": "/models/llama", "name": "llama"},
        "image": "berth:1",
        "gpusPerNode": 1,
        "disaggregation": {"context": {"replicas": context}, "generation": {"replicas": generation}},
    }
    raw.update(changes)
    return parse_spec(raw)


def by_ref(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{child['kind']}/{child['metadata']['name']}": child for child in children}


def command_of(pod_spec: dict[str, Any]) -> list[str]:
    return pod_spec["containers"][0]["command"]


def flag(command: list[str], name: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == name]


def test_the_worlds_are_the_pools_context_first() -> None:
    split = spec(context=2, generation=3)
    assert split.replicas == 5
    assert [split.pool_of(world) for world in range(5)] == ["context"] * 2 + ["generation"] * 3
    assert parse_spec({"model": {"path": "/m"}, "image": "x"}).pool_of(0) is None
    # replicas written out as the pools' sum is the same deployment.
    assert spec(context=2, generation=3, replicas=5) == split


def test_each_launcher_runs_its_pools_role_and_context_worlds_serve_their_kv() -> None:
    children = by_ref(render.children(OWNER, spec()))
    for world, pool in ((0, "context"), (1, "context"), (2, "generation")):
        launcher = children[f"Pod/split-w{world}-launcher"]
        command = command_of(launcher["spec"])
        assert command[:2] == ["berth", "launch"] and flag(command, "--role") == [pool]
        expected_endpoint = [f"tcp://0.0.0.0:{naming.KV_TRANSFER_PORT}"] if pool == "context" else []
        assert flag(command, "--kv-transfer-endpoint") == expected_endpoint
        # The pool is on the world's pods; a launcher is no endpoint (the router is).
        labels = launcher["metadata"]["labels"]
        assert labels[naming.POOL] == pool and naming.ENDPOINT not in labels
        workers = children[f"StatefulSet/split-w{world}"]["spec"]["template"]["metadata"]["labels"]
        assert workers[naming.POOL] == pool
        # Both pools sign the KV transfer with the deployment's one engine key.
        env = {var["name"]: var for var in launcher["spec"]["containers"][0]["env"]}
        key = env["BERTH_ENGINE_KEY"]["valueFrom"]["secretKeyRef"]
        assert key == {"name": naming.engine_key_secret("split"), "key": "key"}


def test_each_pool_sizes_its_own_worlds() -> None:
    """A context pool of TP-4 worlds on 2-GPU nodes beside TP-2 generation worlds: each world's
    launcher, hostfile, worker StatefulSet and gang group has its pool's size."""
    split = spec(
        gpusPerNode=2,
        scheduling={"gang": "volcano"},
        disaggregation={
            "context": {"tensorParallelSize": 4},
            "generation": {"replicas": 2, "tensorParallelSize": 2},
        },
    )
    assert [split.ranks_of(world) for world in range(3)] == [4, 2, 2]
    children = by_ref(render.children(OWNER, split))
    for world, ranks in ((0, 4), (1, 2), (2, 2)):
        command = command_of(children[f"Pod/split-w{world}-launcher"]["spec"])
        assert flag(command, "--tensor-parallel-size") == [str(ranks)] and flag(
            command, "--gpus-per-node"
        ) == ["2"]
        workers = children[f"StatefulSet/split-w{world}"]["spec"]
        assert workers["replicas"] == ranks // 2
        worker = workers["template"]["spec"]["containers"][0]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "2"
        hosts = children[f"ConfigMap/split-w{world}-hostfile"]["data"]
        assert [line.split(":")[1] for line in "".join(hosts.values()).split()] == ["2"] * (ranks // 2)
        assert children[f"PodGroup/split-w{world}"]["spec"]["minMember"] == ranks // 2 + 1


def test_the_router_routes_over_every_world_of_each_pool() -> None:
    children = by_ref(render.children(OWNER, spec(context=2, generation=2)))
    router = children["Deployment/split-router"]
    pod = router["spec"]["template"]
    command = command_of(pod["spec"])
    assert command[:2] == ["berth", "serve"]
    assert flag(command, "--route") == [
        "context=http://launcher.split-w0.ml.svc:8000,http://launcher.split-w1.ml.svc:8000",
        "generation=http://launcher.split-w2.ml.svc:8000,http://launcher.split-w3.ml.svc:8000",
    ]
    assert flag(command, "--port") == [str(naming.ENGINE_PORT)] and flag(command, "--host") == ["0.0.0.0"]
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    # It holds no engine credential: no Secret reaches it.
    assert not any("valueFrom" in var for var in container["env"])
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert router["metadata"]["ownerReferences"][0]["uid"] == "5678-uid"
    # One router pod unless asked; more are interchangeable (the router keeps no state).
    assert router["spec"]["replicas"] == 1
    pools = {"context": {"replicas": 1}, "generation": {"replicas": 1}, "router": {"replicas": 2}}
    routers = by_ref(render.children(OWNER, spec(disaggregation=pools)))["Deployment/split-router"]
    assert routers["spec"]["replicas"] == 2


def test_the_endpoint_service_selects_the_router_and_no_launcher() -> None:
    children = by_ref(render.children(OWNER, spec()))
    selector = {"matchLabels": children["Service/split"]["spec"]["selector"]}
    router_labels = children["Deployment/split-router"]["spec"]["template"]["metadata"]["labels"]
    assert matches_label_selector(selector, router_labels)
    launchers = [child for ref, child in children.items() if ref.startswith("Pod/")]
    assert len(launchers) == 3
    assert not any(matches_label_selector(selector, pod["metadata"]["labels"]) for pod in launchers)
    # Without disaggregation, launchers are the endpoint and there is no router.
    plain = by_ref(render.children(OWNER, parse_spec({"model": {"path": "/m"}, "image": "x"})))
    assert "Deployment/split-router" not in plain
    assert matches_label_selector(selector, plain["Pod/split-w0-launcher"]["metadata"]["labels"])


def test_context_workers_take_kv_pulls_from_the_deployments_workers() -> None:
    children = by_ref(render.children(OWNER, spec(context=1, generation=1)))

    def kv_rules(world: int) -> list[dict[str, Any]]:
        ingress = children[f"NetworkPolicy/split-w{world}-worker"]["spec"]["ingress"]
        port = {"protocol": "TCP", "port": naming.KV_TRANSFER_PORT}
        return [rule for rule in ingress if port in rule["ports"]]

    (rule,) = kv_rules(0)
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {naming.DEPLOYMENT: "split", naming.ROLE: "worker"}}}
    ]
    assert kv_rules(1) == []  # a generation world serves no KV


def test_a_pool_change_is_a_new_rollout_target() -> None:
    before = render.pod_specs_digest(OWNER, spec(context=1, generation=1))
    assert render.pod_specs_digest(OWNER, spec(context=1, generation=1)) == before
    assert render.pod_specs_digest(OWNER, spec(context=1, generation=1, image="berth:2")) != before
    plain = parse_spec({"model": {"path": "/models/llama", "name": "llama"}, "image": "berth:1"})
    assert render.pod_specs_digest(OWNER, plain) != before


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"replicas": 4}, r"replicas \(4\) conflicts with disaggregation: the worlds are the pools' \(2 "),
        ({"frontends": 1}, r"frontends: not with disaggregation \(the router is the endpoint"),
        ({"autoscaling": {"maxReplicas": 3, "target": 4}}, r"autoscaling: not with disaggregation yet"),
        ({"tensorParallelSize": 2}, r"tensorParallelSize: not with disaggregation \(each pool has its own"),
        (
            {"gpusPerNode": 2, "disaggregation": {"generation": {"tensorParallelSize": 3}}},
            r"disaggregation\.POOL\.tensorParallelSize must be a multiple of gpusPerNode",
        ),
        ({"engineArgs": ["--role=both"]}, r"engineArgs must not set --role"),
        ({"engineArgs": ["--kv-transfer-endpoint=tcp://x:1"]}, r"must not set --kv-transfer-endpoint"),
    ],
)
def test_what_disaggregation_does_not_combine_with_is_refused_clearly(changes: dict, message: str) -> None:
    with pytest.raises(InvalidSpec, match=message):
        spec(**changes)
