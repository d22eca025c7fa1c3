"""Rolling spec changes through the operator, against a real `berth serve` per launcher:

- a spec change that needs new pods rolls world by world, each drained by sleep first, while a
  client keeps sending requests to the ready endpoints: none fails, at most one world is out of
  service at any time (from the statuses recorded all along), every world ends on the new spec;
- a change of only the model path, with `rollout.inPlaceWeightSwap`, sleeps and wakes each
  world with the new weights: the same pods, the same engine processes, outputs equal to
  `transformers` on the new checkpoint;
- an operator killed mid-rollout (between two worlds, and while a world is parked) resumes
  without skipping or repeating a world and leaves none parked.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from prometheus_client import REGISTRY
from transformers import AutoModelForCausalLM, AutoTokenizer

from berth.engine.models.tiny_model import make_tiny_model
from berth.operator import naming, render
from berth.operator.crd_model import parse_spec
from tests.support.argocd_health import argocd_health
from tests.support.cluster import Cluster, ClusterSim, sampling, wait_for
from tests.support.engine_endpoint import START_TIMEOUT, EngineEndpoint, EngineFleet
from tests.support.kstatus import kstatus
from tests.support.operator_runner import running_operator

LLMD = "berth.dev/v1alpha1/llmdeployments"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"
ROLLOUT_TIMEOUT = 180.0
LAUNCHERS = ("llama-w0-launcher", "llama-w1-launcher")


async def two_ready_worlds(cluster: Cluster, tmp_path: Path, model: Path, **rollout: Any) -> None:
    """Apply the example with 2 worlds serving `model`; return once both are Ready."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(replicas=2, frontends=0, rollout={"drainTimeoutSeconds": 60, **rollout})
    # The model path is a real checkpoint: an in-place swap makes the engine load it.
    doc["spec"]["model"] = {"path": str(model), "name": "llama"}
    # A poll may take seconds while engines start on a loaded machine: an unanswered poll would
    # show a serving world as unavailable.
    doc["spec"]["health"] = {"intervalSeconds": 3, "timeoutSeconds": 3, "failureThreshold": 3}
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))
    await cluster.kubectl("apply", "--validate=false", "-f", str(tmp_path / "llama.yaml"))
    await wait_for(lambda: status(cluster).get("readyReplicas") == 2, START_TIMEOUT, "2 worlds Ready")


def llmd(cluster: Cluster) -> dict[str, Any]:
    return cluster.get(LLMD, "llama") or {}


def status(cluster: Cluster) -> dict[str, Any]:
    return llmd(cluster).get("status") or {}


def events(cluster: Cluster, reason: str) -> list[str]:
    return [event["message"] for event in cluster.objects("v1/events") if event.get("reason") == reason]


def rollout_complete(cluster: Cluster) -> bool:
    current = status(cluster)
    rollout = current.get("rollout") or {}
    return bool(
        rollout.get("complete")
        and rollout.get("done") == [0, 1]
        and current.get("readyReplicas") == 2
        and current.get("observedGeneration") == llmd(cluster)["metadata"]["generation"]
    )


async def patch_spec(cluster: Cluster, spec: dict[str, Any]) -> None:
    await cluster.kubectl("patch", "llmd", "llama", "--type=merge", "-p", yaml.safe_dump({"spec": spec}))


@contextlib.asynccontextmanager
async def recorded_statuses(cluster: Cluster) -> AsyncIterator[list[list[bool]]]:
    """Every 20 ms, which worlds the status says are ready."""
    seen: list[list[bool]] = []

    def sample() -> None:
        worlds = [w for w in status(cluster).get("worlds") or [] if w.get("phase") != "Retiring"]
        seen.append([bool(w.get("ready")) for w in worlds])

    async with sampling(sample, 0.02):
        yield seen


def rollout_gauge() -> tuple[float, ...]:
    """berth_operator_rollout_worlds for the deployment: (done, in_flight, waiting)."""
    labels = {"namespace": "default", "deployment": "llama"}
    return tuple(
        REGISTRY.get_sample_value("berth_operator_rollout_worlds", {**labels, "state": state}) or 0.0
        for state in ("done", "in_flight", "waiting")
    )


def ready_endpoints(fleet: EngineFleet) -> list[EngineEndpoint]:
    """The servers of the launcher pods that run now (a replaced world has none for a while)."""
    found = []
    for name in LAUNCHERS:
        with contextlib.suppress(AssertionError):
            found.append(fleet.for_pod(name))
    return found


