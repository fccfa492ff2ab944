"""The chart's tenant settings and encryption keys (tieredKV.tenant_*, tieredKV.encryption*,
encryption.kekSecret) and the dashboard's Tenants row.

Tenant quotas reach the workers' settings with their meaning intact (a share of 1 stays a share,
not one byte; sizes and byte counts stay sizes), the KEK Secret is mounted read-only into every
kind of worker pod where encryption_keys points, never into the GC job, and encryption "on"
without a Secret fails to render. helm comes from the ``helm`` fixture (tests/helm_tool.py); the
tests skip with the reason when none can be had.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_helm_chart import CHART, _pod_config, _run, _worker_pods
from test_helm_observability import DASHBOARD, dashboard_queries, exported_metrics, promql_metrics

from dynamo_tiered_kv.blocks.tenant import parse_tenant
from dynamo_tiered_kv.errors import ConfigError
from dynamo_tiered_kv.factory import key_source, tenant_quotas

CI = CHART / "ci"
TENANTS_VALUES = CI / "tenants-encryption-values.yaml"
KEK_DIR = "/etc/dynamo-tiered-kv-keks"
pytestmark = pytest.mark.timeout(300)


def _render(helm: str, values: Path, *args: str) -> list[dict[str, Any]]:
    out = _run(helm, "template", "t", CHART, "--namespace", "kv", "-f", values, *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _config_files(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "t-dynamo-tiered-kv"]
    return {k: yaml.safe_load(v) or {} for k, v in cm["data"].items()}


def _worker_config(helm_docs, tmp_path, monkeypatch):
    _, container, _ = _worker_pods(helm_docs)[0]
    return _pod_config(helm_docs, container, tmp_path, monkeypatch, {})


# ------------------------------------------------------------------------------- tenant quotas


def test_tenant_settings_reach_the_worker_config(helm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ci values' quotas, as the worker's TieredKVConfig reads them and the host tier gets them."""
    docs = _render(helm, TENANTS_VALUES)
    cfg = _worker_config(docs, tmp_path, monkeypatch)
    assert cfg.tenant_default_share == 0.2
    assert cfg.tenant_quotas == {
        "acme-prod": {"host": 0.5, "ssd": "80Gi", "object": "2Ti"},
        "acme-dev": {"host": "2Gi", "ssd": 10737418240},
        "id:0123456789abcdef": {"host": 1.0, "ssd": 1.0},
        "default": {"host": 0.05},
    }
    # "1" in the values is a share (the whole tier), never one byte
    assert all(isinstance(v, float) for v in cfg.tenant_quotas["id:0123456789abcdef"].values())
    assert cfg.encryption == "on" and cfg.encryption_key_cache_s == 30
    cap = 24 << 30
    q = tenant_quotas(cfg, "host", cap)
    assert q is not None
    salt = cfg.tenant_salt.get_secret_value()
    assert q.limit(parse_tenant("acme-prod", deployment_salt=salt)) == cap // 2
    assert q.limit(parse_tenant("acme-dev", deployment_salt=salt)) == 2 << 30
    assert q.limit(parse_tenant("id:0123456789abcdef")) == cap
    assert q.limit(parse_tenant("default")) == int(cap * 0.05)
    assert q.limit(parse_tenant("someone-else", deployment_salt=salt)) == int(cap * 0.2)


@pytest.mark.parametrize("value,expected", [
    (1, 1.0), (0.25, 0.25), (1e-05, 1e-05), (0, 0), (2, 2), (1073741824, 1073741824), ("40Gi", "40Gi"),
    ("500G", "500G"), ("1.5GiB", "1.5GiB"), ("4096", "4096"),
], ids=lambda v: repr(v))
def test_quota_numbers_keep_their_meaning(helm: str, value: Any, expected: Any) -> None:
    """Helm reads every number as a float: up to 1 it is written as a share, 0 and above 1 as bytes."""
    quotas = json.dumps({"we\"ird <t&n>": {"ssd": value}})
    docs = _render(helm, CI / "deployment-emptydir-values.yaml", "--set-json", f"tieredKV.tenant_quotas={quotas}")
    for name, cfg in _config_files(docs).items():
        got = cfg["tenant_quotas"]['we"ird <t&n>']["ssd"]
        assert got == expected and type(got) is type(expected), (name, got)


def test_no_quotas_render_nothing(helm: str) -> None:
    for name, cfg in _config_files(_render(helm, CI / "deployment-emptydir-values.yaml")).items():
        assert not {"tenant_quotas", "encryption", "encryption_keys"} & set(cfg), name


# ------------------------------------------------------------------------------- KEK Secret

ENCRYPTED = ["--set", "tieredKV.encryption=on", "--set", "encryption.kekSecret=kv-keks"]


