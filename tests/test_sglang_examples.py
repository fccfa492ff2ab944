"""examples/sglang-serve.sh stays valid: its HiCache extra config names our backend, asks for the
zero-copy interface, and its remaining keys build a TieredKVConfig."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
from pathlib import Path

from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.sglang.identity import split_extra_config

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "sglang-serve.sh"


def test_extra_config_is_valid() -> None:
    text = SCRIPT.read_text()
    quoted = re.search(r"--hicache-storage-backend-extra-config ('.*')", text)
    assert quoted and "--hicache-storage-backend dynamic" in text and "--enable-hierarchical-cache" in text
    arg = subprocess.run(["bash", "-c", "DATA=/data; printf %s " + quoted.group(1)],
                         capture_output=True, text=True, check=True).stdout
    extra = json.loads(arg)
    assert extra["interface_v1"] == 1
    module = importlib.import_module(extra["module_path"])
    assert extra["class_name"] in module.__all__
    cfg = TieredKVConfig.from_mapping(split_extra_config(extra))
    assert str(cfg.ssd_dir) == "/data/ssd" and cfg.object_url == "file:///data/objects"
