"""Rendering is pure: spec in, manifests out. Field by field, for each child."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import yaml

from berth.operator import credentials, naming, render
from berth.operator.crd_model import InvalidSpec, parse_spec
from tests.support.e2e import REPO
from tests.support.kube_emulator import matches_label_selector

OWNER = render.Owner(name="llama", namespace="ml", uid="1234-uid")


def spec(**changes: Any):
    raw: dict[str, Any] = {
        "model": {
            "path": "/models/llama",
            "name": "llama-8b",
            "volume": {"mountPath": "/models", "persistentVolumeClaim": {"claimName": "weights"}},
        },
        "image": "berth:1",
        "replicas": 2,
        "tensorParallelSize": 4,
        "gpusPerNode": 2,
        "frontends": 3,
        "engineArgs": ["--max-num-seqs=8", "--enable-prefix-caching"],
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "80Gi"}},
        "launcherResources": {"requests": {"cpu": "1"}},
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }  # fmt: skip
    raw.update(changes)
    return parse_spec(raw)


def owner_refs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["metadata"]["ownerReferences"]


def test_owner_reference_is_explicit_controller() -> None:
    assert render.owner_reference(OWNER) == {
        "apiVersion": "berth.dev/v1alpha1",
        "kind": "LLMDeployment",
        "name": "llama",
        "uid": "1234-uid",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def test_children_names_and_order() -> None:
    refs = [f"{child['kind']}/{child['metadata']['name']}" for child in render.children(OWNER, spec())]
    assert refs == [
        "NetworkPolicy/llama-w0-launcher", "NetworkPolicy/llama-w0-worker", "NetworkPolicy/llama-w0-frontend",
        "ConfigMap/llama-w0-hostfile", "Service/llama-w0", "PodDisruptionBudget/llama-w0",
        "StatefulSet/llama-w0", "Pod/llama-w0-launcher",
        "Deployment/llama-w0-frontend",
        "NetworkPolicy/llama-w1-launcher", "NetworkPolicy/llama-w1-worker", "NetworkPolicy/llama-w1-frontend",
        "ConfigMap/llama-w1-hostfile", "Service/llama-w1", "PodDisruptionBudget/llama-w1",
        "StatefulSet/llama-w1", "Pod/llama-w1-launcher",
        "Deployment/llama-w1-frontend",
        "Service/llama",
    ]  # fmt: skip
    for child in render.children(OWNER, spec()):
        assert owner_refs(child) == [render.owner_reference(OWNER)]
        assert child["metadata"]["namespace"] == "ml"
        labels = child["metadata"]["labels"]
        assert labels[naming.MANAGED_BY] == "berth" and labels[naming.DEPLOYMENT] == "llama"


def test_a_world_s_disruption_budget_refuses_every_eviction_but_of_pods_released_to_a_drain() -> None:
    children = render.children(OWNER, spec())
    budget = next(
        c for c in children if c["kind"] == "PodDisruptionBudget" and c["metadata"]["name"] == "llama-w1"
    )
    assert budget["apiVersion"] == "policy/v1" and budget["spec"]["maxUnavailable"] == 0
    selector = budget["spec"]["selector"]
    pods = [c for c in children if c["kind"] == "Pod"] + [
        {"metadata": sts["spec"]["template"]["metadata"]} for sts in children if sts["kind"] == "StatefulSet"
    ]
    frontends = [
        {"metadata": d["spec"]["template"]["metadata"]} for d in children if d["kind"] == "Deployment"
    ]
    # World 1's launcher and worker pods, not world 0's, not the frontends (a Deployment's pods).
    selected = [
        (pod["metadata"]["labels"][naming.WORLD], pod["metadata"]["labels"][naming.ROLE])
        for pod in pods + frontends
        if matches_label_selector(selector, pod["metadata"]["labels"])
    ]
    assert sorted(selected) == [("1", "launcher"), ("1", "worker")]
    released = {**pods[1]["metadata"]["labels"], naming.EVICTABLE: "true"}
    assert not matches_label_selector(selector, released)


def test_network_policies_open_only_what_berth_uses_and_can_be_turned_off() -> None:
    policies = {
        child["metadata"]["name"]: child["spec"]
        for child in render.world_children(OWNER, spec(), 1)
        if child["kind"] == "NetworkPolicy"
    }
    world = {naming.DEPLOYMENT: "llama", naming.WORLD: "1"}

    def peers(*roles: str) -> list[dict]:
        return [{"podSelector": {"matchLabels": {**world, naming.ROLE: role}}} for role in roles]

    tcp = [{"protocol": "TCP", "port": 1024, "endPort": 65535}]
    launcher = policies["llama-w1-launcher"]
    assert launcher["podSelector"] == {"matchLabels": {**world, naming.ROLE: "launcher"}}
    assert launcher["policyTypes"] == ["Ingress"]
    assert launcher["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 8000}]},  # clients, the Service, the probes
        {"ports": [{"protocol": "TCP", "port": 8001}], "from": peers("frontend")},
        {
            "ports": [{"protocol": "TCP", "port": 8002}],
            "from": [
                {
                    "namespaceSelector": {},
                    "podSelector": {"matchLabels": {naming.NAME_LABEL: "berth-operator"}},
                }
            ],
        },
        {"ports": tcp, "from": peers("worker")},
    ]
    assert policies["llama-w1-worker"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 22}], "from": peers("launcher")},
        {"ports": tcp, "from": peers("launcher", "worker")},
    ]
    assert policies["llama-w1-frontend"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 8000}]},
        {"ports": tcp, "from": peers("launcher")},
    ]
    without_frontends = render.world_children(OWNER, spec(frontends=0), 1)
    assert "llama-w1-frontend" not in {child["metadata"]["name"] for child in without_frontends}
    opted_out = render.children(OWNER, spec(networkPolicy={"enabled": False}))
    assert not [child for child in opted_out if child["kind"] == "NetworkPolicy"]


def test_no_frontend_deployment_without_frontends() -> None:
    kinds = [child["kind"] for child in render.world_children(OWNER, spec(frontends=0), 0)]
    assert "Deployment" not in kinds


def test_hostfile_lists_each_worker_with_its_slots() -> None:
    assert render.hostfile(OWNER, spec(), 1)["data"] == {
        "hostfile": "llama-w1-0.llama-w1.ml.svc:2\nllama-w1-1.llama-w1.ml.svc:2\n"
    }
    cpu = spec(gpusPerNode=0, tensorParallelSize=3)
    assert render.hostfile(OWNER, cpu, 0)["data"]["hostfile"].count(":1\n") == 3


def test_headless_service_publishes_not_ready_addresses() -> None:
    service = render.headless_service(OWNER, 1)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {
        naming.MANAGED_BY: "berth", naming.NAME_LABEL: "berth", naming.DEPLOYMENT: "llama", naming.WORLD: "1",
    }  # fmt: skip


def test_worker_statefulset() -> None:
    sts = render.worker_statefulset(OWNER, spec(), 0)
    assert sts["metadata"]["name"] == "llama-w0"
    body = sts["spec"]
    assert body["replicas"] == 2  # tensorParallelSize 4 / gpusPerNode 2
    assert body["serviceName"] == "llama-w0"
    assert body["podManagementPolicy"] == "Parallel"
    assert body["updateStrategy"] == {"type": "OnDelete"}
    assert body["selector"]["matchLabels"] == {
        naming.DEPLOYMENT: "llama",
        naming.WORLD: "0",
        naming.ROLE: "worker",
    }
    template = body["template"]
    assert template["metadata"]["labels"][naming.ROLE] == "worker"
    assert naming.ENDPOINT not in template["metadata"]["labels"]  # workers serve no HTTP
    pod = template["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    # No hard one-pod-per-node rule (the GPU requests decide what fits); ranks prefer one node.
    assert "podAntiAffinity" not in pod["affinity"]
    (pack,) = pod["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pack["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    (container,) = pod["containers"]
    # sshd in the foreground, after making the pod's own host key.
    assert container["command"][:2] == ["/bin/sh", "-c"]
    assert container["command"][2].endswith("&& exec /usr/sbin/sshd -De")
    assert "ssh-keygen -q -t ed25519 -N '' -f /etc/ssh/berth/ssh_host_ed25519_key" in container["command"][2]
    assert container["image"] == "berth:1" and container["imagePullPolicy"] == "IfNotPresent"
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
        "limits": {"memory": "80Gi", "nvidia.com/gpu": "2"},
    }
    assert container["volumeMounts"] == [
        {"name": "ssh", "mountPath": "/etc/berth/ssh", "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "model", "mountPath": "/models", "readOnly": True},
    ]
    assert pod["volumes"] == [
        # Workers only let the launcher's key in: they never hold the private key.
        {
            "name": "ssh",
            "secret": {
                "secretName": "llama-ssh",
                "defaultMode": 0o400,
                "items": [{"key": "authorized_keys", "path": "authorized_keys"}],
            },
        },
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
    ]
    # sshd runs as root (it switches to the login user) with only the capabilities it needs.
    assert pod["securityContext"] == {"fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": list(render.SSHD_CAPABILITIES)},
    }
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert {"name": "BERTH_WORLD", "value": "0"} in container["env"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    assert template["metadata"]["annotations"][naming.SPEC_HASH] == render.spec_hash(pod)


def test_single_node_world_has_no_anti_affinity_and_cpu_world_no_gpus() -> None:
    assert "affinity" not in render.worker_pod_spec(OWNER, spec(tensorParallelSize=2, gpusPerNode=2), 0)
    cpu = render.worker_pod_spec(OWNER, spec(gpusPerNode=0, tensorParallelSize=1, resources={}), 0)
    assert cpu["containers"][0]["resources"] == {}


def test_launcher_pod() -> None:
    pod = render.launcher_pod(OWNER, spec(), 1)
    assert pod["metadata"]["name"] == "llama-w1-launcher"
    assert pod["metadata"]["labels"][naming.ROLE] == "launcher"
    assert pod["metadata"]["labels"][naming.ENDPOINT] == "true"
    body = pod["spec"]
    assert body["hostname"] == "launcher" and body["subdomain"] == "llama-w1"
    assert body["restartPolicy"] == "Never"
    (container,) = body["containers"]
    assert container["command"] == [
        "berth", "launch", "/models/llama", "--hostfile", "/etc/berth/hostfile/hostfile",
        "--tensor-parallel-size", "4", "--gpus-per-node", "2", "--host", "0.0.0.0", "--port", "8000",
        "--admin-port", "8002", "--attach-port", "8001", "--served-model-name", "llama-8b",
        "--shutdown-timeout", "300", "--max-num-seqs=8", "--enable-prefix-caching",
    ]  # fmt: skip
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000},
        {"name": "attach", "containerPort": 8001},
        {"name": "admin", "containerPort": 8002},
    ]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert container["resources"] == {"requests": {"cpu": "1"}}
    assert container["env"][:2] == [
        {
            "name": "BERTH_ENGINE_KEY",
            "valueFrom": {"secretKeyRef": {"name": "llama-engine-key", "key": "key"}},
        },
        {
            "name": "BERTH_ADMIN_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "llama-admin-token", "key": "token"}},
        },
    ]
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts == {
        "hostfile": "/etc/berth/hostfile",
        "ssh": "/etc/berth/ssh",
        "dshm": "/dev/shm",
        "model": "/models",
    }
    assert body["volumes"][0] == {"name": "hostfile", "configMap": {"name": "llama-w1-hostfile"}}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in body["volumes"]
    # mpirun's ssh needs the private key only; the authorized_keys are the workers'.
    (ssh,) = [volume["secret"] for volume in body["volumes"] if volume["name"] == "ssh"]
    assert ssh["items"] == [{"key": "id_ed25519", "path": "id_ed25519"}]
    assert body["securityContext"] == {
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
    }
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert pod["metadata"]["annotations"][naming.SPEC_HASH] == render.spec_hash(body)


def test_launcher_without_served_name_or_volume() -> None:
    plain = spec(model={"path": "/opt/model"})
    pod = render.launcher_pod(OWNER, plain, 0)
    assert "--served-model-name" not in pod["spec"]["containers"][0]["command"]
    assert "--model-revision" not in pod["spec"]["containers"][0]["command"]
    assert render.launcher_model(pod["spec"]["containers"][0]["command"]) == ("/opt/model", None)
    assert [volume["name"] for volume in pod["spec"]["volumes"]] == ["hostfile", "ssh", "dshm"]


def test_a_model_revision_is_a_flag_of_the_launcher_and_moves_its_spec_hash() -> None:
    named = spec(model={"path": "/opt/model", "revision": "2026-12-01"})
    renamed = spec(model={"path": "/opt/model", "revision": "2026-12-02"})
    pod = render.launcher_pod(OWNER, named, 0)
    command = pod["spec"]["containers"][0]["command"]
    assert command[command.index("--model-revision") + 1] == "2026-12-01"
    assert render.launcher_model(command) == ("/opt/model", "2026-12-01")
    hashes = {
        render.launcher_pod(OWNER, s, 0)["metadata"]["annotations"][naming.SPEC_HASH]
        for s in (named, renamed)
    }
    assert len(hashes) == 2  # a new name for the weights rolls the worlds
    # Workers run no model server: the name is the launcher's alone.
    assert render.worker_pod_spec(OWNER, named, 0) == render.worker_pod_spec(OWNER, renamed, 0)


def test_spec_hash_moves_with_the_spec_only() -> None:
    first = render.launcher_pod(OWNER, spec(), 0)["metadata"]["annotations"][naming.SPEC_HASH]
    assert first == render.launcher_pod(OWNER, spec(), 0)["metadata"]["annotations"][naming.SPEC_HASH]
    changed = render.launcher_pod(OWNER, spec(image="berth:2"), 0)["metadata"]["annotations"][
        naming.SPEC_HASH
    ]
    assert changed != first


def test_frontend_deployment() -> None:
    deployment = render.frontend_deployment(OWNER, spec(), 1)
    assert deployment["metadata"]["name"] == "llama-w1-frontend"
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["selector"]["matchLabels"] == {
        naming.DEPLOYMENT: "llama", naming.WORLD: "1", naming.ROLE: "frontend",
    }  # fmt: skip
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"][naming.ENDPOINT] == "true"
    (container,) = template["spec"]["containers"]
    assert container["command"] == [
        "berth", "serve", "--attach", "tcp://launcher.llama-w1.ml.svc:8001",
        "--host", "0.0.0.0", "--port", "8000", "--shutdown-timeout", "300",
    ]  # fmt: skip
    assert [var["name"] for var in container["env"][:2]] == ["BERTH_ENGINE_KEY", "BERTH_ADMIN_TOKEN"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_startup_probe_budget_follows_the_spec() -> None:
    default = render.launcher_pod(OWNER, spec(), 0)["spec"]["containers"][0]["startupProbe"]
    assert default["periodSeconds"] * default["failureThreshold"] == 600
    slow = spec(health={"startupTimeoutSeconds": 3601})
    probe = render.launcher_pod(OWNER, slow, 0)["spec"]["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] == 5 and probe["failureThreshold"] == 721  # at least 3601 s
    frontend = render.frontend_deployment(OWNER, slow, 0)["spec"]["template"]["spec"]["containers"][0]
    assert frontend["startupProbe"] == probe


def serving_pod_specs(raw_spec) -> list[dict[str, Any]]:
    """The pod specs of the pods in the Service: a launcher and a frontend."""
    return [
        render.launcher_pod(OWNER, raw_spec, 0)["spec"],
        render.frontend_deployment(OWNER, raw_spec, 0)["spec"]["template"]["spec"],
    ]


def test_readiness_tolerates_one_slow_answer_and_still_drops_a_parked_engine_within_6_s() -> None:
    for pod in serving_pod_specs(spec()):
        probe = pod["containers"][0]["readinessProbe"]
        assert probe["failureThreshold"] >= 3  # one late answer does not leave the Service
        # A parked engine answers 503 at once: out after at most failureThreshold periods, no
        # later than one failed check every 5 s took it out before.
        assert probe["periodSeconds"] * probe["failureThreshold"] <= 6
        assert probe["timeoutSeconds"] == 3
        assert probe.get("successThreshold", 1) == 1  # a woken engine is back after one answer


def test_serving_pods_get_the_drain_timeout_and_a_margin_before_sigkill() -> None:
    for pod in serving_pod_specs(spec()):
        assert pod["terminationGracePeriodSeconds"] == 300 + render.TERMINATION_MARGIN_SECONDS
        command = pod["containers"][0]["command"]
        assert command[command.index("--shutdown-timeout") + 1] == "300"
    quick = spec(rollout={"drainTimeoutSeconds": 20})
    for pod in serving_pod_specs(quick):
        assert pod["terminationGracePeriodSeconds"] == 20 + render.TERMINATION_MARGIN_SECONDS
        command = pod["containers"][0]["command"]
        assert command[command.index("--shutdown-timeout") + 1] == "20"
    # Workers run sshd, no server that drains: the Kubernetes default.
    assert "terminationGracePeriodSeconds" not in render.worker_pod_spec(OWNER, spec(), 0)
    # A template's grace period is the user's word.
    template = {"template": {"spec": {"terminationGracePeriodSeconds": 45}}}
    chosen = spec(launcher=template, frontend=template)
    assert [pod["terminationGracePeriodSeconds"] for pod in serving_pod_specs(chosen)] == [45, 45]
    # An engineArgs --shutdown-timeout comes after the operator's, so it is the one that counts.
    own = render.launcher_pod(OWNER, spec(engineArgs=["--shutdown-timeout=10"]), 0)
    assert own["spec"]["containers"][0]["command"][-1] == "--shutdown-timeout=10"


def test_pods_the_operator_deletes_with_nothing_to_drain_get_the_margin_only() -> None:
    assert render.stop_grace_seconds(spec()) == render.TERMINATION_MARGIN_SECONDS
    quick = {"template": {"spec": {"terminationGracePeriodSeconds": 5}}}
    assert render.stop_grace_seconds(spec(workers=quick)) == 5  # never longer than a template's
    slow = {"template": {"spec": {"terminationGracePeriodSeconds": 600}}}
    assert render.stop_grace_seconds(spec(launcher=slow)) == render.TERMINATION_MARGIN_SECONDS


def test_rendered_as_the_api_server_stores_it() -> None:
    # Quantities in canonical form and empty env values without `value`: what the server would
    # read back, so a reconcile never sees drift it caused itself.
    odd = spec(
        resources={"requests": {"cpu": "0.5", "memory": "1.5Gi"}, "limits": {"memory": "2048Mi"}},
        launcherResources={"requests": {"cpu": 2, "memory": "1000M"}},
        env=[{"name": "EMPTY", "value": ""}, {"name": "SET", "value": "x"}],
    )
    worker = render.worker_pod_spec(OWNER, odd, 0)["containers"][0]
    assert worker["resources"]["requests"] == {"cpu": "500m", "memory": "1536Mi", "nvidia.com/gpu": "2"}
    assert worker["resources"]["limits"] == {"memory": "2Gi", "nvidia.com/gpu": "2"}
    assert {"name": "EMPTY"} in worker["env"] and {"name": "SET", "value": "x"} in worker["env"]
    launcher = render.launcher_pod(OWNER, odd, 0)["spec"]["containers"][0]
    assert launcher["resources"] == {"requests": {"cpu": "2", "memory": "1G"}}


def test_endpoint_service() -> None:
    service = render.endpoint_service(
        OWNER, spec(service={"type": "LoadBalancer", "port": 80, "annotations": {"lb": "internal"}})
    )
    assert service["metadata"]["name"] == "llama"
    assert service["metadata"]["annotations"] == {"lb": "internal"}
    assert service["spec"] == {
        "type": "LoadBalancer",
        "selector": {naming.DEPLOYMENT: "llama", naming.ENDPOINT: "true"},
        "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
    }


def test_no_service_exposes_the_admin_port() -> None:
    """The operator reaches /admin on the launcher pod's IP; no Service routes there."""
    services = [child for child in render.children(OWNER, spec()) if child["kind"] == "Service"]
    assert services
    for service in services:
        for port in service["spec"]["ports"]:
            assert naming.ADMIN_PORT not in (port["port"], port["targetPort"]), service["metadata"]["name"]
            assert port["targetPort"] != "admin"


