"""The chart's Grafana dashboard and PrometheusRule (metrics.grafanaDashboard, metrics.prometheusRule).

Both are off by default and render behind their toggles. The dashboard is valid JSON in a
ConfigMap the Grafana sidecar picks up; the PrometheusRule validates against the CRD's schema
(tests/data/prometheus-operator/). Every PromQL query in either names only metrics a real store
exports: the names are collected from a store built with host, SSD and object tiers plus the
flusher (``build_store``), expanded by prometheus_client's sample suffixes, so a renamed metric
fails here instead of leaving a silent empty panel or an alert that can never fire.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_helm_chart import CHART, _crd_json_schema, _find_helm, _run

from dynamo_tiered_kv.blocks.keys import Namespace
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store

ROOT = Path(__file__).resolve().parent.parent
RULE_CRD = ROOT / "tests" / "data" / "prometheus-operator" / "monitoring.coreos.com_prometheusrules.v1.yaml"
DASHBOARD = CHART / "dashboards" / "dtkv.json"
BASE_VALUES = CHART / "ci" / "deployment-emptydir-values.yaml"
ON = ["--set", "metrics.grafanaDashboard.enabled=true", "--set", "metrics.prometheusRule.enabled=true"]
pytestmark = pytest.mark.timeout(300)

# ------------------------------------------------------------------------------- exported names

# sample names prometheus_client exposes for a family of each type
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",),
             "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount"), "unknown": ("",)}


def sample_names(families: Any) -> set[str]:
    return {f.name + sfx for f in families for sfx in _SUFFIXES[f.type]}


@cache
def exported_metrics(tmp: str) -> frozenset[str]:
    """Every sample name a store with all tiers and the flusher serves on /metrics."""
    cfg = TieredKVConfig.from_mapping({
        "host_capacity_bytes": 8 << 20, "ssd_dir": f"{tmp}/ssd", "ssd_capacity_bytes": 64 << 20,
        "ssd_segment_bytes": 1 << 20, "object_url": f"file://{tmp}/objects", "object_refresh_s": None,
        "staging_slab_bytes": 1 << 20, "staging_slabs": 2})
    store = build_store(cfg, Namespace("tiny", "bfloat16", "KV_SPLIT", 16, 2, 2, 64))
    try:
        return frozenset(sample_names(store.metrics.registry.collect()))
    finally:
        store.close()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> frozenset[str]:
    return exported_metrics(str(tmp_path_factory.mktemp("store")))


# ------------------------------------------------------------------------------- PromQL

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def promql_metrics(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (no full parser: what remains once strings,
    label matchers, ranges, grouping clauses and function calls are removed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals (label values, regexes)
    s = re.sub(r"\{[^{}]*\}", " ", s)                     # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                     # range / subquery windows
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)  # label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        rest = s[m.end():].lstrip()
        if rest.startswith("("):
            continue  # a function or aggregation
        if m.group(0).lower() in _KEYWORDS or (m.start() and s[m.start() - 1].isdigit()):
            continue  # keyword, or the exponent of 1e-9
        names.add(m.group(0))
    return names


def test_promql_metrics_finds_selected_metrics_only() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, tier) (rate(foo_seconds_bucket{stage="read", pod=~"$pod"}'
            '[$__rate_interval]))) / clamp_min(bar_total offset 5m, 1e-9) > on (pod) group_left baz')
    assert promql_metrics(expr) == {"foo_seconds_bucket", "bar_total", "baz"}


def test_exported_names_carry_client_suffixes(exported: frozenset[str]) -> None:
    assert {"dtkv_tier_hits_total", "dtkv_restore_stage_seconds_bucket", "dtkv_flush_lag_seconds",
            "dtkv_flush_failures_total", "dtkv_ssd_degraded_total", "dtkv_tier_used_bytes"} <= exported
    assert "dtkv_tier_hits" not in exported  # a counter is only served with its suffix


def unknown_metrics(exprs: list[str], exported: frozenset[str]) -> dict[str, set[str]]:
    return {e: bad for e in exprs if (bad := promql_metrics(e) - exported)}


def test_unknown_metric_is_reported(exported: frozenset[str]) -> None:
    assert unknown_metrics(["rate(dtkv_tier_hits_total[5m])", "dtkv_tier_hit_ratio > 0"], exported) == {
        "dtkv_tier_hit_ratio > 0": {"dtkv_tier_hit_ratio"}}


# ------------------------------------------------------------------------------- dashboard


def dashboard_queries(dash: dict[str, Any]) -> list[str]:
    def panels(ps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [q for p in ps for q in [p, *panels(p.get("panels", []))]]

    exprs = [t["expr"] for p in panels(dash["panels"]) for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if var.get("type") == "query" and (m := re.fullmatch(r"label_values\((.+),\s*\w+\)", q or "")):
            exprs.append(m.group(1))
    return exprs


def test_dashboard_queries_name_exported_metrics(exported: frozenset[str]) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = dashboard_queries(dash)
    assert len(exprs) >= 10
    assert unknown_metrics(exprs, exported) == {}
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("hit ratio", "restore latency", "restore bandwidth", "flush lag", "checksum", "dropped",
                  "capacity"):
        assert topic in titles, topic
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


# ------------------------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def helm_bin() -> str:
    path, why = _find_helm()
    if path is None:
        pytest.skip(why)
    return path


@cache
def render(helm: str, *args: str) -> tuple[dict[str, Any], ...]:
    out = _run(helm, "template", "t", CHART, "--namespace", "kv", "-f", BASE_VALUES, *args)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def test_off_by_default(helm_bin: str) -> None:
    kinds = [(d["kind"], d["metadata"]["name"]) for d in render(helm_bin)]
    assert ("PrometheusRule", "t-dynamo-tiered-kv") not in kinds
    assert ("ConfigMap", "t-dynamo-tiered-kv-dashboard") not in kinds


def test_lint_strict_with_both_on(helm_bin: str) -> None:
    out = _run(helm_bin, "lint", "--strict", CHART, "-f", BASE_VALUES, *ON)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_configmap_for_grafana_sidecar(helm_bin: str) -> None:
    docs = render(helm_bin, *ON, "--set", "metrics.grafanaDashboard.namespace=monitoring")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert json.loads(cm["data"]["dtkv.json"]) == json.loads(DASHBOARD.read_text())
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate to check manifests")
    kv.validate(cm, "1.33", strict=True)


@cache
def _rule_validator() -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load(RULE_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _crd_json_schema(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def rule_errors(rule: dict[str, Any]) -> list[str]:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in _rule_validator().iter_errors(rule)]
    for g in rule.get("spec", {}).get("groups", []):
        for r in g.get("rules", []):
            if ("alert" in r) == ("record" in r):
                errors.append(f"{g['name']}: a rule needs exactly one of alert/record: {r}")
            if "record" in r and "annotations" in r:
                errors.append(f"{r['record']}: annotations only on alerts")
    return errors


def _prometheus_rule(helm: str) -> dict[str, Any]:
    (rule,) = [d for d in render(helm, *ON) if d["kind"] == "PrometheusRule"]
    return rule


def test_prometheus_rule_validates(helm_bin: str) -> None:
    rule = _prometheus_rule(helm_bin)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule_errors(rule) == []
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts == {"DtkvFlushLagGrowing", "DtkvChecksumFailures", "DtkvTierDegraded", "DtkvObjectTierUnavailable"}


def test_prometheus_rule_schema_rejects_bad_rules(helm_bin: str) -> None:
    rule = _prometheus_rule(helm_bin)
    bad = json.loads(json.dumps(rule))
    first = bad["spec"]["groups"][0]["rules"][0]
    first["for"] = "ten minutes"        # not a duration
    first["severity"] = "page"          # not a rule field
    del bad["spec"]["groups"][0]["rules"][1]["expr"]
    bad["spec"]["groups"][0]["rules"][2]["record"] = "x"  # alert and record both
    errs = "\n".join(rule_errors(bad))
    for expected in ("rules/0/for: 'ten minutes' does not match", "'severity' was unexpected",
                     "rules/1: 'expr' is a required property", "exactly one of alert/record",
                     "x: annotations only on alerts"):
        assert expected in errs, errs


def test_prometheus_rule_queries_name_exported_metrics(helm_bin: str, exported: frozenset[str]) -> None:
    rule = _prometheus_rule(helm_bin)
    exprs = [str(r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]]
    assert unknown_metrics(exprs, exported) == {}
    assert all(promql_metrics(e) for e in exprs)  # every alert watches at least one metric
