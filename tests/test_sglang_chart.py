"""The chart's ``engine: sglang`` value: Dynamo SGLang workers with our HiCache storage backend.

Rendered with the same helm and helpers as tests/test_helm_chart.py. The worker's
``--hicache-storage-backend-extra-config`` must name a class SGLang's dynamic loader accepts, ask
for the zero-copy interface, and, with the pod's env and ConfigMap, build a valid TieredKVConfig.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_helm_chart import CHART, _configmap_files, _find_helm, _pod_config, _run, _worker_pod, _workload

from dynamo_tiered_kv.connectors.sglang.identity import split_extra_config

BASE = {"image": {"repository": "r.example.com/dtkv-sglang"}, "model": {"name": "Qwen/Qwen3-8B"},
        "secret": {"tenantSalt": "ci-salt"}, "engine": "sglang",
        "tieredKV": {"object_url": "s3://kv/qwen3-8b", "host_capacity_bytes": "8Gi"},
        "connector": {"extraConfig": {"min_prefix_blocks": 2}}}


@pytest.fixture(scope="module")
def helm() -> str:
    path, why = _find_helm()
    if path is None:
        pytest.skip(why)
    return path


def _render(helm: str, tmp_path: Path, **over: Any) -> tuple[int, list[dict[str, Any]], str]:
    values = {**BASE, **over}
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    out = _run(helm, "template", "t", CHART, "--namespace", "kv", "-f", f)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d] if out.returncode == 0 else []
    return out.returncode, docs, out.stderr


def _flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, args
    return args[args.index(name) + 1]


@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet", "DynamoGraphDeployment"])
def test_sglang_worker_runs_our_backend(helm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        kind: str) -> None:
    rc, docs, err = _render(helm, tmp_path, worker={"kind": kind, "gpus": 2})
    assert rc == 0, err
    _, container, _ = _worker_pod(docs)
    assert container["command"] == ["python3", "-m", "dynamo.sglang"]
    args = container["args"]
    assert "--kv-transfer-config" not in args and "--enable-hierarchical-cache" in args
    assert _flag(args, "--model-path") == "Qwen/Qwen3-8B" and _flag(args, "--tp-size") == "2"
    assert _flag(args, "--hicache-storage-backend") == "dynamic"
    assert _flag(args, "--hicache-mem-layout") == "page_first_direct"
    extra = json.loads(_flag(args, "--hicache-storage-backend-extra-config"))
    assert extra["interface_v1"] == 1 and extra["min_prefix_blocks"] == 2
    # what SGLang's StorageBackendFactory._load_backend_class does with it
    module = importlib.import_module(extra["module_path"])
    if importlib.util.find_spec("sglang") is not None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

        assert issubclass(getattr(module, extra["class_name"]), HiCacheStorage)
    cfg = _pod_config(docs, container, tmp_path, monkeypatch, split_extra_config(extra))
    assert cfg.object_url == "s3://kv/qwen3-8b" and cfg.min_prefix_blocks == 2
    assert cfg.tenant_salt.get_secret_value() == "ci-salt" and cfg.ssd_dir is not None
    if kind == "DynamoGraphDeployment":
        assert _workload(docs)["spec"]["backendFramework"] == "sglang"


def test_vllm_stays_the_default(helm: str, tmp_path: Path) -> None:
    rc, docs, err = _render(helm, tmp_path, engine="vllm")
    assert rc == 0, err
    _, container, _ = _worker_pod(docs)
    assert container["command"] == ["python3", "-m", "dynamo.vllm"] and "--kv-transfer-config" in container["args"]
    assert "hicache" not in json.dumps(container["args"])
    assert _configmap_files(docs)


@pytest.mark.parametrize(("over", "message"), [
    ({"disaggregation": {"enabled": True}, "worker": {"kind": "DynamoGraphDeployment"}}, "disaggregation"),
    ({"sglang": {"memLayout": "page_unified"}}, "memLayout"),
])
def test_bad_sglang_values_fail(helm: str, tmp_path: Path, over: dict[str, Any], message: str) -> None:
    rc, _, err = _render(helm, tmp_path, **over)
    assert rc != 0 and message in err
