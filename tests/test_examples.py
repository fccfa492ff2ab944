"""The examples a user copies must stay valid: YAML and the --kv-transfer-config JSON."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from dynamo_tiered_kv.config import TieredKVConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_yaml_example_loads() -> None:
    cfg = TieredKVConfig.from_yaml(EXAMPLES / "tiered-kv.yaml")
    assert cfg.ssd_dir is not None and cfg.object_url and cfg.object_url.startswith("s3://")


@pytest.mark.parametrize("script", ["vllm-serve.sh", "dynamo-vllm.sh"])
def test_kv_transfer_config_is_valid(script: str) -> None:
    text = (EXAMPLES / script).read_text()
    quoted = re.search(r"--kv-transfer-config ('.*')", text)
    assert quoted, f"{script} has no --kv-transfer-config"
    # Let bash expand the argument exactly as it would when the script runs.
    arg = subprocess.run(["bash", "-c", "MODEL=org/model DATA=/data; printf %s " + quoted.group(1)],
                         capture_output=True, text=True, check=True).stdout
    ktc = json.loads(arg)
    assert ktc["kv_connector"] == "TieredKVConnector"
    assert ktc["kv_connector_module_path"] == "dynamo_tiered_kv.connectors.vllm"
    assert ktc["kv_role"] == "kv_both" and ktc["kv_load_failure_policy"] == "recompute"
    TieredKVConfig.from_mapping(ktc["kv_connector_extra_config"])


def kv_transfer_configs(script: str) -> list[dict]:
    """Every --kv-transfer-config of an example script, as bash expands it when the script runs."""
    text = (EXAMPLES / script).read_text()
    out = []
    for quoted in re.findall(r"--kv-transfer-config ('[^\n]*')", text):
        arg = subprocess.run(["bash", "-c", "MODEL=org/model DATA=/data; printf %s " + quoted],
                             capture_output=True, text=True, check=True).stdout
        out.append(json.loads(arg))
    return out


def test_disaggregated_example_uses_multiconnector() -> None:
    """Prefill: [ours, NIXL]; decode: [NIXL, ours]; recompute on the MultiConnector; each worker's own
    SSD directory and metrics port, one shared object tier; the router flags for tier-aware routing."""
    prefill, decode = kv_transfer_configs("dynamo-disagg.sh")
    ours = []
    for ktc, order in ((prefill, ["TieredKVConnector", "NixlConnector"]),
                       (decode, ["NixlConnector", "TieredKVConnector"])):
        assert ktc["kv_connector"] == "MultiConnector" and ktc["kv_load_failure_policy"] == "recompute"
        children = ktc["kv_connector_extra_config"]["connectors"]
        assert [c["kv_connector"] for c in children] == order
        (mine,) = [c for c in children if c["kv_connector"] == "TieredKVConnector"]
        assert mine["kv_connector_module_path"] == "dynamo_tiered_kv.connectors.vllm"
        ours.append(TieredKVConfig.from_mapping({**mine["kv_connector_extra_config"], "tenant_salt": "s"}))
    assert ours[0].ssd_dir != ours[1].ssd_dir and ours[0].metrics_port != ours[1].metrics_port
    assert ours[0].object_url == ours[1].object_url
    text = (EXAMPLES / "dynamo-disagg.sh").read_text()
    for flag in ("--router-mode kv", "--router-host-cache-hit-weight", "--router-disk-cache-hit-weight",
                 "--disaggregation-mode prefill", "--disaggregation-mode decode"):
        assert flag in text
