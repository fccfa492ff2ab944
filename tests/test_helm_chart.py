"""The Helm chart (deploy/helm/dynamo-tiered-kv) lints, renders every ci/*-values.yaml, and
cannot drift from the code: every DYN_TIERED_KV_* env var and every config key it renders is a
TieredKVConfig field, the exact env + config file + kv_connector_extra_config a worker pod gets
builds a valid TieredKVConfig, secrets stay out of the ConfigMap, and bad values fail to render.

helm comes from the ``helm`` fixture (conftest.py, tests/helm_tool.py: $HELM, PATH, or
deploy/scripts/install-helm.sh into $DTKV_TOOLS_DIR); the tests skip with the reason when none works.
kubernetes-validate (optional test dependency) checks the rendered objects against the
Kubernetes 1.33 OpenAPI schemas with --strict; a rendered nvidia.com/v1beta1 DynamoGraphDeployment
is validated with jsonschema against the v1beta1 schema of Dynamo's CRD (tests/data/dynamo/).
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import subprocess
import typing
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_tool import INSTALL_HELM, TOOLS, find_helm

from dynamo_tiered_kv.config.settings import ENV_CONFIG_FILE, ENV_PREFIX, TieredKVConfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "dynamo-tiered-kv"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CI_IDS = [p.name.removesuffix("-values.yaml") for p in CI_VALUES]
FIELDS = set(TieredKVConfig.model_fields)
SECRET_FIELDS = {"tenant_salt", "s3_access_key", "s3_secret_key"}
CHART_MANAGED = {"ssd_dir", "metrics_port", "encryption_keys"}  # from ssd.mountPath, metrics.port, encryption.kekSecret
BYTE_FIELDS = {f for f in FIELDS if f.endswith("_bytes")}
CONNECTOR = ("TieredKVConnector", "dynamo_tiered_kv.connectors.vllm")
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DynamoGraphDeployment"}
DGD_CRD = ROOT / "tests" / "data" / "dynamo" / "nvidia.com_dynamographdeployments.v1beta1.yaml"
WORKER_TYPES = ("worker", "prefill", "decode")  # v1beta1 component types that run dynamo.vllm
pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------- helm access


_find_helm = find_helm  # other chart tests import it from here


def _run(helm: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    home = TOOLS / "helm-home"  # keep helm's cache/config/data out of $HOME
    env = {**os.environ, "HELM_CACHE_HOME": f"{home}/cache", "HELM_CONFIG_HOME": f"{home}/config",
           "HELM_DATA_HOME": f"{home}/data"}
    return subprocess.run([helm, *map(str, args)], capture_output=True, text=True, timeout=60, env=env)


@cache
def _render_cached(helm: str, values: Path) -> tuple[dict[str, Any], ...]:
    out = _run(helm, "template", "t", CHART, "--namespace", "kv", "-f", values)
    assert out.returncode == 0, f"helm template -f {values.name} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


@pytest.fixture(params=CI_VALUES, ids=CI_IDS)
def case(request: pytest.FixtureRequest, helm: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the ci values, the rendered objects) for one ci/*-values.yaml."""
    values = yaml.safe_load(request.param.read_text())
    return values, list(_render_cached(helm, request.param))


# ------------------------------------------------------------------------------- object access


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _kinds(docs: list[dict[str, Any]]) -> set[str]:
    return {d["kind"] for d in docs}


def _workload(docs: list[dict[str, Any]]) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] in WORKLOAD_KINDS]
    assert len(found) == 1, f"expected one worker workload, got {[d['kind'] for d in found]}"
    return found[0]


def _worker_service(dgd: dict[str, Any]) -> dict[str, Any]:
    """The worker service of a v1alpha1 DGD."""
    workers = [s for s in dgd["spec"]["services"].values() if s["componentType"] == "worker"]
    assert len(workers) == 1
    return workers[0]


def _worker_components(dgd: dict[str, Any]) -> list[dict[str, Any]]:
    """The dynamo.vllm components of a v1beta1 DGD (one aggregated worker, or decode + prefill)."""
    workers = [c for c in dgd["spec"]["components"] if c.get("type") in WORKER_TYPES]
    assert workers, "no worker component"
    return workers


def _main(component: dict[str, Any]) -> dict[str, Any]:
    (main,) = [c for c in component["podTemplate"]["spec"]["containers"] if c["name"] == "main"]
    return main


def _worker_pods(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, str]]]:
    """(pod spec, worker container, pod labels) of every kind of worker pod; for a DGD, the pods the
    operator would build (before it merges its own defaults into them)."""
    w = _workload(docs)
    if w["kind"] == "DynamoGraphDeployment" and w["apiVersion"] == "nvidia.com/v1beta1":
        return [(c["podTemplate"]["spec"], _main(c), c["podTemplate"]["metadata"]["labels"])
                for c in _worker_components(w)]
    if w["kind"] == "DynamoGraphDeployment":
        svc = _worker_service(w)
        spec = dict(svc["extraPodSpec"])
        main = dict(spec.pop("mainContainer"), name="main")
        main["env"] = svc.get("envs", []) + main.get("env", [])
        spec["containers"] = [main]
        return [(spec, main, svc["extraPodMetadata"]["labels"])]
    tmpl = w["spec"]["template"]
    (container,) = tmpl["spec"]["containers"]
    return [(tmpl["spec"], container, tmpl["metadata"]["labels"])]


