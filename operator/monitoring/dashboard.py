"""The Grafana dashboard (manifests/monitoring/grafana/berth.json), written as code: the panels
and their PromQL in one place, laid out on Grafana's 24-column grid.

Engine series come from launchers and attached frontends alike. Request series (counted by the
server that took the request) are summed over both; the engine's own state (queue, KV cache,
memory, admission) is reported identically by the launcher and its frontends, so it is read
with max/min per world, never summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Every engine query is filtered by the three template variables; operator series have no model.
OPERATOR = 'namespace=~"$namespace", deployment=~"$deployment"'
ENGINE = f'{OPERATOR}, model_name=~"$model"'
WORLD = "{{namespace}}/{{deployment}} w{{world}}"
DEPLOYMENT = "{{namespace}}/{{deployment}}"


@dataclass
class Panel:
    title: str
    description: str
    targets: list[tuple[str, str]]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    extra: dict[str, Any] = field(default_factory=dict)


BY_DEPLOYMENT = "namespace, deployment"
BY_WORLD = "namespace, deployment, world"


def rate(metric: str, by: str, selector: str = ENGINE, how: str = "rate") -> str:
    """Per-second rate (or `how="increase"`) of a counter, summed by `by`."""
    return f"sum by ({by}) ({how}({metric}{{{selector}}}[$__rate_interval]))"


def per_world(metric: str, how: str = "max", selector: str = ENGINE) -> str:
    """An engine gauge per world: launcher and frontends report the same value (never summed)."""
    return f"{how} by ({BY_WORLD}) ({metric}{{{selector}}})"


def quantiles(metric: str) -> list[tuple[str, str]]:
    buckets = rate(f"{metric}_bucket", f"{BY_DEPLOYMENT}, le")
    return [
        (f"histogram_quantile({q}, {buckets})", f"{DEPLOYMENT} p{round(q * 100)}") for q in (0.5, 0.95, 0.99)
    ]


def hit_rate() -> str:
    hits = f"max by ({BY_WORLD}) (rate(berth_prefix_cache_hits_total{{{ENGINE}}}[$__rate_interval]))"
    queries = (
        f"max by ({BY_WORLD}) (rate(berth_prefix_cache_queries_total{{{ENGINE}}}[$__rate_interval]) > 0)"
    )
    return f"{hits} / {queries}"


def mean_transition() -> str:
    by = f"{BY_WORLD}, transition"
    seconds = rate("berth_sleep_transition_duration_seconds_sum", by, how="increase")
    count = rate("berth_sleep_transition_duration_seconds_count", by, how="increase")
    return f"{seconds} / ({count} > 0)"


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Requests",
        [
            Panel(
                "Request rate",
                "Finished sequences per second, per world (launcher and frontends together).",
                [(rate("berth_request_success_total", BY_WORLD), WORLD)],
                unit="reqps",
            ),
            Panel(
                "Tokens per second",
                "Prompt tokens in and generated tokens out, of finished requests.",
                [
                    (rate("berth_prompt_tokens_total", BY_DEPLOYMENT), f"{DEPLOYMENT} in"),
                    (rate("berth_generation_tokens_total", BY_DEPLOYMENT), f"{DEPLOYMENT} out"),
                ],
            ),
            Panel(
                "Request errors",
                "Requests that failed alone on an internal error, by the stage they failed in.",
                [
                    (
                        rate("berth_request_errors_total", f"{BY_DEPLOYMENT}, stage"),
                        f"{DEPLOYMENT} {{{{stage}}}}",
                    )
                ],
                unit="reqps",
            ),
            Panel(
                "Time to first token",
                "From submission to the first token.",
                quantiles("berth_time_to_first_token_seconds"),
                unit="s",
            ),
            Panel(
                "Inter-token latency",
                "Between engine steps that gave a request tokens.",
                quantiles("berth_inter_token_latency_seconds"),
                unit="s",
            ),
            Panel(
                "End-to-end latency",
                "From submission to the last token.",
                quantiles("berth_e2e_request_latency_seconds"),
                unit="s",
            ),
        ],
    ),
    (
        "Engines",
        [
            Panel(
                "Running and waiting requests",
                "Requests in each world's batch, and waiting to be scheduled.",
                [
                    (per_world("berth_num_requests_running"), f"{WORLD} running"),
                    (per_world("berth_num_requests_waiting"), f"{WORLD} waiting"),
                ],
            ),
            Panel(
                "KV cache usage",
                "Fraction of each world's KV cache blocks in use.",
                [(per_world("berth_kv_cache_usage_perc"), WORLD)],
                unit="percentunit",
                extra={"max": 1},
            ),
            Panel(
                "Prefix cache hit rate",
                "Prompt tokens found in the prefix cache, of those looked up.",
                [(hit_rate(), WORLD)],
                unit="percentunit",
                extra={"max": 1},
            ),
            Panel(
                "Admission state",
                "running, parking (draining for sleep), parked (asleep), waking, failed, shutdown.",
                [
                    (
                        f"max by ({BY_WORLD}, state) (berth_engine_admission_state{{{ENGINE}}}) > 0",
                        f"{WORLD} {{{{state}}}}",
                    )
                ],
                kind="state-timeline",
            ),
            Panel(
                "Engine healthy",
                "1 while the engine lives; 0 once it is dead or stalled (the operator restarts the world).",
                [(per_world("berth_engine_healthy", "min"), WORLD)],
                extra={"min": 0, "max": 1},
            ),
            Panel(
                "Sleep and wakeup duration",
                "Mean time of the sleeps (drain included) and wakeups that ended in each interval.",
                [(mean_transition(), f"{WORLD} {{{{transition}}}}")],
                unit="s",
            ),
        ],
    ),
    (
        "Memory",
        [
            Panel(
                "Memory",
                "Weights and KV cache the engine holds, its resident memory, and the limit its KV pool "
                "was sized under.",
                [
                    (per_world("berth_weight_bytes"), f"{WORLD} weights"),
                    (per_world("berth_kv_cache_bytes"), f"{WORLD} KV cache"),
                    (per_world("berth_engine_resident_memory_bytes"), f"{WORLD} resident"),
                    (per_world("berth_memory_limit_bytes"), f"{WORLD} limit"),
                ],
                unit="bytes",
                width=24,
            ),
        ],
    ),
    (
        "Operator",
        [
            Panel(
                "World restarts",
                "Whole-world restarts by reason.",
                [
                    (
                        rate(
                            "berth_operator_world_restarts_total",
                            f"{BY_DEPLOYMENT}, reason",
                            OPERATOR,
                            "increase",
                        ),
                        f"{DEPLOYMENT} {{{{reason}}}}",
                    )
                ],
            ),
            Panel(
                "Restarts left",
                "Restarts each world may still have in its window (0: the next death fails it).",
                [(per_world("berth_operator_world_restart_budget_remaining", "min", OPERATOR), WORLD)],
            ),
            Panel(
                "Rollout progress",
                "Worlds of the current rollout: done, in flight, waiting.",
                [
                    (
                        f"sum by ({BY_DEPLOYMENT}, state) (berth_operator_rollout_worlds{{{OPERATOR}}})",
                        f"{DEPLOYMENT} {{{{state}}}}",
                    )
                ],
            ),
            Panel(
                "Sleeps and wakeups",
                "Transitions the operator asked engines for, by result (done, conflict, refused, dead, "
                "unreachable, failed).",
                [
                    (
                        rate(
                            "berth_operator_engine_transitions_total",
                            f"{BY_DEPLOYMENT}, transition, result",
                            OPERATOR,
                            "increase",
                        ),
                        f"{DEPLOYMENT} {{{{transition}}}} {{{{result}}}}",
                    )
                ],
                width=12,
            ),
            Panel(
                "Worlds by phase",
                "Every LLMDeployment's worlds (the operator's count, all namespaces).",
                [("sum by (phase) (berth_operator_worlds)", "{{phase}}")],
                width=12,
            ),
        ],
    ),
]


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": f"berth-{name}"},
        "refresh": 2,  # on time range change
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, **panel.extra}
    if panel.kind == "timeseries":
        defaults["custom"] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"datasource": DATASOURCE, "refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append(
            {"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False, "panels": [],
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
        )  # fmt: skip
        y += 1
        x = 0
        for panel in row:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(panel_json(panel, len(panels) + 1, x, y))
            x += panel.width
        y += 8
    return {
        "uid": "berth",
        "title": "berth: LLM deployments",
        "description": "berth's engines and operator, per deployment and world (manifests/monitoring/).",
        "tags": ["berth", "llm", "inference"],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                variable("namespace", "Namespace", "label_values(berth_engine_healthy, namespace)"),
                variable(
                    "deployment",
                    "Deployment",
                    'label_values(berth_engine_healthy{namespace=~"$namespace"}, deployment)',
                ),
                variable("model", "Model", f"label_values(berth_engine_healthy{{{OPERATOR}}}, model_name)"),
            ]
        },
        "panels": panels,
    }


def queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel."""
    return [
        (panel["title"], target["expr"]) for panel in board["panels"] for target in panel.get("targets", [])
    ]


def expand(expr: str, rate_interval: str = "1m", **variables: str) -> str:
    """A dashboard query as Grafana sends it: variables replaced (`.*` for All)."""
    for name in ("namespace", "deployment", "model"):
        expr = expr.replace(f"${name}", variables.get(name, ".*"))
    return expr.replace("$__rate_interval", rate_interval)
