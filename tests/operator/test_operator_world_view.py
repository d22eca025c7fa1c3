"""How the pods of a world are judged: a pod the kernel's OOM killer ended is told apart from a
crash (its fix is memory, not code), and every failure names the node it happened on."""

from __future__ import annotations

from typing import Any

from berth.operator.worlds import view_pods


def pod(
    name: str, phase: str = "Running", reason: str | None = None, node: str = "gpu-node-3"
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "podIP": "10.0.0.9"}
    if reason is not None:
        terminated = {
            "exitCode": 137,
            "reason": reason,
            "message": "out of memory" if reason == "OOMKilled" else "x",
        }
        status["containerStatuses"] = [{"name": "worker", "state": {"terminated": terminated}}]
    return {"metadata": {"name": name, "uid": f"uid-{name}"}, "spec": {"nodeName": node}, "status": status}


def test_an_oom_killed_pod_is_its_own_reason_and_every_failure_names_its_node() -> None:
    launcher = pod("llama-w0-launcher", node="cpu-node-1")
    oom = view_pods(
        "llama", 0, launcher, [pod("llama-w0-0", "Failed", "OOMKilled"), pod("llama-w0-1")], 2, {}
    )
    assert (oom.failure.reason, oom.failure.node) == ("OOMKilled", "gpu-node-3")
    assert (
        oom.failure.error
        == "worker pod llama-w0-0: container worker exited with code 137 (OOMKilled): out of memory"
    )
    crash = view_pods("llama", 0, launcher, [pod("llama-w0-0", "Failed", "Error"), pod("llama-w0-1")], 2, {})
    assert crash.failure.reason == "WorkerFailed"
    dead_launcher = view_pods(
        "llama", 0, pod("llama-w0-launcher", "Failed", "OOMKilled", "cpu-node-1"), [], 0, {}
    )
    assert (dead_launcher.failure.reason, dead_launcher.failure.node) == ("OOMKilled", "cpu-node-1")
    assert view_pods("llama", 0, launcher, [pod("llama-w0-0")], 1, {}).launcher_node == "cpu-node-1"
