"""Model identity and request scopes: everything that changes KV bytes changes the keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from dynamo_tiered_kv.blocks.keys import scope_salt
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.common import identity
from dynamo_tiered_kv.connectors.common.identity import model_identity, weights_fingerprint
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole

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


def test_a_local_checkpoint_is_fingerprinted_even_with_a_revision(tmp_path: Path) -> None:
    """vLLM reads a local directory as it is, whatever revision is named: only the files pin it."""
    a = _checkpoint(tmp_path / "a", b"w" * 100)
    before = model_identity(_mc(str(a), revision="v1"))
    assert before == f"{a}@v1|weights={weights_fingerprint(str(a))}"
    (a / "model.safetensors").write_bytes(b"v" * 100)  # rewritten in place, same revision named
    assert model_identity(_mc(str(a), revision="v1")) != before


def test_override_replaces_only_the_name_never_the_revision_or_weights(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))  # no snapshot: no commit to fall back on
    assert model_identity(_mc("org/m", revision="v1"), override="m") == "m@v1"
    assert model_identity(_mc("org/m", revision="v2"), override="m") != model_identity(
        _mc("org/m", revision="v1"), override="m")
    c1, c2 = "1" * 40, "2" * 40  # commits named as revisions
    assert model_identity(_mc("org/m", revision=c1), override="m") != model_identity(
        _mc("org/m", revision=c2), override="m")
    # the same checkpoint at two paths shares under one override, with or without a revision
    blob = os.urandom(1 << 16)
    a, b = _checkpoint(tmp_path / "a", blob), _checkpoint(tmp_path / "b", blob)
    for revision in (None, "v1"):
        assert model_identity(_mc(str(a), revision=revision), override="m") == model_identity(
            _mc(str(b), revision=revision), override="m")
    (b / "model.safetensors").write_bytes(os.urandom(1 << 16))  # other weights under the same override
    assert model_identity(_mc(str(a), revision="v1"), override="m") != model_identity(
        _mc(str(b), revision="v1"), override="m")


# --- LoRA adapters: name, path and the weights at the path ---------------------------------------

def _adapter(d: Path, weights: bytes, rank: int = 8) -> str:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(f'{{"r": {rank}, "lora_alpha": 16}}')
    (d / "adapter_model.safetensors").write_bytes(weights)
    return str(d)


def _lora_hashes(role: SchedulerRole, lora: object, req_id: str) -> list[bytes]:
    req = _request(req_id)
    req.lora_request = lora
    return _hashes(role, req)


# Computes the keys of a LoRA request in a fresh process, as another node serving it would.
_KEYS_SCRIPT = """
import sys
from types import SimpleNamespace
from dynamo_tiered_kv.config import TieredKVConfig
from dynamo_tiered_kv.connectors.vllm.scheduler import SchedulerRole

class L:
    def lookup(self, h): return 0, ()
    def close(self): pass

role = SchedulerRole(TieredKVConfig.from_mapping({}), model_id="m", block_size=4, lookup=L())
for i, path in enumerate(sys.argv[1:]):
    lora = SimpleNamespace(lora_name="support-bot", lora_int_id=1, lora_path=path)
    req = SimpleNamespace(request_id=str(i), all_token_ids=list(range(8)), num_tokens=8, cache_salt=None,
                          lora_request=lora, mm_features=None, prompt_embeds=None)
    print(b"".join(role._state(req).hashes_upto(2)).hex())