@contextlib.asynccontextmanager
async def steady_client(fleet: EngineFleet) -> AsyncIterator[dict[str, Any]]:
    """A client sending one request after another to an endpoint whose /ready is 200 (what the
    Service routes to). A 503 refusal (the engine closed admission between the readiness check
    and the request: it admitted nothing) is retried elsewhere, as clients do on Retry-After;
    anything else that is not a complete answer counts as failed."""
    tally: dict[str, Any] = {"ok": 0, "refused": 0, "failed": []}

    async def loop() -> None:
        async with httpx.AsyncClient() as client:
            while True:
                candidates = []
                for endpoint in ready_endpoints(fleet):
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(f"{endpoint.url}/ready", timeout=2)).status_code == 200:
                            candidates.append(endpoint)
                if not candidates:
                    tally["failed"].append("no ready endpoint")
                    await asyncio.sleep(0.05)
                    continue
                endpoint = candidates[tally["ok"] % len(candidates)]
                try:
                    response = await client.post(
                        f"{endpoint.url}/v1/completions",
                        json={
                            "model": str(fleet.model),
                            "prompt": "hello",
                            "max_tokens": 16,
                            "ignore_eos": True,
                        },
                        timeout=30,
                    )
                except httpx.HTTPError as error:
                    # A server stopped under an admitted request (no drain) ends here.
                    tally["failed"].append(f"{endpoint.url}: {type(error).__name__}")
                    continue
                if response.status_code == 503 and "retry-after" in response.headers:
                    tally["refused"] += 1
                elif (
                    response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
                ):
                    tally["ok"] += 1
                else:
                    tally["failed"].append(
                        f"{endpoint.url}: HTTP {response.status_code} {response.text[:200]}"
                    )

    task = asyncio.create_task(loop())
    try:
        yield tally
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def on_current_spec(cluster: Cluster) -> bool:
    raw = llmd(cluster)
    spec = parse_spec(raw["spec"], "llama")
    owner = render.Owner("llama", "default", raw["metadata"]["uid"])
    return all(
        cluster.get("v1/pods", naming.launcher_pod_name("llama", index))["metadata"]["annotations"][
            naming.SPEC_HASH
        ]
        == render.launcher_pod(owner, spec, index)["metadata"]["annotations"][naming.SPEC_HASH]
        for index in (0, 1)
    )


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_rolling_change_drains_one_world_at_a_time_and_fails_no_request(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    async with running_operator(cluster, fleet.resolve):
        await two_ready_worlds(cluster, tmp_path, fleet.model)
        async with recorded_statuses(cluster) as seen, steady_client(fleet) as tally:
            await wait_for(lambda: tally["ok"] >= 5, 30, "the client's first answers")
            assert status(cluster)["rollout"]["complete"] is True  # nothing to roll out yet
            assert kstatus(llmd(cluster))[0] == "Current"
            await patch_spec(cluster, {"env": [{"name": "BERTH_ROLLOUT_TEST", "value": "2"}]})
            # The real kubectl waits for Ready: it must block until every world runs the new spec.
            wait = ("wait", "--for=condition=Ready", "llmd/llama", f"--timeout={int(ROLLOUT_TIMEOUT)}s")
            async with cluster.kubectl_running(*wait) as waiter:
                under_way = await wait_for(
                    lambda: (rollout := status(cluster).get("rollout") or {}).get("inFlight") and rollout,
                    30,
                    "the rollout under way",
                )
                assert "complete" not in under_way, under_way  # the last rollout's word went with it
                healths: list[tuple[str, bool]] = []
                kstatuses: list[tuple[str, bool]] = []
                waited: list[tuple[bool, bool]] = []  # (kubectl wait returned, rollout complete)

                gauges: list[tuple[float, ...]] = []

                def judged() -> bool:  # what Argo CD, kstatus, kubectl and the metric say, until complete
                    current = llmd(cluster)
                    complete = rollout_complete(cluster)
                    healths.append((argocd_health(current)["status"], complete))
                    kstatuses.append((kstatus(current)[0], complete))
                    waited.append((waiter.returncode is not None, complete))
                    gauges.append(rollout_gauge())
                    return complete

                await wait_for(judged, ROLLOUT_TIMEOUT, "the rollout complete")
                await asyncio.wait_for(waiter.wait(), 30)
                out, err = await waiter.communicate()
                assert waiter.returncode == 0, err.decode()
                assert "condition met" in out.decode()
            await wait_for(lambda: rollout_gauge() == (2.0, 0.0, 0.0), 10, "the rollout metric: both done")
            await wait_for(lambda: tally["ok"] >= 5 + 10, 30, "answers after the rollout")
        assert argocd_health(llmd(cluster))["status"] == "Healthy"
        assert kstatus(llmd(cluster))[0] == "Current"

    # kubectl wait --for=condition=Ready did not return while the rollout was under way.
    assert [w for w in waited if w[0] and not w[1]] == [], waited
    assert ("InProgress", False) in kstatuses
    assert [k for k, complete in kstatuses if not complete and k == "Current"] == [], kstatuses

    assert tally["failed"] == [], tally
    # Never Healthy before the rollout completed, even while both worlds were ready between two.
    assert [h for h, complete in healths if not complete and h == "Healthy"] == [], healths
    assert ("Progressing", False) in healths
    # The rollout metric followed it: world 0 in flight with world 1 waiting (both done, above).
    assert (0.0, 1.0, 1.0) in gauges, gauges
    # At most one world out of service at any time, and the rollout took both in turn.
    assert all(ready.count(False) <= 1 for ready in seen if len(ready) == 2), [
        r for r in seen if r.count(False) > 1
    ]
    assert [False, True] in seen and [True, False] in seen
    assert on_current_spec(cluster)
    assert sorted(fleet.started) == sorted([*LAUNCHERS, *LAUNCHERS])  # each world replaced once
    assert sorted(events(cluster, "WorldReplaced")) == [
        "world 0 replaced: its launcher pod spec changed",
        "world 1 replaced: its launcher pod spec changed",
    ]
    # Each was drained (sleep, mode drain) before it was replaced.
    drained = [m for m in events(cluster, "WorldAsleep") if m.endswith("(rollout)")]
    assert len(drained) == 2, drained
    assert len(events(cluster, "RolloutComplete")) == 1


def hf_completions(model_path: Path, prompts: list[str], max_tokens: int) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    texts = []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        out = model.generate(
            torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=max_tokens,
            pad_token_id=model.generation_config.pad_token_id,
        )
        texts.append(tokenizer.decode(out[0, len(ids) :].tolist()))
    return texts


async def served_completions(
    endpoint: EngineEndpoint, model: str, prompts: list[str], max_tokens: int
) -> list[str]:
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{endpoint.url}/v1/completions",
            json={"model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0},
            timeout=60,
        )
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_an_in_place_weight_swap_keeps_pods_and_processes_and_serves_the_new_weights(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    new_model = tmp_path / "second-revision"
    make_tiny_model(new_model, seed=1)  # the same shapes, other weights
    prompts, max_tokens = ["The quick brown fox", "hello world"], 8
    async with running_operator(cluster, fleet.resolve):
        await two_ready_worlds(cluster, tmp_path, fleet.model, inPlaceWeightSwap=True)
        endpoints = [fleet.for_pod(name) for name in LAUNCHERS]
        pids = [await endpoint.engine_pid() for endpoint in endpoints]
        uids = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.objects("v1/pods")}
        before = await served_completions(endpoints[0], str(fleet.model), prompts, max_tokens)
        old_revision = status(cluster)["modelRevision"]

        async with recorded_statuses(cluster) as seen:
            await patch_spec(cluster, {"model": {"path": str(new_model), "name": "llama"}})
            await wait_for(lambda: rollout_complete(cluster), ROLLOUT_TIMEOUT, "the swap rolled out")
        served = [
            await served_completions(endpoint, str(fleet.model), prompts, max_tokens)
            for endpoint in endpoints
        ]
        final = status(cluster)
        expected = hf_completions(new_model, prompts, max_tokens)  # before the files change

        # The files at the same path rewritten (a sync job), then `model.revision` says so: the
        # worlds swap again, in place, and re-read the directory.
        make_tiny_model(new_model, seed=2)
        await patch_spec(cluster, {"model": {"path": str(new_model), "name": "llama", "revision": "v2"}})

        def relabelled() -> bool:
            worlds = status(cluster).get("worlds") or []
            return rollout_complete(cluster) and all(w.get("modelRevisionLabel") == "v2" for w in worlds)

        await wait_for(relabelled, ROLLOUT_TIMEOUT, "the new revision swapped in")
        rewritten = [
            await served_completions(endpoint, str(fleet.model), prompts, max_tokens)
            for endpoint in endpoints
        ]
        relabelled_status = status(cluster)
        after_pids = [await endpoint.engine_pid() for endpoint in endpoints]

    assert after_pids == pids
    assert {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.objects("v1/pods")} == uids
    assert sorted(fleet.started) == sorted(LAUNCHERS)  # no engine started again
    assert events(cluster, "WorldReplaced") == []
    assert (
        final["modelRevision"].startswith(f"{new_model}@sha256:") and final["modelRevision"] != old_revision
    )
    assert all(world["modelRevision"] == final["modelRevision"] for world in final["worlds"])
    assert all(ready.count(False) <= 1 for ready in seen if len(ready) == 2)
    assert sorted(events(cluster, "WeightsSwapped"))[0].startswith("world 0: swap done")
    assert served == [expected, expected]
    assert before != expected  # the old weights answered otherwise
    # The revision: a new digest at the same path, its name on every world, no pod replaced.
    relabelled_worlds = relabelled_status["worlds"]
    assert all(world["modelRevision"].startswith(f"{new_model}@sha256:") for world in relabelled_worlds)
    assert relabelled_status["modelRevision"] not in (final["modelRevision"], old_revision)
    assert len(events(cluster, "WeightsSwapped")) == 4
    rewritten_expected = hf_completions(new_model, prompts, max_tokens)
    assert rewritten == [rewritten_expected, rewritten_expected] and rewritten_expected != expected


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_an_operator_killed_mid_rollout_resumes_without_skipping_or_repeating(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    async with running_operator(cluster, fleet.resolve):
        await two_ready_worlds(cluster, tmp_path, fleet.model)
        await patch_spec(cluster, {"env": [{"name": "BERTH_ROLLOUT_TEST", "value": "kill"}]})
        # Point 1, between two worlds: world 0's new pods are starting (its engine takes seconds
        # to load), world 1 is not taken yet (at most one world out of service).
        await wait_for(
            lambda: fleet.started.count("llama-w0-launcher") == 2, ROLLOUT_TIMEOUT, "world 0 replaced"
        )
    first_stop = status(cluster).get("rollout")
    assert (await fleet.for_pod("llama-w1-launcher").get("/admin/state")).json()["admission"] == "running"

    # World 1 gets requests that keep its drain busy for a while.
    world1 = fleet.for_pod("llama-w1-launcher")
    async with httpx.AsyncClient() as client:
        busy = [
            asyncio.ensure_future(
                client.post(
                    f"{world1.url}/v1/completions",
                    json={"model": str(fleet.model), "prompt": "hi", "max_tokens": 300, "ignore_eos": True},
                    timeout=120,
                )
            )
            for _ in range(8)
        ]

        async def all_admitted() -> bool:
            return (await world1.get("/admin/state")).json()["num_in_flight"] == 8

        await wait_for(all_admitted, 30, "the 8 requests admitted on world 1")
        async with running_operator(cluster, fleet.resolve):
            # Point 2: world 1 is draining; the operator goes, the engine parks without it.
            await wait_for(
                lambda: any(
                    entry["world"] == 1 and entry["step"] == "draining"
                    for entry in (status(cluster).get("rollout") or {}).get("inFlight") or []
                ),
                ROLLOUT_TIMEOUT,
                "world 1 draining",
            )
        answers = await asyncio.wait_for(asyncio.gather(*busy), 120)

    async def parked() -> bool:
        return (await world1.get("/admin/state")).json()["admission"] == "parked"

    # The drain ends with the requests; the engine parks on its own, no operator running.
    await wait_for(parked, 30, "world 1 parked while no operator runs")
    second_stop = status(cluster)["rollout"]

    async with running_operator(cluster, fleet.resolve):
        try:
            await wait_for(
                lambda: rollout_complete(cluster), ROLLOUT_TIMEOUT, "the rollout complete after restarts"
            )
        except AssertionError as error:
            raise AssertionError(f"{error}; status: {status(cluster)}; started: {fleet.started}") from None
        await wait_for(lambda: argocd_health(llmd(cluster))["status"] == "Healthy", 30, "Healthy")

    assert [entry["world"] for entry in first_stop["inFlight"]] == [0] and first_stop["done"] == []
    assert second_stop["done"] == [0]
    assert all(answer.status_code == 200 for answer in answers)  # drained, not aborted
    # Each world replaced exactly once; none left parked.
    assert sorted(fleet.started) == sorted([*LAUNCHERS, *LAUNCHERS])
    assert on_current_spec(cluster)
    assert [world["admission"] for world in status(cluster)["worlds"]] == ["running", "running"]
    assert sorted(events(cluster, "WorldReplaced")) == [
        "world 0 replaced: its launcher pod spec changed",
        "world 1 replaced: its launcher pod spec changed",
    ]


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_a_rolling_change_while_the_worlds_sleep_replaces_each_in_turn_and_they_sleep_again(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    # Every world asleep on purpose is not "out of service": a rollout that counted them so
    # would wait, forever, for one to come back before taking the first.
    async with running_operator(cluster, fleet.resolve):
        await two_ready_worlds(cluster, tmp_path, fleet.model)
        await patch_spec(cluster, {"sleep": {"sleeping": True, "level": 1}})

        def phases() -> list[str]:
            return [str(world.get("phase")) for world in status(cluster).get("worlds") or []]

        await wait_for(lambda: phases() == ["Sleeping", "Sleeping"], ROLLOUT_TIMEOUT, "both worlds asleep")
        seen: list[list[str]] = []
        async with sampling(lambda: seen.append(phases()), 0.02):
            await patch_spec(cluster, {"env": [{"name": "BERTH_ROLLOUT_TEST", "value": "asleep"}]})

            def asleep_on_the_new_spec() -> bool:
                rollout = status(cluster).get("rollout") or {}
                return bool(
                    rollout.get("complete")
                    and rollout.get("done") == [0, 1]
                    and phases() == ["Sleeping", "Sleeping"]
                    and on_current_spec(cluster)
                )

            try:
                await wait_for(asleep_on_the_new_spec, ROLLOUT_TIMEOUT, "both worlds asleep on the new spec")
            except AssertionError as error:
                raise AssertionError(
                    f"{error}; status: {status(cluster)}; started: {fleet.started}"
                ) from None
        await wait_for(lambda: argocd_health(llmd(cluster))["status"] == "Suspended", 30, "Suspended")

    assert sorted(fleet.started) == sorted([*LAUNCHERS, *LAUNCHERS])  # each world replaced once
    # One world at a time: never both being replaced (neither asleep nor serving) at once; a
    # new world serves until the sleep intent, not the rollout, puts it back to sleep.
    away = [p for p in seen if len(p) == 2 and all(phase not in ("Sleeping", "Ready") for phase in p)]
    assert away == [], away
    assert any(phase[0] != "Sleeping" for phase in seen) and any(phase[1] != "Sleeping" for phase in seen)
    for index in (0, 1):
        assert (await fleet.for_pod(LAUNCHERS[index]).get("/admin/state")).json()["admission"] == "parked"


@pytest.mark.slow  # kopf against the emulator through several health rounds, drains or restarts
async def test_an_operator_restarted_after_a_rollout_stopped_keeps_it_stopped(
    cluster: Cluster, sim: ClusterSim, fleet: EngineFleet, tmp_path: Path
) -> None:
    # The rollout's stop lives only in status.rollout, written through the emulator that prunes
    # what the CRD does not declare: a restarted operator must find it there, not start over.
    other_shapes = tmp_path / "other-shapes"
    make_tiny_model(other_shapes, num_layers=3, seed=3)  # a checkpoint the engines refuse to swap in
    reasons = ("RolloutStarted", "RolloutWorld", "WeightSwapFailed", "RolloutFailed")
    async with running_operator(cluster, fleet.resolve):
        await two_ready_worlds(cluster, tmp_path, fleet.model, inPlaceWeightSwap=True)
        await patch_spec(cluster, {"model": {"path": str(other_shapes), "name": "llama"}})
        await wait_for(
            lambda: (status(cluster).get("rollout") or {}).get("failed"),
            ROLLOUT_TIMEOUT,
            "the rollout stopped",
        )
        await wait_for(
            lambda: [w.get("phase") for w in status(cluster)["worlds"]] == ["Ready", "Ready"],
            ROLLOUT_TIMEOUT,
            "world 0 serving its old weights again",
        )
    stopped = status(cluster)["rollout"]
    before = {reason: len(events(cluster, reason)) for reason in reasons}
    reconciled = REGISTRY.get_sample_value("berth_operator_reconciles_total", {"result": "success"}) or 0

    async with running_operator(cluster, fleet.resolve):
        await wait_for(
            lambda: (
                (REGISTRY.get_sample_value("berth_operator_reconciles_total", {"result": "success"}) or 0)
                > reconciled
            ),
            30,
            "the resumed operator's reconcile",
        )
        await asyncio.sleep(8)  # more than two health rounds (intervalSeconds 3) of the new operator

    assert stopped["failed"]["world"] == 0 and "refused the new model" in stopped["failed"]["message"]
    assert kstatus(llmd(cluster))[0] == "Failed"
    assert status(cluster)["rollout"] == stopped
    assert (
        {reason: len(events(cluster, reason)) for reason in reasons}
        == before
        == {
            "RolloutStarted": 1,
            "RolloutWorld": 1,
            "WeightSwapFailed": 1,
            "RolloutFailed": 1,
        }
    )
    for name in LAUNCHERS:  # neither world taken out of service again
        assert (await fleet.for_pod(name).get("/admin/state")).json()["admission"] == "running"
    assert sorted(fleet.started) == sorted(LAUNCHERS)
