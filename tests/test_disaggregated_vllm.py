"""Disaggregated serving: the exact kv_transfer_config that examples/dynamo-disagg.sh and the chart
(disaggregation.enabled) hand to vLLM is parsed by vLLM's own KVTransferConfig, and vLLM's
MultiConnector builds TieredKVConnector from it, next to NixlConnector, on the CPU engine.

What runs here: EngineArgs -> VllmConfig (the CPU platform), KVConnectorFactory resolving the
MultiConnector, and MultiConnector(vllm_config, SCHEDULER, kv_cache_config) constructing both
children in the configured order. What does not: the worker role (NixlConnector's worker registers
GPU memory with a NIXL agent) and an actual prefill -> decode transfer; both need GPUs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("vllm")

from helm_tool import find_helm
from test_examples import kv_transfer_configs

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "dynamo-tiered-kv"
pytestmark = pytest.mark.timeout(600)


def _chart_configs() -> list[dict[str, Any]]:
    """(decode, prefill) kv_transfer_config of the chart's ci/dgd-disagg-values.yaml."""
    helm, why = find_helm()  # installs helm if no test has yet
    if helm is None:
        pytest.skip(why)
    out = subprocess.run([helm, "template", "t", str(CHART), "-f", str(CHART / "ci" / "dgd-disagg-values.yaml")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    (dgd,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "DynamoGraphDeployment"]
    configs = {}
    for c in dgd["spec"]["components"]:
        if c["type"] in ("prefill", "decode"):
            (main,) = c["podTemplate"]["spec"]["containers"]
            args = main["args"]
            configs[c["type"]] = json.loads(args[args.index("--kv-transfer-config") + 1])
    return [configs["prefill"], configs["decode"]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dynamo_tiered_kv.bench.engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("disagg") / "model")


def _local(ktc: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """The same config with our connector's SSD and object tiers pointed into tmp (the example's
    /data and the chart's mount paths do not exist here); everything else unchanged."""
    ktc = json.loads(json.dumps(ktc))
    for child in ktc["kv_connector_extra_config"]["connectors"]:
        if child["kv_connector"] == "TieredKVConnector":
            extra = child.setdefault("kv_connector_extra_config", {})
            extra.update(ssd_dir=str(tmp / "ssd"), object_url=f"file://{tmp}/objects", tenant_salt="t")
            extra.pop("s3_endpoint_url", None)
            extra["metrics_port"] = None
    return ktc


def _kv_cache_config(vllm_config: Any) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from dynamo_tiered_kv.bench.engine.tiny_model import TEST_SPEC

    spec = FullAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=TEST_SPEC.num_key_value_heads,
                             head_size=TEST_SPEC.head_dim, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(TEST_SPEC.num_hidden_layers)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


SOURCES = {"example": lambda: kv_transfer_configs("dynamo-disagg.sh"), "chart": _chart_configs}


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_multiconnector_builds_our_connector(source: str, role: str, model_dir: Path, tmp_path: Path) -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.engine.arg_utils import EngineArgs

    from dynamo_tiered_kv.connectors.vllm import TieredKVConnector

    prefill, decode = SOURCES[source]()
    raw = _local(prefill if role == "prefill" else decode, tmp_path)
    order = [c["kv_connector"] for c in raw["kv_connector_extra_config"]["connectors"]]
    assert order == (["TieredKVConnector", "NixlConnector"] if role == "prefill"
                     else ["NixlConnector", "TieredKVConnector"])

    # vLLM parses the JSON exactly as `--kv-transfer-config` does, then builds the engine config
    ktc = KVTransferConfig(**raw)
    assert ktc.kv_load_failure_policy == "recompute"  # the scheduler reads the top level
    engine = EngineArgs(model=str(model_dir), kv_transfer_config=ktc, max_model_len=512, enforce_eager=True)
    vllm_config = engine.create_engine_config()
    assert KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config) is MultiConnector

    children = MultiConnector._get_connector_classes_and_configs(vllm_config)
    assert [cfg.kv_transfer_config.kv_connector for _, cfg in children] == order
    (ours_cls,) = [cls for cls, cfg in children if cfg.kv_transfer_config.kv_connector == "TieredKVConnector"]
    assert ours_cls is TieredKVConnector

    # MultiConnector constructs both children itself (scheduler side; the worker side needs GPUs for NIXL)
    multi = MultiConnector(vllm_config, KVConnectorRole.SCHEDULER, _kv_cache_config(vllm_config))
    kinds = [type(c).__name__ for c in multi.sub_connectors]
    ours = [c for c in multi.sub_connectors if isinstance(c, TieredKVConnector)]
    assert len(ours) == 1 and kinds.index(type(ours[0]).__name__) == order.index("TieredKVConnector"), kinds
    assert ours[0].config.ssd_dir == tmp_path / "ssd"
    assert ours[0].config.object_url == f"file://{tmp_path}/objects"