def _worker_pod(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """The first worker pod (the only one unless disaggregated; then all share these settings)."""
    return _worker_pods(docs)[0]


def _env_map(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _kv_transfer_config(container: dict[str, Any]) -> dict[str, Any]:
    args = container["args"]
    assert args.count("--kv-transfer-config") == 1
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def _tiered_connector(container: dict[str, Any]) -> dict[str, Any]:
    """Our connector's entry in the container's kv_transfer_config (top level, or a MultiConnector child)."""
    kv = _kv_transfer_config(container)
    if kv["kv_connector"] != "MultiConnector":
        return kv
    ours = [c for c in kv["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == CONNECTOR[0]]
    assert len(ours) == 1, kv
    return ours[0]


def _configmap_files(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    data = _one(docs, "ConfigMap")["data"]
    return {k: yaml.safe_load(v) or {} for k, v in data.items()}


def _resolve_env(docs: list[dict[str, Any]], container: dict[str, Any], config_dir: Path) -> dict[str, str]:
    """The DYN_TIERED_KV_* environment the container would see; the config file is put in config_dir."""
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    files = _one(docs, "ConfigMap")["data"]
    env: dict[str, str] = {}
    for name, e in _env_map(container).items():
        if not name.startswith(ENV_PREFIX):
            continue
        if "value" in e:
            env[name] = e["value"]
            continue
        ref = e["valueFrom"]["secretKeyRef"]
        secret = secrets.get(ref["name"])
        if secret is None:  # an existing Secret: stand in a value for every key
            env[name] = f"existing-{ref['key']}"
        elif ref["key"] in secret.get("data", {}):
            env[name] = base64.b64decode(secret["data"][ref["key"]]).decode()
        else:
            assert ref.get("optional"), f"{name} refers to a missing Secret key {ref['key']}"
    if ENV_CONFIG_FILE in env:
        path = Path(env[ENV_CONFIG_FILE])
        (config_dir / path.name).write_text(files[path.name])
        env[ENV_CONFIG_FILE] = str(config_dir / path.name)
    return env


def _pod_config(docs, container, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                extra: dict[str, Any]) -> TieredKVConfig:
    for k in list(os.environ):
        if k.startswith(ENV_PREFIX):
            monkeypatch.delenv(k)
    for k, v in _resolve_env(docs, container, tmp_path).items():
        monkeypatch.setenv(k, v)
    return TieredKVConfig.from_mapping(extra)


# ------------------------------------------------------------------------------- the chart renders


def test_every_variant_has_a_ci_values_file() -> None:
    names = " ".join(p.read_text() for p in CI_VALUES)
    for needle in ("kind: StatefulSet", "kind: DynamoGraphDeployment", "type: hostPath", "type: localPV",
                   "type: existingClaim", "type: volumeClaimTemplate", "type: none", "create: false",
                   "apiVersion: nvidia.com/v1alpha1", "disaggregation:\n  enabled: true"):
        assert needle in names, f"no ci/*-values.yaml covers {needle!r}"


@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_helm_lint_strict(helm: str, values: Path) -> None:
    out = _run(helm, "lint", "--strict", CHART, "-f", values)
    assert out.returncode == 0, out.stdout + out.stderr


def test_objects_per_variant(case) -> None:
    values, docs = case
    kinds = _kinds(docs)
    worker_kind = values.get("worker", {}).get("kind", "Deployment")
    assert _workload(docs)["kind"] == worker_kind
    assert "ConfigMap" in kinds
    assert ("Secret" in kinds) == values["secret"].get("create", True)
    assert ("CronJob" in kinds) == values.get("gc", {}).get("enabled", False)
    assert ("NetworkPolicy" in kinds) == values.get("networkPolicy", {}).get("enabled", False)
    metrics = values.get("metrics", {})
    assert ("ServiceMonitor" in kinds) == (metrics.get("enabled", True)
                                           and metrics.get("serviceMonitor", {}).get("enabled", False))
    ssd_type = values.get("ssd", {}).get("type", "emptyDir")
    assert ({"PersistentVolume", "PersistentVolumeClaim"} <= kinds) == (ssd_type == "localPV")


# ------------------------------------------------------------------------------- no drift from the code


def test_env_vars_are_config_fields(case) -> None:
    _, docs = case
    known = {ENV_PREFIX + f.upper() for f in FIELDS} | {ENV_CONFIG_FILE}
    containers = [c for _, c, _ in _worker_pods(docs)]
    containers += [c for d in docs if d["kind"] == "CronJob"
                   for c in d["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]]
    for c in containers:
        names = {n for n in _env_map(c) if n.startswith(ENV_PREFIX)}
        assert names, f"container {c['name']} gets no {ENV_PREFIX}* env"
        assert names <= known, f"not TieredKVConfig fields: {sorted(names - known)}"
        assert ENV_CONFIG_FILE in names


def test_configmap_keys_are_config_fields(case) -> None:
    _, docs = case
    for name, cfg in _configmap_files(docs).items():
        assert set(cfg) <= FIELDS, f"{name}: not TieredKVConfig fields: {sorted(set(cfg) - FIELDS)}"
        assert not set(cfg) & SECRET_FIELDS, f"{name} holds secrets: {sorted(set(cfg) & SECRET_FIELDS)}"
        for f in BYTE_FIELDS & set(cfg):
            assert isinstance(cfg[f], int), f"{name}: {f} must render as an integer, got {cfg[f]!r}"


def test_worker_pod_builds_a_valid_config(case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Env (secrets resolved) + the mounted config file + kv_connector_extra_config, as the pod sees them."""
    values, docs = case
    spec, container, _ = _worker_pod(docs)
    extra = _tiered_connector(container)["kv_connector_extra_config"]
    cfg = _pod_config(docs, container, tmp_path, monkeypatch, extra)

    secret = values["secret"]
    if secret.get("create", True):
        assert cfg.tenant_salt.get_secret_value() == secret["tenantSalt"]
        if secret.get("s3AccessKey"):
            assert cfg.s3_access_key is not None
            assert cfg.s3_access_key.get_secret_value() == secret["s3AccessKey"]
        else:
            assert cfg.s3_access_key is None
    tiered = values.get("tieredKV", {})
    assert cfg.object_url == tiered.get("object_url")
    for k, v in extra.items():
        assert getattr(cfg, k) == v
    metrics = values.get("metrics", {})
    assert cfg.metrics_port == (metrics.get("port", 9464) if metrics.get("enabled", True) else None)

    ssd = values.get("ssd", {})
    if ssd.get("type", "emptyDir") == "none":
        assert cfg.ssd_dir is None
        assert "ssd" not in {m["name"] for m in container["volumeMounts"]}
        return
    mount = {m["name"]: m for m in container["volumeMounts"]}["ssd"]
    assert cfg.ssd_dir == Path(mount["mountPath"])
    if ssd.get("type") in ("hostPath", "localPV", "existingClaim"):
        # one subdirectory per pod, so pods sharing a node's disk never share rank directories
        assert mount["subPathExpr"] == "$(POD_NAME)"
        assert _env_map(container)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    if ssd.get("type") == "volumeClaimTemplate":
        claims = [t["metadata"]["name"] for t in _workload(docs)["spec"]["volumeClaimTemplates"]]
        assert claims == ["ssd"]
    else:
        assert "ssd" in {v["name"] for v in spec["volumes"]}
    if "ssd_capacity_bytes" not in tiered:  # derived: size x fill% / TP size
        tp = int(_arg(container, "--tensor-parallel-size") or 1)
        size = _quantity(ssd.get("size", "200Gi"))
        assert cfg.ssd_capacity_bytes == size * ssd.get("fillPercent", 90) // 100 // tp


def test_gc_job_config_has_no_ssd_and_builds(case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values, docs = case
    jobs = [d for d in docs if d["kind"] == "CronJob"]
    if not jobs:
        pytest.skip("gc disabled in this variant")
    (c,) = jobs[0]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["dtkv", "gc"]
    cfg = _pod_config(docs, c, tmp_path, monkeypatch, {})
    assert cfg.ssd_dir is None and cfg.metrics_port is None
    assert cfg.object_url == values["tieredKV"]["object_url"]


def test_kv_transfer_config_names_the_connector(case) -> None:
    _, docs = case
    for _, container, _ in _worker_pods(docs):
        assert container["command"][-2:] == ["-m", "dynamo.vllm"]
        kv = _tiered_connector(container)
        assert (kv["kv_connector"], kv["kv_connector_module_path"]) == CONNECTOR
        assert kv["kv_role"] in ("kv_both", "kv_producer", "kv_consumer")
        assert set(kv["kv_connector_extra_config"]) <= FIELDS - SECRET_FIELDS


def test_connector_class_exists_in_package() -> None:
    """The chart names TieredKVConnector in dynamo_tiered_kv.connectors.vllm: the module must define
    it or import it (also lazily, in a module ``__getattr__``) from a sibling module that defines it."""
    name, module = CONNECTOR
    pkg = ROOT.joinpath(*module.split("."))
    init = pkg / "__init__.py" if pkg.is_dir() else pkg.with_suffix(".py")
    assert init.exists(), f"{module} is missing ({init})"
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return
        if isinstance(node, ast.ImportFrom) and name in {a.name for a in node.names} and node.level == 1:
            source = init.parent.joinpath(*(node.module or "").split(".")).with_suffix(".py")
            classes = {n.name for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.ClassDef)}
            assert name in classes, f"{source} does not define {name}"
            return
    pytest.fail(f"{module} neither defines nor imports {name}")


def test_gc_command_line_parses(case) -> None:
    """The CronJob's exact command line is accepted by the package's `dtkv gc` and names the store,
    endpoint and retention the workers use; S3 keys and settings reach it as the workers' DYN_TIERED_KV_*
    env and config file."""
    from dynamo_tiered_kv.cli import build_parser

    values, docs = case
    jobs = [d for d in docs if d["kind"] == "CronJob"]
    if not jobs:
        pytest.skip("gc disabled in this variant")
    (c,) = jobs[0]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert c["command"][0] == "dtkv"
    line = [*c["command"][1:], *c.get("args", [])]
    try:
        args = build_parser().parse_args(line)
    except SystemExit:
        pytest.fail(f"`dtkv {' '.join(line)}` is not accepted by the dtkv CLI (dynamo_tiered_kv/commands/gc.py)")
    assert args.command == "gc" and callable(args.func)
    tiered = values["tieredKV"]
    assert args.target == tiered["object_url"]
    assert args.endpoint == tiered.get("s3_endpoint_url")
    ttl = tiered.get("object_ttl_s")
    assert args.ttl == (ttl if ttl is not None else TieredKVConfig().object_ttl_s)  # same default as the config
    env = _env_map(c)
    secret = values["secret"]
    secret_name = "t-dynamo-tiered-kv" if secret.get("create", True) else secret["existingSecret"]
    keys = {"s3AccessKey": "s3-access-key", "s3SecretKey": "s3-secret-key", **secret.get("keys", {})}
    for var, key in (("DYN_TIERED_KV_S3_ACCESS_KEY", "s3AccessKey"), ("DYN_TIERED_KV_S3_SECRET_KEY", "s3SecretKey")):
        ref = env[var]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"], ref.get("optional")) == (secret_name, keys[key], True)
    assert not [v for v in env if v.startswith("DTKV_")], "dtkv gc reads DYN_TIERED_KV_* like the workers"
    assert env["DYN_TIERED_KV_CONFIG_FILE"]["value"].endswith("/gc.yaml")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    gc_settings = yaml.safe_load(cm["data"]["gc.yaml"]) or {}
    if tiered.get("s3_region"):
        assert gc_settings["s3_region"] == tiered["s3_region"]
    assert "ssd_dir" not in gc_settings


def test_schema_mirrors_config_fields() -> None:
    """values.schema.json `tieredKV` lists exactly the non-secret, non-chart-managed fields, with the
    code's enums and lower bounds; values.yaml documents every one of them."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]["tieredKV"]["properties"]
    expected = FIELDS - SECRET_FIELDS - CHART_MANAGED
    assert set(props) == expected, (f"add to the chart: {sorted(expected - set(props))}; "
                                    f"not in the code: {sorted(set(props) - expected)}")
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["tieredKV"]
    assert set(defaults) == expected
    for name, prop in props.items():
        field = TieredKVConfig.model_fields[name]
        literals = [a for a in typing.get_args(field.annotation) if typing.get_origin(a) is typing.Literal]
        if typing.get_origin(field.annotation) is typing.Literal:
            literals = [field.annotation]
        if literals:
            assert set(prop["enum"]) - {None} == set(typing.get_args(literals[0])), name
        lower = [getattr(m, "ge", None) for m in field.metadata if getattr(m, "ge", None) is not None]
        if lower and "oneOf" in prop:
            ints = [s for s in prop["oneOf"] if s.get("type") == "integer"]
            assert ints[0]["minimum"] == lower[0], f"{name}: schema minimum {ints[0]['minimum']} != ge={lower[0]}"
    extra = schema["properties"]["connector"]["properties"]["extraConfig"]
    assert extra["properties"] == props and extra["additionalProperties"] is False


# ------------------------------------------------------------------------------- secrets


def test_secrets_never_outside_the_secret(case) -> None:
    values, docs = case
    secret = values["secret"]
    plain = [secret.get(k) for k in ("tenantSalt", "s3AccessKey", "s3SecretKey") if secret.get(k)]
    for d in docs:
        if d["kind"] == "Secret":
            continue
        text = yaml.safe_dump(d)
        for p in plain:
            assert p not in text, f"a secret value leaks into {d['kind']} {d['metadata']['name']}"
            assert base64.b64encode(p.encode()).decode() not in text
    if secret.get("create", True):
        data = _one(docs, "Secret")["data"]
        assert base64.b64decode(data["tenant-salt"]).decode() == secret["tenantSalt"]
        assert ("s3-access-key" in data) == bool(secret.get("s3AccessKey"))
    else:
        _, container, _ = _worker_pod(docs)
        ref = _env_map(container)["DYN_TIERED_KV_TENANT_SALT"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["existingSecret"]


# ------------------------------------------------------------------------------- wiring


def test_metrics_service_selects_the_worker_pods(case) -> None:
    values, docs = case
    services = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")]
    if not values.get("metrics", {}).get("enabled", True):
        assert not services
        return
    (svc,) = services
    _, _, labels = _worker_pod(docs)
    assert svc["spec"]["selector"].items() <= labels.items()
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


def _tp_size(values: dict[str, Any]) -> int:
    """The TP size the values ask for: model.tensorParallelSize, else worker.gpus (the chart's rule)."""
    tp = values.get("model", {}).get("tensorParallelSize")
    return int(tp if tp is not None else values.get("worker", {}).get("gpus", 1))


def _metrics_port_name(rank: int) -> str:
    return "dtkv-metrics" if rank == 0 else f"dtkv-m-{rank}"


def _check_metrics_ports(values: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """Every TP rank r serves on metrics.port + r (factory.build_store): the worker's container ports,
    the metrics Service (and the StatefulSet's headless one), one ServiceMonitor endpoint each and the
    NetworkPolicy cover exactly those ports, under valid, unique port names."""
    metrics = values.get("metrics", {})
    _, container, _ = _worker_pod(docs)
    ports = container.get("ports", [])
    names = [p["name"] for p in ports]
    assert len(set(names)) == len(names), f"duplicate container port names {names}"
    assert len({p["containerPort"] for p in ports}) == len(ports), f"duplicate container ports {ports}"
    for name in names:  # IANA_SVC_NAME
        assert len(name) <= 15 and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name) and re.search("[a-z]", name), name
    dtkv = {p["name"]: p["containerPort"] for p in ports if p["name"].startswith("dtkv-")}
    services = [d for d in docs if d["kind"] == "Service"]
    if not metrics.get("enabled", True):
        assert not dtkv
        for svc in services:
            assert not [p for p in svc["spec"].get("ports", []) if p["name"].startswith("dtkv-")]
        return

    tp = _tp_size(values)
    assert int(_arg(container, "--tensor-parallel-size") or 1) == tp
    base = metrics.get("port", 9464)
    expected = {_metrics_port_name(r): base + r for r in range(tp)}
    assert dtkv == expected, f"container metrics ports {dtkv}, want one per TP rank {expected}"
    system = values.get("worker", {}).get("dynamoSystem", {"enabled": True, "port": 9090})
    if system["enabled"]:
        assert system["port"] not in expected.values()

    for svc in services:  # the metrics Service and, for a StatefulSet, the headless one
        svc_ports = {p["name"]: p for p in svc["spec"].get("ports", []) if p["name"].startswith("dtkv-")}
        assert {n: p["port"] for n, p in svc_ports.items()} == expected, svc["metadata"]["name"]
        for name, p in svc_ports.items():  # the target is the container port of the same rank
            assert dtkv[p["targetPort"]] == p["port"], (name, p)
    (svc,) = [d for d in services if d["metadata"]["name"].endswith("-metrics")]
    by_name = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        endpoints = sm["spec"]["endpoints"]
        assert sorted(by_name[e["port"]] for e in endpoints) == sorted(expected.values())
        for e in endpoints:  # the tp_rank target label tells the ranks of one pod apart
            rank = by_name[e["port"]] - base
            assert {"targetLabel": "tp_rank", "replacement": str(rank)} in e["relabelings"]
    for np in (d for d in docs if d["kind"] == "NetworkPolicy"):
        allowed = {p["port"] for rule in np["spec"]["ingress"] for p in rule.get("ports", [])}
        assert set(expected.values()) <= allowed


def test_metrics_ports_cover_every_tp_rank(case) -> None:
    values, docs = case
    _check_metrics_ports(values, docs)


@pytest.mark.parametrize("extra", [{"worker": {"gpus": 4}, "model": {"tensorParallelSize": 2}},
                                   {"worker": {"gpus": 8, "resources": {"limits": {"memory": "600Gi"}}},
                                    "metrics": {"port": 9100, "serviceMonitor": {"enabled": True}}}],
                         ids=["tp2-of-4-gpus", "tp8"])
def test_metrics_ports_follow_the_tp_size(helm: str, extra: dict[str, Any], tmp_path: Path) -> None:
    """The number of metrics ports is the TP size, not the GPU count; port names stay valid up to TP 8."""
    base = yaml.safe_load((CHART / "ci" / "deployment-hostpath-s3-values.yaml").read_text())
    values = _merge(base, extra)
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = _run(helm, "template", "t", CHART, "-f", path)
    assert out.returncode == 0, out.stderr
    _check_metrics_ports(values, [d for d in yaml.safe_load_all(out.stdout) if d])


def test_gpus_and_shm(case) -> None:
    values, docs = case
    worker = values.get("worker", {})
    gpus = str(worker.get("gpus", 1))
    w = _workload(docs)
    shm = worker.get("shm", {"enabled": True, "size": "16Gi"})
    if w["kind"] == "DynamoGraphDeployment" and w["apiVersion"] == "nvidia.com/v1beta1":
        for component in _worker_components(w):
            assert _main(component)["resources"]["limits"]["nvidia.com/gpu"] == gpus
            assert component["sharedMemorySize"] == (shm["size"] if shm["enabled"] else "0")
            assert "dshm" not in {v["name"] for v in component["podTemplate"]["spec"]["volumes"]}
        return
    if w["kind"] == "DynamoGraphDeployment":
        svc = _worker_service(w)
        assert svc["resources"]["limits"]["gpu"] == gpus
        assert svc["sharedMemory"] == ({"size": shm["size"]} if shm["enabled"] else {"disabled": True})
        return
    spec, container, _ = _worker_pod(docs)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    dshm = [v for v in spec["volumes"] if v["name"] == "dshm"]
    if shm["enabled"]:
        assert dshm == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm["size"]}}]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    else:
        assert not dshm


def test_every_byte_field_takes_a_quantity(helm: str) -> None:
    """Every *_bytes field the chart accepts renders "1Mi"-style quantities as integers."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    fields = sorted(BYTE_FIELDS & set(schema["properties"]["tieredKV"]["properties"]))
    sets = [a for f in fields for a in ("--set", f"tieredKV.{f}=64Mi")]
    out = _run(helm, "template", "t", CHART, "-f", CI_VALUES[0], *sets)
    assert out.returncode == 0, out.stderr
    cfg = _configmap_files([d for d in yaml.safe_load_all(out.stdout) if d])["config.yaml"]
    assert {f: cfg[f] for f in fields} == dict.fromkeys(fields, 64 << 20)


# nvidia.com/v1alpha1 DynamoComponentDeploymentSharedSpec / ResourceItem / SharedMemorySpec json
# fields (ai-dynamo/dynamo deploy/operator/api/v1alpha1); the CRD prunes anything else silently.
DGD_SERVICE_FIELDS = {
    "annotations", "labels", "serviceName", "componentType", "subComponentType", "dynamoNamespace",
    "globalDynamoNamespace", "resources", "autoscaling", "envs", "envFromSecret", "volumeMounts", "ingress",
    "modelRef", "sharedMemory", "extraPodMetadata", "extraPodSpec", "livenessProbe", "readinessProbe",
    "replicas", "multinode", "scalingAdapter", "eppConfig", "checkpoint"}
DGD_RESOURCE_FIELDS = {"cpu", "memory", "gpu", "gpuType", "custom"}


def test_dgd_uses_only_crd_fields(case) -> None:
    _, docs = case
    w = _workload(docs)
    if w["kind"] != "DynamoGraphDeployment" or w["apiVersion"] != "nvidia.com/v1alpha1":
        pytest.skip("not a v1alpha1 DynamoGraphDeployment variant")
    assert set(w["spec"]) <= {"services", "backendFramework", "envs", "pvcs", "annotations", "labels"}
    for name, svc in w["spec"]["services"].items():
        assert set(svc) <= DGD_SERVICE_FIELDS, f"{name}: unknown fields {sorted(set(svc) - DGD_SERVICE_FIELDS)}"
        for part in ("requests", "limits"):
            items = svc.get("resources", {}).get(part, {})
            assert set(items) <= DGD_RESOURCE_FIELDS and all(isinstance(v, str) for v in items.values())
        assert set(svc.get("sharedMemory", {})) <= {"disabled", "size"}
        assert set(svc.get("extraPodMetadata", {})) <= {"labels", "annotations"}


# ------------------------------------------------------------------------------- DynamoGraphDeployment v1beta1


def _crd_json_schema(node: Any) -> Any:
    """A CRD's structural openAPIV3Schema as JSON Schema: unknown fields are errors (as with the API
    server's strict field validation), x-kubernetes-* markers and defaults are dropped."""
    if isinstance(node, list):
        return [_crd_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k.startswith("x-") or k == "default":
            continue
        if k == "properties":
            out[k] = {name: _crd_json_schema(p) for name, p in v.items()}
        elif k in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"):
            out[k] = _crd_json_schema(v)
        else:
            out[k] = v
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


@cache
def _dgd_validator():
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load(DGD_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1beta1"]
    schema = _crd_json_schema(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _dgd_schema_errors(dgd: dict[str, Any]) -> list[str]:
    errors = sorted(_dgd_validator().iter_errors(dgd), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in errors]


def test_vendored_dgd_crd_is_the_v1beta1_schema() -> None:
    crd = yaml.safe_load(DGD_CRD.read_text())
    assert crd["spec"]["group"] == "nvidia.com" and crd["spec"]["names"]["kind"] == "DynamoGraphDeployment"
    assert "ai-dynamo/dynamo" in crd["metadata"]["annotations"]["dtkv/source"]
    component = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "components"]["items"]
    assert component["properties"]["type"]["enum"] == ["frontend", "worker", "prefill", "decode", "planner", "epp"]
    pod = component["properties"]["podTemplate"]["properties"]["spec"]
    assert pod["required"] == ["containers"] and "volumes" in pod["properties"]  # the embedded corev1.PodSpec
    # the validator rejects what the API server would: unknown fields, bad enums, missing names
    bad = {"apiVersion": "nvidia.com/v1beta1", "kind": "DynamoGraphDeployment", "metadata": {"name": "x"},
           "spec": {"services": {}, "components": [{"type": "router", "podTemplate": {"spec": {"containers": [
               {"name": "main", "image": "i", "envs": []}]}}}]}}
    text = "\n".join(_dgd_schema_errors(bad))
    for needle in ("'services' was unexpected", "'router' is not one of", "'name' is a required property",
                   "'envs' was unexpected"):
        assert needle in text, text


def test_dgd_v1beta1_matches_the_crd_schema(case) -> None:
    """The rendered v1beta1 DGD validates against the v1beta1 schema of Dynamo's CRD, and carries what
    the operator's admission needs: a `main` container with an image in every component, unique
    component names, a runtime version the image tag cannot provide."""
    values, docs = case
    w = _workload(docs)
    if w["kind"] != "DynamoGraphDeployment" or w["apiVersion"] != "nvidia.com/v1beta1":
        pytest.skip("not a v1beta1 DynamoGraphDeployment variant")
    assert not _dgd_schema_errors(w), "\n".join(_dgd_schema_errors(w))
    components = w["spec"]["components"]
    names = [c["name"].lower() for c in components]
    assert len(set(names)) == len(names)
    for c in components:
        assert _main(c)["image"]
        assert c["runtimeVersionOverride"] == "1.7.0"  # = the Dockerfile's Dynamo base image
    dgd_values = values.get("dynamoGraphDeployment", {})
    frontends = [c for c in components if c["type"] == "frontend"]
    assert len(frontends) == int(dgd_values.get("frontend", {}).get("enabled", True))
    disagg = values.get("disaggregation", {}).get("enabled", False)
    assert sorted(c["type"] for c in _worker_components(w)) == (["decode", "prefill"] if disagg else ["worker"])
    for spec, main, _ in _worker_pods(docs):
        # the worker's args, env, SSD volume, metrics ports and secret are all in the pod template
        assert _tiered_connector(main)["kv_connector"] == CONNECTOR[0]
        env = _env_map(main)
        assert env["DYN_TIERED_KV_CONFIG_FILE"]["value"].startswith("/etc/dynamo-tiered-kv/")
        salt = env["DYN_TIERED_KV_TENANT_SALT"]["valueFrom"]["secretKeyRef"]["name"]
        assert salt == (values["secret"].get("existingSecret") or "t-dynamo-tiered-kv")
        mounts = {m["name"] for m in main["volumeMounts"]}
        assert {"config", "ssd"} <= mounts and {"config", "ssd"} <= {v["name"] for v in spec["volumes"]}
        assert "dtkv-metrics" in {p["name"] for p in main["ports"]}


def test_frontend_router_flags(case) -> None:
    """The frontend gets --router-mode and the per-tier hit weights from dynamoGraphDeployment.frontend.router."""
    values, docs = case
    w = _workload(docs)
    if w["kind"] != "DynamoGraphDeployment":
        pytest.skip("no frontend outside a DGD")
    if w["apiVersion"] == "nvidia.com/v1beta1":
        (frontend,) = [c for c in w["spec"]["components"] if c["type"] == "frontend"]
        args = _main(frontend).get("args", [])
    else:
        args = w["spec"]["services"]["Frontend"]["extraPodSpec"]["mainContainer"].get("args", [])
    router = values.get("dynamoGraphDeployment", {}).get("frontend", {}).get("router", {})
    expected = ["--router-mode", router.get("mode", "kv")]
    for key, flag in (("hostCacheHitWeight", "--router-host-cache-hit-weight"),
                      ("diskCacheHitWeight", "--router-disk-cache-hit-weight")):
        if router.get(key) is not None:
            expected += [flag, str(router[key])]
    assert args[: len(expected)] == expected
    for flag in ("--router-host-cache-hit-weight", "--router-disk-cache-hit-weight"):
        assert (flag in args) == (flag in expected)


def test_disaggregated_workers_use_multiconnector(helm: str) -> None:
    """Prefill: MultiConnector [ours, NIXL]; decode: [NIXL, ours] (or NIXL alone); both with the
    recompute policy at the top level, where vLLM's scheduler reads it."""
    values = CHART / "ci" / "dgd-disagg-values.yaml"
    for extra, decode_children in (([], ["NixlConnector", "TieredKVConnector"]),
                                   (["--set", "disaggregation.decode.tieredKV=false"], None)):
        out = _run(helm, "template", "t", CHART, "-f", values, *extra)
        assert out.returncode == 0, out.stderr
        w = _workload([d for d in yaml.safe_load_all(out.stdout) if d])
        assert not _dgd_schema_errors(w)
        by_type = {c["type"]: _main(c) for c in _worker_components(w)}
        for role, main in by_type.items():
            assert _arg(main, "--disaggregation-mode") == role
        prefill = _kv_transfer_config(by_type["prefill"])
        assert prefill["kv_connector"] == "MultiConnector" and prefill["kv_load_failure_policy"] == "recompute"
        assert [c["kv_connector"] for c in prefill["kv_connector_extra_config"]["connectors"]] == [
            "TieredKVConnector", "NixlConnector"]
        assert prefill["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"] == {
            "backends": ["UCX"]}
        decode = _kv_transfer_config(by_type["decode"])
        if decode_children is None:
            assert decode["kv_connector"] == "NixlConnector"
        else:
            assert [c["kv_connector"] for c in decode["kv_connector_extra_config"]["connectors"]] == decode_children
            assert decode["kv_load_failure_policy"] == "recompute"


def test_probes_follow_the_dynamo_system_server(case) -> None:
    """Deployment/StatefulSet get the operator's worker probes on the `system` port unless replaced;
    a DGD leaves them to the operator."""
    values, docs = case
    worker = values.get("worker", {})
    _, container, _ = _worker_pod(docs)
    env = _env_map(container)
    system = worker.get("dynamoSystem", {"enabled": True, "port": 9090})
    if worker.get("kind") == "DynamoGraphDeployment" and _workload(docs)["apiVersion"] == "nvidia.com/v1beta1":
        for _, main, _ in _worker_pods(docs):
            assert "DYN_SYSTEM_PORT" not in _env_map(main)  # the operator sets it, with its own probes
            assert "system" not in {p["name"] for p in main.get("ports", [])}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert main.get(probe) == (worker.get(probe) or None)
        return
    if worker.get("kind") == "DynamoGraphDeployment":
        assert "DYN_SYSTEM_PORT" not in env  # the operator sets it, with its own probes
        svc = _worker_service(_workload(docs))
        assert ("startupProbe" in container) == bool(worker.get("startupProbe"))
        for probe in ("livenessProbe", "readinessProbe"):
            assert (probe in svc) == bool(worker.get(probe))
        return
    if not system["enabled"]:
        assert "DYN_SYSTEM_PORT" not in env
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert (probe in container) == bool(worker.get(probe))
        return
    assert env["DYN_SYSTEM_PORT"]["value"] == str(system["port"])
    assert {"name": "system", "containerPort": system["port"], "protocol": "TCP"} in container["ports"]
    for probe, path in (("startupProbe", "/live"), ("livenessProbe", "/live"), ("readinessProbe", "/health")):
        expected = worker.get(probe) or {}
        if expected:
            assert container[probe] == expected
        else:
            assert container[probe]["httpGet"] == {"path": path, "port": "system"}


def test_config_change_rolls_the_pods(helm: str) -> None:
    values = CI_VALUES[0]

    def checksum(*extra: str) -> str:
        out = _run(helm, "template", "t", CHART, "-f", values, *extra)
        assert out.returncode == 0, out.stderr
        return _workload([d for d in yaml.safe_load_all(out.stdout) if d])["spec"]["template"]["metadata"][
            "annotations"]["checksum/config"]

    assert checksum() != checksum("--set", "tieredKV.admission=second_hit")


# ------------------------------------------------------------------------------- bad values fail


BAD_VALUES = {
    # values.schema.json
    "unknown worker kind": (["--set", "worker.kind=Pod"], "/worker/kind"),
    "unknown config field": (["--set", "tieredKV.no_such_field=1"], "no_such_field"),
    "secret in ConfigMap": (["--set", "tieredKV.tenant_salt=oops"], "tenant_salt"),
    "chart-managed field": (["--set", "tieredKV.ssd_dir=/x"], "ssd_dir"),
    "bad enum": (["--set", "tieredKV.ssd_io=fast"], "ssd_io"),
    "bad byte quantity": (["--set", "tieredKV.host_capacity_bytes=10GB"], "host_capacity_bytes"),
    "bad object url": (["--set", "tieredKV.object_url=http://bucket"], "object_url"),
    "zero gpus": (["--set", "worker.gpus=0"], "gpus"),
    "unknown ssd type": (["--set", "ssd.type=nfs"], "/ssd/type"),
    "port out of range": (["--set", "metrics.port=70000"], "port"),
    "bad pull policy": (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
    "DYN_TIERED_KV_ in worker.env": (["--set", "worker.env[0].name=DYN_TIERED_KV_FOO",
                                      "--set", "worker.env[0].value=1"], "env"),
    "unknown extraConfig key": (["--set", "connector.extraConfig.bogus=1"], "bogus"),
    "unknown top-level value": (["--set", "replicaCount=2"], "replicaCount"),
    # cross-field checks in _helpers.tpl
    "no model": (["--set", "model.name="], "model.name is required"),
    "no image": (["--set", "image.repository="], "image.repository is required"),
    "no tenant salt": (["--set", "secret.tenantSalt="], "secret.tenantSalt is required"),
    "vct needs StatefulSet": (["--set", "ssd.type=volumeClaimTemplate"], "needs worker.kind=StatefulSet"),
    "localPV needs a node": (["--set", "ssd.type=localPV"], "ssd.localPV.nodeName is required"),
    "gc needs object tier": (["--set", "gc.enabled=true"], "gc.enabled needs tieredKV.object_url"),
    "TP above GPUs": (["--set", "model.tensorParallelSize=2"], "needs at least that many worker.gpus"),
    "memory limit too low": (["--set", "tieredKV.host_capacity_bytes=90Gi"], "below what the pod pins"),
    "secret twice": (["--set", "secret.existingSecret=other"], "not both"),
    "metrics on the system port": (["--set", "metrics.port=9090"], "need their own ports"),
    "rank 1 metrics on the system port": (["--set", "worker.gpus=2", "--set", "metrics.port=9089"],
                                          "metrics ports 9089-9090 (metrics.port + TP rank 0..1) and "
                                          "worker.dynamoSystem.port 9090 collide"),
    "metrics ports past 65535": (["--set", "worker.gpus=2", "--set", "metrics.port=65535"], "above 65535"),
    "SSD capacity above volume": (["--set", "tieredKV.ssd_capacity_bytes=300Gi"], "exceeds ssd.size"),
    "unknown DGD apiVersion": (["--set", "dynamoGraphDeployment.apiVersion=nvidia.com/v2"], "apiVersion"),
    "runtime version not semver": (["--set", "dynamoGraphDeployment.runtimeVersion=latest"], "runtimeVersion"),
    "unknown router mode": (["--set", "dynamoGraphDeployment.frontend.router.mode=fastest"], "mode"),
    "negative tier weight": (["--set", "dynamoGraphDeployment.frontend.router.diskCacheHitWeight=-1"],
                             "diskCacheHitWeight"),
    "disaggregation needs a DGD": (["--set", "disaggregation.enabled=true"],
                                   "disaggregation.enabled needs worker.kind=DynamoGraphDeployment"),
    "disaggregation needs v1beta1": (["--set", "disaggregation.enabled=true", "--set",
                                      "worker.kind=DynamoGraphDeployment", "--set",
                                      "dynamoGraphDeployment.apiVersion=nvidia.com/v1alpha1"],
                                     "disaggregation.enabled needs dynamoGraphDeployment.apiVersion="
                                     "nvidia.com/v1beta1"),
}


@pytest.mark.parametrize("args,message", list(BAD_VALUES.values()), ids=list(BAD_VALUES))
def test_bad_values_fail_to_render(helm: str, args: list[str], message: str) -> None:
    base = CHART / "ci" / "deployment-emptydir-values.yaml"
    out = _run(helm, "template", "t", CHART, "-f", base, *args)
    assert out.returncode != 0, f"rendered despite {args}"
    assert message in out.stderr, out.stderr


# ------------------------------------------------------------------------------- Kubernetes schemas


def test_manifests_pass_kubernetes_validate_strict(case) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate to check manifests")
    _, docs = case
    for d in docs:
        if d["kind"] in ("ServiceMonitor", "DynamoGraphDeployment"):
            continue  # CRDs: no bundled schema
        kv.validate(d, "1.33", strict=True)
    w = _workload(docs)
    if w["kind"] == "DynamoGraphDeployment":
        # every worker pod (v1alpha1: extraPodSpec + mainContainer; v1beta1: podTemplate) is a valid PodSpec
        for spec, _, labels in _worker_pods(docs):
            kv.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w", "labels": labels},
                         "spec": spec}, "1.33", strict=True)


def test_install_helm_is_idempotent(helm: str) -> None:
    tools = TOOLS
    if not (tools / "helm").exists():
        pytest.skip("helm came from $HELM or PATH, not from install-helm.sh")
    out = subprocess.run(["bash", str(INSTALL_HELM), str(tools)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "already installed" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------------------------- small helpers


def _arg(container: dict[str, Any], flag: str) -> str | None:
    args = container["args"]
    return args[args.index(flag) + 1] if flag in args else None


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """base with extra merged in, recursively (as helm merges -f files)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _quantity(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for u, m in units.items():
        if q.endswith(u):
            return int(q[: -len(u)]) * m
    return int(q)
