"""The tier's namespace names the weights of the engine vLLM built it for, not just the model's name.

Every engine here is built as vLLM 0.33 builds one (``engine_configs``): a real ``VllmConfig`` of a
checkpoint on disk, the KV cache planned by the engine core's functions, the connector's
scheduler role constructed as ``KVConnectorFactory`` does, our tier created by vLLM's spec in
``get_manager()``. vLLM's block hashes are the same for the same tokens in every process, so a
namespace is all that keeps one engine from restoring another's chunks.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from engine_configs import namespace_of, start, tier_settings, vllm_config
from tiering_engine import keys, offloading_config, payload
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from dynamo_tiered_kv.bench.engine.tiny_model import build_tiny_model
from dynamo_tiered_kv.connectors.vllm_tiering.key_mapping import UNSHARED_MARK, declared_model
from dynamo_tiered_kv.errors import ConfigError

HIT, MISS = LookupResult.HIT, LookupResult.MISS


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("identity") / "model")


def test_same_engine_config_gets_the_same_namespace_in_two_starts(model: Path, tmp_path: Path) -> None:
    tier = tier_settings(tmp_path)
    first = namespace_of(vllm_config(model, tier, revision="r1"))
    assert namespace_of(vllm_config(model, tier, revision="r1")) == first


def test_another_revision_of_the_same_model_gets_another_namespace(model: Path, tmp_path: Path) -> None:
    tier = tier_settings(tmp_path)
    first = namespace_of(vllm_config(model, tier, revision="r1"))
    assert namespace_of(vllm_config(model, tier, revision="r2")) != first


@pytest.mark.parametrize(("model_kw", "cache"), [
    ({"hf_overrides": {"rms_norm_eps": 1e-5}}, {}),  # same shapes, other math
    ({"dtype": "float16"}, {"cache_dtype": "fp8"}),  # an fp8 KV cache quantized from fp16, not bf16 values
], ids=["hf_overrides", "compute_dtype_under_fp8_kv"])
def test_weight_settings_the_offloading_config_does_not_carry_change_the_namespace(
        model: Path, tmp_path: Path, model_kw: dict[str, object], cache: dict[str, object]) -> None:
    tier = tier_settings(tmp_path)
    base = {"cache": {"cache_dtype": "fp8"}} if cache else {}
    assert namespace_of(vllm_config(model, tier, cache=cache or None, **model_kw)) != namespace_of(
        vllm_config(model, tier, **base))


def _retune(ckpt: Path) -> None:
    """Fine-tuned weights written over the same files: same names and sizes, other values."""
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    for off in range(len(data) - 4096, len(data), 64):  # the tensors' bytes (the header is at the start)
        data[off] ^= 0x5A
    weights.write_bytes(bytes(data))


def test_a_checkpoint_rewritten_in_place_gets_another_namespace(model: Path, tmp_path: Path) -> None:
    ckpt = Path(shutil.copytree(model, tmp_path / "model"))
    tier = tier_settings(tmp_path)
    before = namespace_of(vllm_config(ckpt, tier))
    _retune(ckpt)
    assert namespace_of(vllm_config(ckpt, tier)) != before


def test_model_id_names_the_path_and_never_replaces_the_weights(model: Path, tmp_path: Path) -> None:
    """``model_id`` lets two nodes mount one checkpoint at different paths and share; it does not
    make another revision or other weights share."""
    copy = Path(shutil.copytree(model, tmp_path / "elsewhere"))
    tier = tier_settings(tmp_path, model_id="tiny")
    here = namespace_of(vllm_config(model, tier, revision="r1"))
    assert namespace_of(vllm_config(copy, tier, revision="r1")) == here
    assert namespace_of(vllm_config(copy, tier, revision="r2")) != here
    _retune(copy)
    assert namespace_of(vllm_config(copy, tier, revision="r1")) != here


def test_chunks_are_found_after_a_restart_by_the_same_weights_only(model: Path, tmp_path: Path) -> None:
    tier = tier_settings(tmp_path)
    ks = keys(3, "restart")
    first = start(vllm_config(model, tier, revision="r1"))
    first.engine.store(ks)
    first.engine.settle()
    first.stop()
    for revision, expect in (("r2", [MISS] * 3), ("r1", [HIT] * 3)):
        again = start(vllm_config(model, tier, revision=revision))
        try:
            assert again.engine.lookup(ks) == expect
            if expect[0] is HIT:
                assert np.array_equal(again.engine.read(ks[0]), payload(ks[0]))
        finally:
            again.stop()


def test_vllms_stock_connector_keeps_the_tiers_chunks_to_itself(model: Path, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's own ``OffloadingConnector`` hands the tier no model config: two starts of the same
    name never share (either may be other weights), and the log says how to share."""
    tier = tier_settings(tmp_path)
    ks = keys(2, "stock")
    with caplog.at_level(logging.WARNING, logger="dynamo_tiered_kv.connectors.vllm_tiering.key_mapping"):
        first = start(vllm_config(model, tier, connector=OffloadingConnector, revision="r1"))
    assert UNSHARED_MARK in first.tier.namespace.model_id
    assert "TieredOffloadingConnector" in caplog.text
    first.engine.store(ks)
    first.engine.settle()
    first.stop()
    again = start(vllm_config(model, tier, connector=OffloadingConnector, revision="r1"))
    try:
        assert again.engine.lookup(ks) == [MISS, MISS]
    finally:
        again.stop()


def test_what_an_engine_publishes_must_name_its_model_and_engine_once(tmp_path: Path) -> None:
    """A publication for another model under the same engine_id, or two at once, is refused
    with a clear error instead of naming the tier's chunks by the wrong weights."""
    config = offloading_config({"ssd_dir": str(tmp_path / "ssd")}, model="org/model")
    with declared_model(config.engine_id, "org/other", "org/other"), \
            pytest.raises(ConfigError, match="published model 'org/other'"):
        TieringOffloadingSpec(config).get_manager()
    with declared_model(config.engine_id, "org/model", "org/model"), pytest.raises(ConfigError, match="twice"), \
            declared_model(config.engine_id, "org/model", "org/model"):
        pass
