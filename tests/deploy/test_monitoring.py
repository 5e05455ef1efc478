"""deploy/monitoring/: the Grafana dashboard and the Prometheus alerting rules, checked against
what a real registry process exports at /metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import Any

import httpx
import jsonschema
import pytest
import yaml

from harness.server import ROOT, RegistryProcess
from tests.app.api.conftest import agent_body, launch

pytestmark = pytest.mark.deploy

MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULES = MONITORING / "alerts.yaml"
METRIC = re.compile(r"\b(?:registry|process|python_gc)_[a-z_]+\b")

_DATASOURCE = {
    "type": "object",
    "required": ["type", "uid"],
    "properties": {"type": {"const": "prometheus"}, "uid": {"const": "${datasource}"}},
}
# The fields Grafana needs to import a dashboard and draw its panels (dashboard JSON model).
DASHBOARD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "time", "templating"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "schemaVersion": {"type": "integer", "minimum": 30},
        "time": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
        },
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {
                "list": {
                    "type": "array",
                    "contains": {
                        "type": "object",
                        "required": ["name", "type", "query"],
                        "properties": {
                            "name": {"const": "datasource"},
                            "type": {"const": "datasource"},
                            "query": {"const": "prometheus"},
                        },
                    },
                }
            },
        },
        "panels": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["id", "type", "title", "gridPos", "datasource", "targets"],
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "type": {"enum": ["timeseries", "stat", "gauge", "bargauge", "table"]},
                    "title": {"type": "string", "minLength": 1},
                    "datasource": _DATASOURCE,
                    "gridPos": {
                        "type": "object",
                        "required": ["h", "w", "x", "y"],
                        "properties": {
                            "h": {"type": "integer", "minimum": 1},
                            "w": {"type": "integer", "minimum": 1, "maximum": 24},
                            "x": {"type": "integer", "minimum": 0, "maximum": 23},
                            "y": {"type": "integer", "minimum": 0},
                        },
                    },
                    "targets": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["refId", "expr"],
                            "properties": {
                                "refId": {"type": "string", "pattern": "^[A-Z]$"},
                                "expr": {"type": "string", "minLength": 1},
                                "datasource": _DATASOURCE,
                            },
                        },
                    },
                },
            },
        },
    },
}

RULES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["groups"],
    "properties": {
        "groups": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "rules"],
                "properties": {
                    "rules": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["alert", "expr", "for", "labels", "annotations"],
                            "properties": {
                                "labels": {
                                    "type": "object",
                                    "required": ["severity"],
                                    "properties": {
                                        "severity": {"enum": ["info", "warning", "critical"]}
                                    },
                                },
                                "annotations": {
                                    "type": "object",
                                    "required": ["summary", "description"],
                                },
                            },
                        },
                    }
                },
            },
        }
    },
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The sample names a real registry exports once it has seen some traffic."""
    d = tmp_path_factory.mktemp("monitoring")
    with (
        RegistryProcess(f"sqlite:///{d / 'r.db'}", log_path=d / "registry.log") as reg,
        httpx.Client(base_url=reg.url, timeout=30) as c,
    ):
        body = {"launch_id": launch(), "tp_size": 1, "role": "prefill"}
        eid = c.put("/tp-groups/mon/engine", json=body).json()["engine_id"]
        assert c.put("/tp-groups/mon/engine/agents/0", json=agent_body(eid, 0)).is_success
        assert c.put("/tp-groups/mon/engine/agents/0", json=agent_body("x", 0)).status_code == 409
        assert c.post(f"/engines/{eid}/handshake", json={"tp_size": 1, "rank": 0}).is_success
        text = c.get("/metrics").text
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _exprs_dashboard() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def _families(names: set[str]) -> set[str]:
    """Metric families from sample names (counters' _total/_created, histograms' parts)."""
    suffixes = ("_total", "_created", "_bucket", "_sum", "_count")
    return {next((n.removesuffix(s) for s in suffixes if n.endswith(s)), n) for n in names}


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    board = json.loads(DASHBOARD.read_text())
    jsonschema.validate(board, DASHBOARD_SCHEMA)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    for p in board["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]


def test_every_panel_queries_metrics_the_service_exports(exported: set[str]) -> None:
    used = set()
    for title, expr in _exprs_dashboard():
        names = set(METRIC.findall(expr))
        assert names, f"panel {title!r} queries no registry metric: {expr}"
        unknown = names - exported
        assert not unknown, f"panel {title!r} names {unknown}, not exported: {sorted(exported)}"
        used |= names
    missing = _families(exported) - _families(used)
    assert not missing, f"metrics exported but on no panel: {sorted(missing)}"


def test_the_alerting_rules_parse_and_name_exported_metrics(exported: set[str]) -> None:
    rules = yaml.safe_load(RULES.read_text())
    jsonschema.validate(rules, RULES_SCHEMA)
    for group in rules["groups"]:
        for rule in group["rules"]:
            names = set(METRIC.findall(rule["expr"]))
            assert names, rule["alert"]
            assert names <= exported, f"{rule['alert']}: {names - exported} not exported"
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is missing: scripts/system-deps.sh installs Debian's prometheus")
    done = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
