"""The store's start-up line (what each tier will hold) shows under an engine that configures only
its own logger, as vLLM does; an application's own logging configuration is left to decide."""

from __future__ import annotations

import os
import subprocess
import sys

BUILD = """
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.factory import build_store
from dynamo_tiered_kv.blocks.keys import Namespace
cfg = TieredKVConfig.from_mapping({"host_capacity_bytes": "8Mi", "staging_slab_bytes": "1Mi", "staging_slabs": 2})
build_store(cfg, Namespace("tiny", "bfloat16", "KV_SPLIT", 16, 2, 2, 64)).close()
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_TIERED_KV_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_tier_summary_shows_under_vllm_logging() -> None:
    # vLLM's logging configuration as its engine applies it (EngineCore, `vllm serve`): its own logger only
    code = ("from vllm.config.logging import LoggingConfig\n"
            "from vllm.logger import configure_logging, init_logger\n"
            "configure_logging(LoggingConfig())\n"
            "init_logger('vllm.engine').info('engine says hello')\n" + BUILD)
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "engine says hello" in out.stdout + out.stderr  # vLLM's handler is there (stdout by default)
    lines = [ln for ln in out.stderr.splitlines() if "tiered KV store: host 8 MiB [host_capacity_bytes]" in ln]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("INFO ") and "[dynamo_tiered_kv.factory]" in lines[0]


def test_an_application_logging_config_decides() -> None:
    """Root configured at WARNING (e.g. ``dtkv``): no handler of ours, INFO lines stay hidden."""
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n" + BUILD +
            "\nprint('handlers:', logging.getLogger('dynamo_tiered_kv').handlers)")
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "tiered KV store:" not in out.stderr
    assert out.stdout.strip() == "handlers: []"


def test_root_configured_later_prints_each_line_once() -> None:
    code = (BUILD + "\nimport logging; logging.basicConfig(level=logging.INFO, format='ROOT %(message)s')\n"
            "logging.getLogger('dynamo_tiered_kv.factory').info('after the application configured logging')\n")
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("after the application configured logging") == 1
    assert "ROOT after the application configured logging" in out.stderr