def test_secrets_carry_generated_material() -> None:
    pair = credentials.new_ssh_key_pair("llama")
    ssh = render.ssh_secret(OWNER, pair)
    assert ssh["metadata"]["name"] == "llama-ssh"
    decoded = {key: base64.b64decode(value).decode() for key, value in ssh["data"].items()}
    assert decoded["id_ed25519"] == pair.private_openssh
    assert decoded["authorized_keys"] == decoded["id_ed25519.pub"] == pair.public_openssh
    assert pair.public_openssh.startswith("ssh-ed25519 ") and pair.public_openssh.endswith(" llama\n")
    key = credentials.new_engine_key()
    assert len(bytes.fromhex(key)) == 32 and key != credentials.new_engine_key()
    engine = render.engine_key_secret(OWNER, key)
    assert base64.b64decode(engine["data"]["key"]).decode() == key
    token = render.admin_token_secret(OWNER, "t0k3n")
    assert token["metadata"]["name"] == "llama-admin-token" and token["data"] == {"token": "dDBrM24="}
    assert "t0k3n" not in repr(pair) and "PRIVATE" not in repr(pair)  # never printed by accident


def test_invalid_spec_names_the_field() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.replicas: Input should be greater than or equal to 0"):
        parse_spec({"model": {"path": "/m"}, "image": "x", "replicas": -1})
    with pytest.raises(InvalidSpec, match=r"spec\.image: Field required"):
        parse_spec({"model": {"path": "/m"}})