@pytest.mark.parametrize("values,extra", [
    ("tenants-encryption", []),
    ("statefulset-vct", ENCRYPTED),
    ("dgd", ENCRYPTED),
    ("dgd-v1alpha1", ENCRYPTED),
    ("dgd-disagg", ENCRYPTED),
])
def test_kek_secret_is_mounted_read_only_where_encryption_keys_points(
        helm: str, values: str, extra: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = _render(helm, CI / f"{values}-values.yaml", *extra)
    secret = yaml.safe_load((CI / f"{values}-values.yaml").read_text()).get("encryption", {}).get(
        "kekSecret", "kv-keks")
    pods = _worker_pods(docs)
    assert pods
    for spec, container, _ in pods:
        (vol,) = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == secret]
        assert vol["secret"]["defaultMode"] == 0o440
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == vol["name"]]
        assert mount == {"name": vol["name"], "mountPath": KEK_DIR, "readOnly": True}
        assert "subPath" not in mount  # a subPath mount would never see the Secret change
    cfg = _worker_config(docs, tmp_path, monkeypatch)
    assert cfg.encryption == "on" and cfg.encryption_keys == f"dir://{KEK_DIR}"
    # the URL names the mounted directory: the store reads the KEKs from there (absent here)
    with pytest.raises(ConfigError, match=f"dir:{KEK_DIR}"):
        key_source(cfg)


def test_gc_job_gets_no_keys(helm: str) -> None:
    """dtkv gc reads manifests, never records: neither the Secret nor a path to it."""
    docs = _render(helm, TENANTS_VALUES)
    (job,) = [d for d in docs if d["kind"] == "CronJob"]
    pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if "secret" in v]
    assert "encryption_keys" not in _config_files(docs)["gc.yaml"]


@pytest.mark.parametrize("args", [
    ["--set", "tieredKV.encryption=on"],
    ["--set", "connector.extraConfig.encryption=on"],
], ids=["tieredKV", "extraConfig"])
def test_encryption_on_without_kek_secret_fails(helm: str, args: list[str]) -> None:
    out = _run(helm, "template", "t", CHART, "-f", CI / "deployment-emptydir-values.yaml", *args)
    assert out.returncode != 0, "rendered encryption on without keys"
    assert "needs encryption.kekSecret" in out.stderr, out.stderr


BAD_TENANT_VALUES = {
    "share above 1 with a fraction": (["--set-json", 'tieredKV.tenant_quotas={"a": {"host": 2.5}}'],
                                      "/tieredKV/tenant_quotas/a/host"),
    "negative bytes": (["--set-json", 'tieredKV.tenant_quotas={"a": {"ssd": -1}}'], "/tieredKV/tenant_quotas/a/ssd"),
    "unknown tier": (["--set-json", 'tieredKV.tenant_quotas={"a": {"gpu": 1}}'], "gpu"),
    "not a size": (["--set-json", 'tieredKV.tenant_quotas={"a": {"host": "lots"}}'], "/tieredKV/tenant_quotas/a/host"),
    "share as a string": (["--set", "tieredKV.tenant_quotas.a.host=0.5"], "/tieredKV/tenant_quotas/a/host"),
    "empty tenant": (["--set-json", 'tieredKV.tenant_quotas={"": {"host": 1}}'], "tenant_quotas"),
    "default share 0": (["--set-json", "tieredKV.tenant_default_share=0"], "tenant_default_share"),
    "encryption yes": (["--set", "tieredKV.encryption=yes"], "/tieredKV/encryption"),
    "bare YAML on": (["--set-json", "tieredKV.encryption=true"], "/tieredKV/encryption"),
    "negative key cache": (["--set-json", "tieredKV.encryption_key_cache_s=-1"], "encryption_key_cache_s"),
    "encryption_keys is the chart's": (["--set", "tieredKV.encryption_keys=env:KEYS"], "encryption_keys"),
    "bad Secret name": (["--set", "encryption.kekSecret=Not_A_Name"], "/encryption/kekSecret"),
}


@pytest.mark.parametrize("args,message", list(BAD_TENANT_VALUES.values()), ids=list(BAD_TENANT_VALUES))
def test_bad_tenant_values_fail_to_render(helm: str, args: list[str], message: str) -> None:
    out = _run(helm, "template", "t", CHART, "-f", CI / "deployment-emptydir-values.yaml", *args)
    assert out.returncode != 0, f"rendered despite {args}"
    assert message in out.stderr, out.stderr


# ------------------------------------------------------------------------------- dashboard


def test_dashboard_has_a_tenants_row(tmp_path: Path) -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    (row,) = [p for p in panels if p["type"] == "row" and p["title"] == "Tenants"]
    below = [p for p in panels if p["type"] != "row" and p["gridPos"]["y"] == row["gridPos"]["y"] + 1]
    by_metric: dict[str, dict[str, Any]] = {}
    for p in below:
        for t in p["targets"]:
            for name in promql_metrics(t["expr"]):
                by_metric.setdefault(name, p)
            assert 'tenant=~"$tenant"' in t["expr"]
    bytes_panel = by_metric["dtkv_tenant_bytes"]
    assert bytes_panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    quota_panel = by_metric["dtkv_tenant_quota_bytes"]
    assert quota_panel["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert "dtkv_tenant_bytes" in promql_metrics(quota_panel["targets"][0]["expr"])
    assert "dtkv_tenant_retained_bytes" in by_metric
    assert {"dtkv_tenant_bytes", "dtkv_tenant_quota_bytes", "dtkv_tenant_retained_bytes"} <= exported_metrics(
        str(tmp_path))
    assert "tenant" in {v["name"] for v in dash["templating"]["list"]}
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in below)
    assert "dtkv_tenant_bytes" in " ".join(dashboard_queries(dash))
