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
