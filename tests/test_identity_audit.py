"""Every field of the installed vLLM's configs is classified, and every identity field changes the keys.

A vLLM upgrade that adds a field fails here until the field is classified in
``identity_fields.VLLM_FIELDS``; a field classified ``identity`` that does not reach the keys fails
the second test. The vLLM 0.33 secondary tier has its own audit, run with vLLM 0.33's configs
(tests/vllm_tiering/test_identity_audit_tiering.py).
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("vllm", reason="the audit reads the installed vLLM's config classes")

from dynamo_tiered_kv.connectors.common.identity_fields import VLLM_FIELDS


def _engine_classes() -> dict[str, type]:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig
    from vllm.lora.request import LoRARequest

    return {"ModelConfig": ModelConfig, "CacheConfig": CacheConfig, "ParallelConfig": ParallelConfig,
            "LoRARequest": LoRARequest}


def _field_names(cls: type) -> set[str]:
    """Dataclass fields and init-only variables (pydantic dataclasses), or msgspec struct fields."""
    if dataclasses.is_dataclass(cls):
        return {name for name, f in cls.__dataclass_fields__.items()  # type: ignore[attr-defined]
                if f._field_type is not dataclasses._FIELD_CLASSVAR}  # type: ignore[attr-defined]
    return set(cls.__struct_fields__)  # type: ignore[attr-defined]


def test_every_engine_config_field_is_classified() -> None:
    unclassified = {name: sorted(_field_names(cls) - VLLM_FIELDS[name].keys())
                    for name, cls in _engine_classes().items()}
    assert unclassified == {name: [] for name in unclassified}, (
        "classify these fields in dynamo_tiered_kv/connectors/common/identity_fields.py: does each change KV bytes?")
    for table in VLLM_FIELDS.values():
        for field, reason in table.items():
            kind, _, why = reason.partition(": ")
            assert kind in ("identity", "ignored") and why, f"{field}: {reason!r}"


# For each field classified "identity": a value that must change the keys, and the base settings
# under which it does (a KV-quantization skip list matters only with a quantized KV cache).
_CHANGES: dict[str, dict[str, tuple[Any, dict[str, Any]]]] = {
    "ModelConfig": {
        "model": ("/models/other", {}),
        "runner": ("generate", {}),
        "convert": ("embed", {}),
        "dtype": ("float16", {}),
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
    "ParallelConfig": {
        "tensor_parallel_size": (2, {}),
        "pipeline_parallel_size": (2, {}),
    },
    "LoRARequest": {
        "lora_name": ("other-adapter", {}),
        "lora_path": (None, {}),  # another adapter directory (made in the test)
        "is_3d_lora_weight": (True, {}),
    },
}


def test_changes_cover_exactly_the_identity_fields() -> None:
    identity = {cls: sorted(f for f, r in table.items() if r.startswith("identity:"))
                for cls, table in VLLM_FIELDS.items()}
    assert identity == {cls: sorted(_CHANGES[cls]) for cls in VLLM_FIELDS}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Real vLLM configs of a tiny local model (built once), and a LoRA adapter directory."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig

    from dynamo_tiered_kv.bench.engine.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("audit")
    model = build_tiny_model(root / "model")
    adapters = []
    for name in ("a", "b"):
        d = root / "adapters" / name
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text('{"r": 8}')
        (d / "adapter_model.safetensors").write_bytes(name.encode() * 4096)
        adapters.append(str(d))
    return SimpleNamespace(model_config=ModelConfig(model=str(model)), cache_config=CacheConfig(block_size=16),
                           parallel_config=ParallelConfig(), adapters=adapters)


def _keys(vllm_config: Any, lora: Any = None) -> tuple[Any, ...]:
    """Everything the connector builds keys from: the scheduler's keys of one request, and what
    each worker puts in its ``Namespace`` (model id, KV dtype, block size, TP and PP size)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from dynamo_tiered_kv.connectors.vllm.connector import TieredKVConnector

    sched = TieredKVConnector(vllm_config, KVConnectorRole.SCHEDULER)._scheduler
    # the worker of rank 0, as vLLM's distributed state names it inside an engine (no process
    # groups here: a worker with more than one TP or PP rank refuses to start without them)
    with mock.patch("vllm.distributed.get_tensor_model_parallel_rank", return_value=0), \
            mock.patch("vllm.distributed.get_pp_group", return_value=SimpleNamespace(rank_in_group=0)):
        worker = TieredKVConnector(vllm_config, KVConnectorRole.WORKER)._worker
    assert sched is not None and worker is not None
    req = SimpleNamespace(request_id="r", all_token_ids=list(range(64)), num_tokens=64, cache_salt=None,
                          lora_request=lora, mm_features=None, prompt_embeds=None)
    return (tuple(sched._state(req).hashes_upto(2)), worker.model_id, worker.kv_dtype, worker.block_size,
            worker.tp_size, worker.pp_size)


def _vllm_config(engine: SimpleNamespace, cls: str = "", field: str = "", value: Any = None,
                 base: dict[str, Any] | None = None) -> SimpleNamespace:
    configs = {"ModelConfig": copy.copy(engine.model_config), "CacheConfig": copy.copy(engine.cache_config),
               "ParallelConfig": copy.copy(engine.parallel_config)}
    for name, v in (base or {}).items():
        object.__setattr__(configs[cls], name, v)
    if field == "hf_text_config":  # a copy of the model's text config with other rope settings
        text = copy.deepcopy(configs[cls].hf_text_config)
        text.rope_parameters = value
        value = text
    if field:
        object.__setattr__(configs[cls], field, value)
    ktc = SimpleNamespace(kv_connector_extra_config={}, engine_id="audit", kv_load_failure_policy="recompute")
    return SimpleNamespace(model_config=configs["ModelConfig"], cache_config=configs["CacheConfig"],
                           parallel_config=configs["ParallelConfig"], kv_transfer_config=ktc,
                           kv_events_config=None)


@pytest.mark.parametrize(("cls", "field"), [(c, f) for c in ("ModelConfig", "CacheConfig", "ParallelConfig")
                                            for f in _CHANGES[c]])
def test_each_identity_config_field_changes_the_keys(engine: SimpleNamespace, cls: str, field: str) -> None:
    value, base = _CHANGES[cls][field]
    before = _keys(_vllm_config(engine, cls, base=base))
    assert _keys(_vllm_config(engine, cls, field, value, base)) != before


@pytest.mark.parametrize("field", sorted(_CHANGES["LoRARequest"]))
def test_each_identity_lora_field_changes_the_keys(engine: SimpleNamespace, field: str) -> None:
    from vllm.lora.request import LoRARequest

    value = engine.adapters[1] if field == "lora_path" else _CHANGES["LoRARequest"][field][0]
    lora = LoRARequest("support-bot", 1, engine.adapters[0])
    changed = LoRARequest(**{"lora_name": "support-bot", "lora_int_id": 1, "lora_path": engine.adapters[0],
                             field: value})
    vc = _vllm_config(engine)
    assert _keys(vc, changed) != _keys(vc, lora)


def test_ignored_fields_leave_the_keys_alone(engine: SimpleNamespace) -> None:
    """A few ignored settings that users change often: equal keys, so KV stays shared."""
    vc = _vllm_config(engine)
    for cls, field, value in [("ModelConfig", "max_model_len", 1024), ("ModelConfig", "seed", 7),
                              ("ModelConfig", "served_model_name", "alias"),
                              ("CacheConfig", "gpu_memory_utilization", 0.5)]:
        assert _keys(_vllm_config(engine, cls, field, value)) == _keys(vc), field
