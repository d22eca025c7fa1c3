"""manifests/monitoring/ on its own: the alert rules pass promtool's checks and their unit
tests, every alert is tested and points at a runbook that exists, the generated files are
current, the kustomize component builds beside the install, the dashboard JSON is well formed,
and the scrape config is valid Prometheus configuration. (That the queries return data from a
live berth: test_monitoring_prometheus.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import yaml

from berth.operator.monitoring import discovery, generate
from berth.operator.monitoring.dashboard import queries

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "manifests" / "monitoring"
RULES = MONITORING / "rules" / "berth.rules.yaml"
RULE_TESTS = MONITORING / "rules" / "berth.rules.test.yaml"
DASHBOARD = json.loads((MONITORING / "grafana" / "berth.json").read_text())


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def promtool(*args: str, cwd: Path = MONITORING, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60, input=stdin
    )


def test_the_rules_pass_promtool_check_and_their_unit_tests() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in checked.stdout
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    checks = [check for case in cases for check in case.get("alert_rule_test", [])]
    for alert in alerts():
        mine = [check for check in checks if check["alertname"] == alert["alert"]]
        assert any(check["exp_alerts"] for check in mine), f"{alert['alert']} is never expected to fire"
        assert any(not check["exp_alerts"] for check in mine), (
            f"{alert['alert']} is never expected to stay quiet"
        )


def github_anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_says_what_where_and_links_a_runbook_section_that_exists() -> None:
    readme = (REPO / "operator" / "README.md").read_text()
    anchors = {github_anchor(line.lstrip("#")) for line in readme.splitlines() if line.startswith("#")}
    for alert in alerts():
        annotations = alert["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, alert["alert"]
        assert (
            "$labels.deployment" in annotations["description"] or alert["alert"] == "BerthOperatorNotLeading"
        )
        url = annotations["runbook_url"]
        assert url.startswith("https://github.com/berth-project/berth/blob/main/operator/README.md#"), url
        assert url.rpartition("#")[2] in anchors, f"{alert['alert']}: no section for {url}"
        assert alert["labels"]["severity"] in ("critical", "warning")
    # Alerts about one world (their firing series carry `world`, as their unit tests show) name it.
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    per_world = {
        check["alertname"]
        for case in cases
        for check in case.get("alert_rule_test", [])
        for expected in check["exp_alerts"]
        if "world" in expected["exp_labels"]
    }
    assert per_world
    for alert in alerts():
        if alert["alert"] in per_world:
            assert "$labels.world" in alert["annotations"]["description"], alert["alert"]


def test_the_generated_files_are_current() -> None:
    assert generate.main(["--check"]) == 0, "run `python -m berth.operator.monitoring.generate`"
    rule = yaml.safe_load(generate.PROMETHEUS_RULE.read_text())
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_the_component_builds_beside_the_install(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    # kustomize takes relative paths only.
    relative = os.path.relpath(REPO / "manifests", overlay)
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [relative], "components": [f"{relative}/monitoring"]})
    )
    built = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(built.stdout)}
    assert ("Deployment", "berth-operator") in objects  # the install is there too
    monitors = {name: o for (kind, name), o in objects.items() if kind == "PodMonitor"}
    assert sorted(monitors) == ["berth-frontends", "berth-launchers", "berth-operator", "berth-routers"]
    assert monitors["berth-launchers"]["spec"]["selector"]["matchLabels"]["berth.dev/role"] == "launcher"
    assert monitors["berth-frontends"]["spec"]["selector"]["matchLabels"]["berth.dev/role"] == "frontend"
    assert monitors["berth-routers"]["spec"]["selector"]["matchLabels"]["berth.dev/role"] == "router"
    assert monitors["berth-operator"]["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    operator_pod = objects[("Deployment", "berth-operator")]["spec"]["template"]
    assert (
        monitors["berth-operator"]["spec"]["selector"]["matchLabels"].items()
        <= operator_pod["metadata"]["labels"].items()
    )
    assert "metrics" in {p["name"] for p in operator_pod["spec"]["containers"][0]["ports"]}
    rule = objects[("PrometheusRule", "berth")]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    dashboard = objects[("ConfigMap", "berth-grafana-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["berth.json"]) == DASHBOARD


def test_the_pod_monitors_relabel_as_the_scrape_config_does() -> None:
    """The two ways to scrape berth give its series the same labels."""
    monitors = list(yaml.safe_load_all((MONITORING / "podmonitors.yaml").read_text()))
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    engines = next(job for job in config["scrape_configs"] if job["job_name"] == "berth-engines")
    shipped = {
        (tuple(r["source_labels"]), r["target_label"])
        for r in engines["relabel_configs"]
        if "target_label" in r
    }
    for monitor in monitors[:3]:  # launchers, frontends, routers
        endpoint = monitor["spec"]["podMetricsEndpoints"][0]
        assert endpoint["port"] == "http"
        relabels = {(tuple(r["sourceLabels"]), r["targetLabel"]) for r in endpoint["relabelings"]}
        assert relabels <= shipped
        assert {target for _, target in relabels} == {"deployment", "world", "role"}
    # namespace and pod: the Prometheus Operator adds them; the plain config must do it itself.
    assert {target for _, target in shipped} == {"namespace", "pod", "deployment", "world", "role"}


def test_the_scrape_config_is_valid_prometheus_configuration(tmp_path: Path) -> None:
    # Debian's prometheus is built without Kubernetes discovery: promtool checks the same
    # config with file discovery in its place (the relabelling, the jobs, the rule files).
    config = discovery.scrape_config(tmp_path)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    checked = promtool("check", "config", str(tmp_path / "prometheus.yml"), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout and "rules found" in checked.stdout


def test_the_dashboard_is_well_formed() -> None:
    panels = DASHBOARD["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for name in ("namespace", "deployment", "model"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"], name
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    occupied: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    for title, expr in queries(DASHBOARD):
        if "berth_operator_worlds" in expr:
            continue  # the operator's count over every namespace
        assert "$namespace" in expr and "$deployment" in expr, title
        if "berth_operator_" not in expr:
            assert "$model" in expr, title
    wanted = {
        "Request rate", "Time to first token", "Inter-token latency", "End-to-end latency",
        "Tokens per second", "Running and waiting requests", "KV cache usage", "Prefix cache hit rate",
        "Admission state", "Sleep and wakeup duration", "Memory", "World restarts", "Rollout progress",
    }  # fmt: skip
    assert wanted <= {panel["title"] for panel in panels}
