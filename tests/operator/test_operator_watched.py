"""A loop trusts the watches' view of its pods only once it shows the loop's own writes
(operator/watched.py): until then its rounds list from the API server. A resync reads from the
watches' view too, and a prune from a stale view deletes only what it judged."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from berth.operator import reconcile, render
from berth.operator.crd_model import parse_spec
from berth.operator.kube import Kube
from berth.operator.watched import EXPECTATION_TTL, Expectations, Seen
from tests.support.cluster import Cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "llmdeployment.yaml"
LLMD_PATH = "/apis/berth.dev/v1alpha1/namespaces/default/llmdeployments"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pod(name: str, uid: str, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": uid}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-05T12:00:00Z"
    return {"metadata": meta}


def test_a_deleted_pod_is_expected_gone_or_terminating_before_the_view_is_trusted() -> None:
    expected = Expectations()
    assert expected.met_by([pod("w-0", "a")])
    expected.deleted("a")
    assert not expected.met_by([pod("w-0", "a")])  # the watch has not delivered the deletion yet
    assert expected.met_by([pod("w-0", "a", terminating=True)])
    expected.deleted("b")
    assert expected.met_by([pod("w-0", "c")])  # gone; its successor under the same name is new


def test_a_created_pod_is_expected_present_and_not_the_one_it_replaces() -> None:
    expected = Expectations()
    expected.deleted("old")
    expected.created("launcher")
    assert not expected.met_by([pod("launcher", "old")])  # the stale one still shows
    assert not expected.met_by([])  # the old one gone, the new one not yet there
    assert expected.met_by([pod("launcher", "new")])
    assert expected.met_by([])  # met once: forgotten, not expected again


def test_a_write_the_watches_never_show_stops_counting_after_its_ttl() -> None:
    clock = Clock()
    expected = Expectations(clock)
    expected.created("launcher")  # e.g. deleted by someone else before the watch saw it
    assert not expected.met_by([])
    clock.now += EXPECTATION_TTL + 1
    assert expected.met_by([])


def test_a_view_answers_for_the_kinds_it_covers_only() -> None:
    view = Seen({"ConfigMap": [{"metadata": {"name": "a", "uid": "1", "labels": {"role": "x"}}}]})
    assert view.covers("ConfigMap") and not view.covers("Secret")
    assert view.named("ConfigMap", "a")["metadata"]["uid"] == "1"
    assert view.named("ConfigMap", "b") is None and view.named("Secret", "a") is None
    assert [obj["metadata"]["name"] for obj in view.labelled("ConfigMap", {"role": "x"})] == ["a"]
    assert view.labelled("ConfigMap", {"role": "y"}) == []


async def test_a_prune_from_a_stale_view_deletes_only_the_object_it_judged(cluster: Cluster) -> None:
    """The watches still show our hostfile of a world scaled away; meanwhile it went and someone
    made their own ConfigMap of that name. The prune deletes by uid: theirs stays."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["replicas"] = 1
    created = await cluster.api("POST", LLMD_PATH, doc)
    owner = render.Owner(name="llama", namespace="default", uid=created["metadata"]["uid"])
    spec = parse_spec(doc["spec"], "llama")
    ours = render.hostfile(owner, spec.model_copy(update={"replicas": 2}), 1)  # world 1: beyond replicas
    stale = await cluster.api("POST", "/api/v1/namespaces/default/configmaps", ours)
    await cluster.api("DELETE", f"/api/v1/namespaces/default/configmaps/{ours['metadata']['name']}")
    theirs = copy.deepcopy(ours)
    del theirs["metadata"]["ownerReferences"]
    await cluster.api("POST", "/api/v1/namespaces/default/configmaps", theirs)
    kube = await Kube.connect(str(cluster.kubeconfig))
    try:
        outcome = reconcile.Outcome()
        await reconcile.prune(kube, owner, spec, outcome, seen=Seen({"ConfigMap": [stale]}))
    finally:
        await kube.close()
    assert outcome.deleted == [] and outcome.refused == []
    left = cluster.get("v1/configmaps", ours["metadata"]["name"])
    assert left is not None and "ownerReferences" not in left["metadata"]