def engine_containers(spec_: Any) -> list[dict[str, Any]]:
    """Every container of a world that runs part of the engine: launcher, frontends, workers."""
    containers = []
    for child in render.world_children(OWNER, spec_, 0):
        if child["kind"] == "Pod":
            containers += child["spec"]["containers"]
        elif child["kind"] in ("StatefulSet", "Deployment"):
            containers += child["spec"]["template"]["spec"]["containers"]
    return containers


def test_every_engine_container_gets_the_kv_cache_memory_fraction_the_operator_reserves() -> None:
    """The pod's memory limit reaches the engine through its cgroup; the share of it the KV pool
    may take through this variable (read by EngineConfig: tests/engine/test_memory_budget.py)."""
    containers = engine_containers(spec())
    assert {c["name"] for c in containers} >= {"launcher", "worker", "frontend"}
    for container in containers:
        fractions = [e for e in container["env"] if e["name"] == "BERTH_KV_CACHE_MEMORY_FRACTION"]
        assert fractions == [{"name": "BERTH_KV_CACHE_MEMORY_FRACTION", "value": "0.9"}], container["name"]


def test_a_users_kv_cache_memory_fraction_replaces_the_operators() -> None:
    env = [{"name": "BERTH_KV_CACHE_MEMORY_FRACTION", "value": "0.6"}]
    for container in engine_containers(spec(env=env)):
        fractions = [e for e in container["env"] if e["name"] == "BERTH_KV_CACHE_MEMORY_FRACTION"]
        assert fractions == env, container["name"]


@pytest.mark.parametrize("example", ["llmdeployment.yaml", "llmdeployment-cpu.yaml"])
def test_example_workers_request_the_memory_their_limit_gives_the_engine(example: str) -> None:
    """The engine plans its KV pool against the worker's memory limit (its cgroup): the
    examples reserve that much (requests equal limits), so the node has what the engine uses."""
    raw = yaml.safe_load((REPO / "manifests" / "examples" / example).read_text())
    (worker,) = render.worker_pod_spec(OWNER, parse_spec(raw["spec"]), 0)["containers"]
    memory = {part: worker["resources"][part]["memory"] for part in ("requests", "limits")}
    assert memory["requests"] == memory["limits"], memory
