"""deploy/: the Kubernetes manifests validate against the Kubernetes OpenAPI schemas
(``kubernetes-validate``, strict: unknown fields are errors), the config file they mount is a
valid cpd configuration, the worker command line they run parses, and the Grafana dashboard has
the structure Grafana imports and queries only metrics the router exports.

Grafana publishes no JSON Schema for dashboards on PyPI, so the dashboard is checked with
``jsonschema`` against the subset of the dashboard model written down here (:data:`DASHBOARD_SCHEMA`)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_kubernetes_schema(path):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (test extra)")
    docs = _docs(path)
    assert docs
    for doc in docs:
        kv.validate(doc, "1.37.0", strict=True)  # raises ValidationError / InvalidSchemaError


def test_manifest_set_covers_router_workers_redis_and_scraping():
    kinds = {(d["kind"], d["metadata"]["name"]) for p in MANIFESTS for d in _docs(p)}
    assert {("Deployment", "cpd-router"), ("Service", "cpd-router")} <= kinds
    assert {("StatefulSet", f"cpd-{r}") for r in ("pre-prefill", "prefill", "decode")} <= kinds
    assert ("StatefulSet", "redis-cluster") in kinds
    router = next(d for p in MANIFESTS for d in _docs(p) if d["kind"] == "Deployment")
    ann = router["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"


def test_mounted_config_and_worker_command_parse(tmp_path):
    from cpd.config import build_config
    from cpd.worker.main import parse_args
    cm = next(d for d in _docs(DEPLOY / "k8s" / "configmap.yaml") if d["kind"] == "ConfigMap")
    cfg_path = tmp_path / "cpd.toml"
    cfg_path.write_text(cm["data"]["cpd.toml"])
    cfg = build_config(cfg_path)
    assert cfg.kv.l3_url.startswith("redis+cluster://") and cfg.handoff.force_tcp
    assert cfg.auth.internal_secret_file and cfg.auth.api_key_files
    sts = next(d for d in _docs(DEPLOY / "k8s" / "workers.yaml") if d["kind"] == "StatefulSet")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    args = [a.replace("$(POD_NAME)", "cpd-prefill-0").replace("$(POD_IP)", "10.0.0.7") for a in c["args"]]
    args[args.index("--config") + 1] = str(cfg_path)
    me, wcfg = parse_args(args)
    assert me.router_url == "http://cpd-router:8000" and me.registration()["url"] == "http://10.0.0.7:9000"


DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["title", "uid", "panels", "schemaVersion", "templating", "time"],
    "properties": {
        "uid": {"type": "string", "minLength": 1, "maxLength": 40},
        "schemaVersion": {"type": "integer", "minimum": 30},
        "panels": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["id", "type", "title", "gridPos", "targets", "datasource"],
            "properties": {
                "id": {"type": "integer"},
                "gridPos": {"type": "object", "required": ["x", "y", "w", "h"],
                            "properties": {k: {"type": "integer", "minimum": 0} for k in "xywh"}},
                "targets": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["refId", "expr"],
                    "properties": {"expr": {"type": "string", "minLength": 1}}}}}}},
        "templating": {"type": "object", "required": ["list"]},
    },
}


def _exported_metric_names() -> set[str]:
    from cpd.router.metrics import RouterMetrics
    from cpd.router.workers import WorkerSet
    m = RouterMetrics()
    m.watch_supervisor("/nonexistent/supervisor.json")
    m.watch_workers(WorkerSet([]))  # cpd_workers{role}, exported at each scrape
    names = set()
    for line in m.render().decode().splitlines():
        if line.startswith("# TYPE "):
            names.add(re.sub(r"_total$", "", line.split()[2]))
    return names


def test_grafana_dashboard_schema_and_metrics():
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema not installed (test extra)")
    dash = json.loads((DEPLOY / "grafana" / "cpd-dashboard.json").read_text())
    jsonschema.validate(dash, DASHBOARD_SCHEMA)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    exported = _exported_metric_names()
    used = {re.sub(r"_(bucket|sum|count|total)$", "", n)
            for p in dash["panels"] for t in p["targets"] for n in re.findall(r"\bcpd_[a-z_]+", t["expr"])}
    assert used and used <= exported, f"dashboard queries metrics the router does not export: {used - exported}"
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("ttft", "queue time", "hit ratio", "kv bytes", "fallbacks", "role changes", "route decisions"):
        assert topic in titles


def test_grafana_panels_do_not_overlap():
    """Each panel owns its own cells of Grafana's 24-column grid (an overlapping panel is moved
    by Grafana on import and hides part of the layout)."""
    dash = json.loads((DEPLOY / "grafana" / "cpd-dashboard.json").read_text())
    taken: dict[tuple[int, int], int] = {}
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"panel {p['id']} is wider than the grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"panel {p['id']} overlaps panel {taken[(x, y)]}"
                taken[(x, y)] = p["id"]
