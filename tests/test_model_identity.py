"""Model identity and request scopes: everything that changes KV bytes changes the keys."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.identity import model_identity, weights_fingerprint
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole
from dynamo_tiered_kv.keys import scope_salt

BS = 4


class _Lookup:
    def lookup(self, hashes: list[bytes]) -> tuple[int, tuple[str, ...]]:
        return 0, ()

    def close(self) -> None:
        pass


def _mc(model: str = "org/m", **kw) -> SimpleNamespace:
    fields = dict(model=model, revision=None, quantization=None, hf_overrides={}, dtype="torch.bfloat16",
                  hf_config=SimpleNamespace())
    fields.update(kw)
    return SimpleNamespace(**fields)


def _request(req_id: str = "r", cache_salt: str | None = None, lora: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, all_token_ids=list(range(8)), num_tokens=8, cache_salt=cache_salt,
                           lora_request=SimpleNamespace(lora_name=lora) if lora else None, mm_features=None,
                           prompt_embeds=None)


def _hashes(role: SchedulerRole, req: SimpleNamespace) -> list[bytes]:
    return role._state(req).hashes_upto(2)


def _role(model_id: str = "m", **cfg) -> SchedulerRole:
    return SchedulerRole(TieredKVConfig.from_mapping(cfg), model_id=model_id, block_size=BS, lookup=_Lookup())


def test_crafted_cache_salt_cannot_impersonate_a_lora_scope() -> None:
    r = _role()
    crafted = _hashes(r, _request("a", cache_salt="X\0lora:sql-adapter"))
    lora = _hashes(r, _request("b", cache_salt="X", lora="sql-adapter"))
    assert crafted != lora
    # and the field encoding itself is injective on such pairs
    assert scope_salt("t", cache="X\0lora:a") != scope_salt("t", cache="X", lora="a")
    assert scope_salt("t", cache="a;tenant=1:x") != scope_salt("x", cache="a")


def test_scopes_tenant_and_lora_each_change_the_keys() -> None:
    base = _hashes(_role(), _request())
    assert _hashes(_role(tenant_salt="acme"), _request()) != base
    assert _hashes(_role(), _request(lora="a")) != base
    assert _hashes(_role(), _request(lora="a")) != _hashes(_role(), _request(lora="b"))
    assert _hashes(_role(), _request(cache_salt="s")) != base


def test_revision_quantization_overrides_and_rope_change_the_identity() -> None:
    base = model_identity(_mc())
    assert base == "org/m"
    variants = [
        model_identity(_mc(revision="v2")),
        model_identity(_mc(quantization="fp8")),
        model_identity(_mc(hf_overrides={"num_hidden_layers": 4})),
        model_identity(_mc(hf_config=SimpleNamespace(rope_scaling={"rope_type": "yarn", "factor": 4.0}))),
        model_identity(_mc(), kv_cache_dtype="fp8"),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # canonical JSON: key order of an override does not matter
    assert model_identity(_mc(hf_overrides={"a": 1, "b": 2})) == model_identity(_mc(hf_overrides={"b": 2, "a": 1}))


def test_override_keeps_the_settings_that_change_kv() -> None:
    assert model_identity(_mc("/models/llama3"), override="llama-3-8b") == model_identity(
        _mc("/other/path"), override="llama-3-8b")
    assert model_identity(_mc(quantization="awq"), override="x") != model_identity(_mc(), override="x")


def _checkpoint(d: Path, weights: bytes) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"num_hidden_layers": 2}')
    (d / "model.safetensors").write_bytes(weights)
    return d


def test_local_checkpoint_fingerprint_follows_weights_not_paths(tmp_path: Path) -> None:
    blob = os.urandom(1 << 20)
    a = _checkpoint(tmp_path / "a", blob)
    b = _checkpoint(tmp_path / "b", blob)  # a copy on another node: same identity
    assert weights_fingerprint(str(a)) == weights_fingerprint(str(b)) != ""
    assert model_identity(_mc(str(a)), override="m") == model_identity(_mc(str(b)), override="m")
    # fine-tuned in place: same names and sizes, different values
    tuned = bytearray(blob)
    for off in range(0, len(tuned), 4096):
        tuned[off + 100] ^= 0x5A
    (a / "model.safetensors").write_bytes(bytes(tuned))
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(b))
    # a hub name has no local files and keeps a readable identity
    assert weights_fingerprint("org/not-a-local-path") == ""


def test_a_revision_pins_identity_without_reading_files(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a", b"w" * 100)
    assert model_identity(_mc(str(a), revision="v1")) == f"{a}@v1"