"""


def _keys_in_new_process(*paths: str) -> list[bytes]:
    out = subprocess.run([sys.executable, "-c", _KEYS_SCRIPT, *paths], capture_output=True, text=True, check=True)
    return [bytes.fromhex(line) for line in out.stdout.split()]


def test_lora_with_same_name_and_other_path_or_weights_never_shares_keys(tmp_path: Path, monkeypatch) -> None:
    from vllm.lora.request import LoRARequest

    v1 = os.urandom(1 << 16)
    p1 = _adapter(tmp_path / "adapters" / "v1", v1)
    p2 = _adapter(tmp_path / "adapters" / "v2", os.urandom(1 << 16))
    role = _role()
    k1 = _lora_hashes(role, LoRARequest("support-bot", 1, p1), "a")
    # same name, another path (vLLM's own prefix cache tells these apart too)
    assert _lora_hashes(role, LoRARequest("support-bot", 1, p2), "b") != k1
    # the same adapter gives the same keys in another process (another node holding a copy)
    same, = _keys_in_new_process(p1)
    assert same == b"".join(k1)
    # node B serves v2 under the same name and path: its keys differ from v1's. A fresh process
    # starts with no adapter identified; emptying this process's cache stands in for one (each
    # spawned process costs a vLLM import).
    (tmp_path / "adapters" / "v1" / "adapter_model.safetensors").write_bytes(os.urandom(1 << 16))
    monkeypatch.setattr(identity, "_LORA_SCOPES", type(identity._LORA_SCOPES)())
    assert _lora_hashes(role, LoRARequest("support-bot", 1, p1), "c") != k1
    # another adapter config (rank) over the same weight bytes at the same path differs too
    p3 = _adapter(tmp_path / "cfg", v1, rank=8)
    r8 = _lora_hashes(role, LoRARequest("support-bot", 1, p3), "d")
    _adapter(tmp_path / "cfg", v1, rank=16)
    monkeypatch.setattr(identity, "_LORA_SCOPES", type(identity._LORA_SCOPES)())
    assert _lora_hashes(role, LoRARequest("support-bot", 1, p3), "e") != r8


def test_lora_fingerprint_is_cached_per_adapter_until_vllm_reloads_it(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    path = _adapter(tmp_path / "sb", os.urandom(1 << 16))
    role = _role()
    before = _lora_hashes(role, LoRARequest("support-bot", 1, path), "a")
    (tmp_path / "sb" / "adapter_model.safetensors").write_bytes(os.urandom(1 << 16))
    # vLLM keeps serving the adapter it loaded, so the keys stay; no file is read per request
    assert _lora_hashes(role, LoRARequest("support-bot", 1, path), "b") == before
    # a load_inplace request makes vLLM read the new files: the keys follow them
    after = _lora_hashes(role, LoRARequest("support-bot", 1, path, load_inplace=True), "c")
    assert after != before
    assert _lora_hashes(role, LoRARequest("support-bot", 1, path), "d") == after


def test_lora_whose_files_cannot_be_found_shares_keys_with_no_other_process(tmp_path: Path) -> None:
    missing = str(tmp_path / "not-downloaded")
    here = _lora_hashes(_role(), SimpleNamespace(lora_name="support-bot", lora_path=missing), "a")
    assert _lora_hashes(_role(), SimpleNamespace(lora_name="support-bot", lora_path=missing), "b") == here
    there, = _keys_in_new_process(missing)
    assert there != b"".join(here)


# --- hub models: the commit the name resolved to ----------------------------------------------------

def _snapshot(cache: Path, repo: str, commit: str, ref: str = "main") -> None:
    d = cache / ("models--" + repo.replace("/", "--"))
    (d / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (d / "snapshots" / commit / "config.json").write_text("{}")
    (d / "refs").mkdir(exist_ok=True)
    (d / "refs" / ref).write_text(commit)


def test_hub_model_without_revision_is_pinned_by_its_snapshot_commit(tmp_path: Path, monkeypatch) -> None:
    from dynamo_tiered_kv.connectors.vllm.scheduler import token_namespace

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    c1, c2 = "1" * 40, "2" * 40
    _snapshot(tmp_path, "org/m", c1)
    first = model_identity(_mc("org/m"))
    assert first == f"org/m|commit={c1}"
    _snapshot(tmp_path, "org/m", c2)  # the hub's main moved on and this node downloaded it
    second = model_identity(_mc("org/m"))
    assert second == f"org/m|commit={c2}"
    assert token_namespace(first, BS, "").digest != token_namespace(second, BS, "").digest
    # a branch revision is a moving name too; a commit revision pins itself
    _snapshot(tmp_path, "org/m", c1, ref="stable")
    assert model_identity(_mc("org/m", revision="stable")) == f"org/m@stable|commit={c1}"
    assert model_identity(_mc("org/m", revision=c2)) == f"org/m@{c2}"
    # the override keeps the commit, so it cannot make two snapshots share KV
    assert model_identity(_mc("org/m"), override="m") == f"m|commit={c2}"
    # a ref whose snapshot is absent is not trusted
    _snapshot(tmp_path, "org/n", c1)
    (tmp_path / "models--org--n" / "refs" / "main").write_text(c2)
    assert model_identity(_mc("org/n")) == "org/n"


# --- engine settings that change KV ----------------------------------------------------------------

def test_code_revision_and_other_weight_settings_change_the_identity() -> None:
    base = model_identity(_mc())
    variants = [
        model_identity(_mc(code_revision="c2")),
        model_identity(_mc(quantization_config={"ignore": ["lm_head"]})),
        model_identity(_mc(hf_config_path="/configs/long-context")),
        model_identity(_mc(model_class_overrides={"LlamaForCausalLM": "pkg.mod:Cls"})),
        model_identity(_mc(disable_sliding_window=True)),
        model_identity(_mc(), kv_cache_dtype="fp8", kv_skip_layers=["0"]),
        model_identity(_mc(), kv_cache_dtype="fp8"),
    ]
    assert len({base, *variants}) == len(variants) + 1
