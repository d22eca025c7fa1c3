"""Writes the files of manifests/monitoring/ that are derived from others, or checks they are
current (`--check`, as the tests do):

    python -m berth.operator.monitoring.generate [--check]

- grafana/berth.json, from operator/monitoring/dashboard.py;
- prometheusrule.yaml, the PrometheusRule of rules/berth.rules.yaml (one source for the alerts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from berth.operator.monitoring.dashboard import dashboard

MONITORING = Path(__file__).resolve().parents[2] / "manifests" / "monitoring"
RULES = MONITORING / "rules" / "berth.rules.yaml"
DASHBOARD = MONITORING / "grafana" / "berth.json"
PROMETHEUS_RULE = MONITORING / "prometheusrule.yaml"

HEADER = (
    "# Generated from rules/berth.rules.yaml by `python -m berth.operator.monitoring.generate`:\n"
    "# edit that file.\n"
    "# The Prometheus Operator's Prometheus must select it (its ruleSelector; many select `release`).\n"
)


def dashboard_text() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def prometheus_rule_text() -> str:
    rules = yaml.safe_load(RULES.read_text())
    resource = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "berth",
            "namespace": "berth-system",
            "labels": {"app.kubernetes.io/part-of": "berth"},
        },
        "spec": {"groups": rules["groups"]},
    }
    return HEADER + yaml.safe_dump(resource, sort_keys=False, width=10_000)


def outputs() -> dict[Path, str]:
    return {DASHBOARD: dashboard_text(), PROMETHEUS_RULE: prometheus_rule_text()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is not current")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{path} is not current: run `python -m berth.operator.monitoring.generate`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
