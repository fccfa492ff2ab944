"""The identity audit (tests/test_identity_audit.py) for the vLLM 0.33 secondary tier.

Every field of vLLM 0.33's engine configs is classified in ``identity_fields.VLLM_FIELDS``, and
every model or cache field classified ``identity`` changes the namespace of the tier that vLLM's
connector builds in ``get_manager()`` for an engine with that config (``engine_configs``), while
settings classified ``ignored`` that users often change leave it alone.

Not audited here, by design: parallel fields, whose effect on the bytes vLLM itself certifies
(``is_parallelism_agnostic``; the namespace takes the topology from vLLM's ``OffloadingConfig``
unless vLLM certified the rows topology-free); and LoRA fields, which the tier never sees (vLLM's
block hash carries the adapter's name and path, docs/FORMAT.md §8).
"""

from __future__ import annotations

import copy
import dataclasses
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_configs import namespace_of, tier_settings, vllm_config
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.lora.request import LoRARequest

from dynamo_tiered_kv.bench.engine.tiny_model import build_tiny_model
from dynamo_tiered_kv.connectors.common.identity_fields import VLLM_FIELDS

# For each model or cache field classified "identity": a value that must change the namespace, and the
# base settings under which it does (a KV-quantization skip list matters only with a quantized KV cache).
_CHANGES: dict[str, dict[str, tuple[Any, dict[str, Any]]]] = {
    "ModelConfig": {
        "model": ("/models/other", {}),
        "runner": ("generate", {}),
        "convert": ("embed", {}),
        "dtype": (torch.float16, {}),
        "hf_text_config": ({"rope_type": "yarn", "factor": 4.0}, {}),
        "hf_config_path": ("/configs/long", {}),
        "revision": ("v2", {}),
        "code_revision": ("c2", {}),
        "quantization": ("fp8", {}),
        "quantization_config": ({"ignore": ["lm_head"]}, {}),
        "disable_sliding_window": (True, {}),
        "config_format": ("mistral", {}),
        "hf_overrides": ({"num_hidden_layers": 1}, {}),
        "model_class_overrides": ({"LlamaForCausalLM": "pkg.mod:Cls"}, {}),
        "model_impl": ("transformers", {}),
    },
    "CacheConfig": {
        "block_size": (32, {}),
        "cache_dtype": ("fp8", {}),
        "kv_cache_dtype_skip_layers": (["0"], {"cache_dtype": "fp8"}),
    },
}
_CONFIG_ATTR = {"ModelConfig": "model_config", "CacheConfig": "cache_config"}


def _field_names(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {name for name, f in cls.__dataclass_fields__.items()  # type: ignore[attr-defined]
                if f._field_type is not dataclasses._FIELD_CLASSVAR}  # type: ignore[attr-defined]
    return set(cls.__struct_fields__)  # type: ignore[attr-defined]


def test_every_vllm_033_engine_config_field_is_classified() -> None:
    classes = {"ModelConfig": ModelConfig, "CacheConfig": CacheConfig, "ParallelConfig": ParallelConfig,
               "LoRARequest": LoRARequest}
    unclassified = {name: sorted(_field_names(cls) - VLLM_FIELDS[name].keys()) for name, cls in classes.items()}
    assert unclassified == {name: [] for name in classes}, (
        "classify these fields in dynamo_tiered_kv/connectors/common/identity_fields.py: does each change KV bytes?")


def test_changes_cover_exactly_the_model_and_cache_identity_fields() -> None:
    identity = {cls: sorted(f for f, r in VLLM_FIELDS[cls].items() if r.startswith("identity:")) for cls in _CHANGES}
    assert identity == {cls: sorted(table) for cls, table in _CHANGES.items()}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    root = tmp_path_factory.mktemp("audit033")
    return vllm_config(build_tiny_model(root / "model"), tier_settings(root))


def _variant(base: VllmConfig, cls: str = "", field: str = "", value: Any = None,
             settings: dict[str, Any] | None = None) -> VllmConfig:
    """A copy of ``base`` with ``field`` of its ``cls`` config set (after ``settings``), under a new engine_id."""
    vc = copy.copy(base)
    ktc = copy.copy(base.kv_transfer_config)
    object.__setattr__(ktc, "engine_id", f"dtkv-audit-{uuid.uuid4().hex[:12]}")
    object.__setattr__(vc, "kv_transfer_config", ktc)
    if not cls:
        return vc
    config = copy.copy(getattr(base, _CONFIG_ATTR[cls]))
    for name, v in (settings or {}).items():
        object.__setattr__(config, name, v)
    if field == "hf_text_config":  # the model's text config with other rope settings
        text = copy.deepcopy(config.hf_text_config)
        text.rope_parameters = value
        value = text
    if field:
        object.__setattr__(config, field, value)
    object.__setattr__(vc, _CONFIG_ATTR[cls], config)
    return vc


@pytest.mark.parametrize(("cls", "field"), [(c, f) for c, table in _CHANGES.items() for f in table])
def test_each_identity_field_changes_the_tier_namespace(base: VllmConfig, cls: str, field: str) -> None:
    value, settings = _CHANGES[cls][field]
    before = namespace_of(_variant(base, cls, settings=settings))
    assert namespace_of(_variant(base, cls, field, value, settings)) != before


def test_ignored_fields_leave_the_tier_namespace_alone(base: VllmConfig, tmp_path: Path) -> None:
    """A few ignored settings that users change often: the same namespace, so chunks stay shared."""
    same = namespace_of(_variant(base))
    for cls, field, value in [("ModelConfig", "max_model_len", 256), ("ModelConfig", "seed", 7),
                              ("ModelConfig", "served_model_name", "alias"),
                              ("CacheConfig", "gpu_memory_utilization", 0.5)]:
        assert namespace_of(_variant(base, cls, field, value)) == same, field
