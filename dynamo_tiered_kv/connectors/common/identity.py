"""Model identity: everything about the served model that changes the bytes of its KV cache.

Two engines may share stored KV only if their ``model_id`` strings are equal, so the string must
change whenever the weights or the way they are applied change: a new revision (and the commit a
hub name resolved to), the remote code revision, another quantization or quantization config,
``hf_overrides`` (e.g. a different number of layers), rope settings, a model class override, a
disabled sliding window, the compute dtype behind a quantized KV cache and the layers it skips,
and, for a model loaded from a local path, the weight files themselves (a fine-tuned checkpoint
written over the same directory), whether or not a revision is named. Layout, KV dtype, TP/PP
shape and the tenant live in the ``Namespace``; a request's LoRA adapter is a request scope
(``lora_scopes``).
``identity_fields.VLLM_FIELDS`` says, for every field of the engine's configs, which of these
places it reaches or why it cannot change KV.

The string is deterministic across machines: JSON with sorted keys, and a weights fingerprint
from file names, sizes and sampled contents (never paths or mtimes, which differ between nodes
that hold copies of the same checkpoint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
from collections import OrderedDict
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: files whose contents are weights (or configure how weights are applied)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
_CONFIG_NAMES = ("config.json", "generation_config.json", "quant_config.json", "hf_quant_config.json",
                 "params.json", "adapter_config.json")
_SAMPLES = 16  # reads per weight file; fine-tuned weights differ in every sample
_SAMPLE_BYTES = 4096
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: ModelConfig fields appended as ``name=value`` when they differ from the value that changes nothing
_SETTINGS = (("code_revision", None), ("quantization", None), ("quantization_config", None),
             ("hf_config_path", None), ("hf_overrides", None), ("model_class_overrides", None),
             ("disable_sliding_window", False), ("config_format", "auto"), ("runner", "auto"),
             ("convert", "auto"), ("model_impl", "auto"))


def engine_identity(vllm_config: Any, *, override: str = "") -> str:
    """``model_identity`` of an engine's ``VllmConfig`` (its model and cache configs)."""
    cc = vllm_config.cache_config
    return model_identity(vllm_config.model_config, override=override,
                          kv_cache_dtype=str(getattr(cc, "cache_dtype", "auto")),
                          kv_skip_layers=getattr(cc, "kv_cache_dtype_skip_layers", None) or ())


def model_identity(model_config: Any, *, override: str = "", kv_cache_dtype: str = "auto",
                   kv_skip_layers: Any = ()) -> str:
    """``name[@revision]`` plus ``|key=value`` for each KV-relevant property that is set.

    ``override`` (the ``model_id`` setting) replaces only the name, i.e. the path or hub id the
    weights are read from, e.g. to share KV between nodes that mount one checkpoint under
    different paths. Everything that says which weights those are and how they are applied is
    kept whatever the override: the revision, the other properties, the weights fingerprint of a
    local checkpoint or the commit of a hub one. So an override can never make different weights
    or settings share KV; it can only make the same weights at different places share it.

    A local checkpoint is always fingerprinted, with or without a revision: vLLM reads a local
    directory as it is (a revision names nothing there), so only its files pin its KV.
    """
    model = str(model_config.model)
    revision = getattr(model_config, "revision", None)
    name = override or model
    parts = [f"{name}@{revision}" if revision else name]
    for key, value in _properties(model_config, kv_cache_dtype, kv_skip_layers):
        parts.append(f"{key}={value}")
    if Path(model).exists():
        fp = weights_fingerprint(model)
        if fp:
            parts.append(f"weights={fp}")
    else:
        commit = hub_commit(model, revision, getattr(model_config, "hf_config", None))
        if commit and commit != revision:
            parts.append(f"commit={commit}")
        elif not commit:
            log.warning("model identity: no commit found for hub model %s@%s (no snapshot in the hub "
                        "cache); only its name%s pins its KV", model, revision or "main",
                        " and revision" if revision else "")
    return "|".join(parts)


def _properties(model_config: Any, kv_cache_dtype: str, kv_skip_layers: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for name, neutral in _SETTINGS:
        value = getattr(model_config, name, None)
        if value is not None and value != neutral and value != {} and value != "none":
            out.append((name, value if isinstance(value, str) else _canonical(value)))
    hf_config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None)
    if rope:
        out.append(("rope", _canonical(rope)))
    if kv_cache_dtype not in ("auto", ""):
        # the KV dtype names only the stored type; values quantized from fp16 and bf16 differ
        out.append(("dtype", str(getattr(model_config, "dtype", "")).removeprefix("torch.")))
        if kv_skip_layers:  # these layers keep the compute dtype: another byte layout per layer
            out.append(("kv_skip_layers", _canonical(sorted(map(str, kv_skip_layers)))))
    return out


def _canonical(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif hasattr(value, "model_dump"):  # a pydantic model
        value = value.model_dump()
    if callable(value):  # a function override: its qualified name is all that can be known
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def weights_fingerprint(model: str) -> str:
    """16 hex digits over a local checkpoint's weight and config files, or "" for a hub name.

    Each weight file contributes its name, size and ``_SAMPLES`` evenly spaced 4 KiB reads (a
    few hundred KiB per checkpoint, so a start never waits on hashing gigabytes); config files
    are hashed whole. A file that cannot be read is named in the digest and logged, so the
    identity still changes if the set of files changes.
    """
    path = Path(model)
    if not path.exists():
        return ""
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file()
                   and (p.suffix in _WEIGHT_SUFFIXES or p.name in _CONFIG_NAMES or p.name.endswith(".index.json")))
    h = hashlib.blake2b(digest_size=8, person=b"dtkv-weights-v1")
    for p in files:
        rel = p.relative_to(path).as_posix() if path.is_dir() else p.name
        h.update(rel.encode() + b"\0")
        try:
            _hash_file(h, p)
        except OSError as e:
            log.warning("weights fingerprint: cannot read %s (%s); only its name is used", p, e)
            h.update(b"unreadable\0")
    return h.hexdigest() if files else ""


def _hash_file(h: Any, p: Path) -> None:
    size = p.stat().st_size
    h.update(size.to_bytes(8, "little"))
    with open(p, "rb") as f:
        if p.suffix not in _WEIGHT_SUFFIXES or size <= _SAMPLES * _SAMPLE_BYTES:
            h.update(f.read())
            return
        step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
        for i in range(_SAMPLES):
            h.update(os.pread(f.fileno(), _SAMPLE_BYTES, i * step))


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, resolved from the environment as ``huggingface_hub`` does."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_commit(repo_id: str, revision: str | None = None, hf_config: Any = None) -> str:
    """The commit a hub name resolves to, or "" when it cannot be known without the network.

    First the commit transformers recorded when it loaded the engine's config, then the hub
    cache's ``refs/<revision or main>`` (what a ``local_files_only`` load resolves), provided
    its snapshot exists.
    """
    recorded = getattr(hf_config, "_commit_hash", None)
    if isinstance(recorded, str) and _COMMIT.fullmatch(recorded):
        return recorded
    if revision and _COMMIT.fullmatch(revision):
        return revision
    if not repo_id or repo_id.startswith(("/", ".", "~")) or repo_id.count("/") > 1:
        return ""
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    try:
        commit = (repo / "refs" / (revision or "main")).read_text().strip()
    except (OSError, ValueError):
        return ""
    return commit if _COMMIT.fullmatch(commit) and (repo / "snapshots" / commit).is_dir() else ""


#: (name, path, 3-D MoE format) -> scope fields of a LoRA adapter whose weights were identified (LRU)
_LORA_SCOPES: OrderedDict[tuple[str, str, bool], dict[str, str]] = OrderedDict()
_LORA_CACHE_MAX = 1024
#: stands in for the weights of an adapter this process cannot find: its KV is never shared
_UNVERIFIED = f"unverified-{secrets.token_hex(8)}"


def lora_scopes(lora: Any) -> dict[str, str]:
    """Request scope fields naming a LoRA adapter: its name, path and weights (``{}`` for none).

    vLLM names an adapter by name and path; the weights field adds what is at the path: the
    fingerprint of its weight and config files (local directory) or the commit a hub id resolves
    to, so the same name and path with other weights (another node, a rewritten directory) never
    shares KV. Computed once per (name, path) and process, as vLLM loads an adapter once; a
    ``load_inplace`` request, which makes vLLM read the files again, computes it again. An
    adapter whose files cannot be found (e.g. a hub id not yet downloaded) gets this process's
    random stand-in, not cached, so its KV is shared with no other process.
    """
    if lora is None:
        return {}
    name = str(getattr(lora, "lora_name", lora))
    path = str(getattr(lora, "lora_path", "") or "")
    fused = bool(getattr(lora, "is_3d_lora_weight", False))  # the same files read as another layout
    key = (name, path, fused)
    scopes = _LORA_SCOPES.get(key)
    if scopes is None or getattr(lora, "load_inplace", False):
        weights = adapter_weights(path)
        scopes = {"lora": name, "lora_path": path, "lora_weights": weights or _UNVERIFIED}
        if fused:
            scopes["lora_format"] = "3d"
        if not weights:
            log.warning("LoRA adapter %s: no weight files found at %r; its KV is not shared with other "
                        "processes", name, path)
            return scopes
        _LORA_SCOPES[key] = scopes
        while len(_LORA_SCOPES) > _LORA_CACHE_MAX:
            _LORA_SCOPES.popitem(last=False)
    _LORA_SCOPES.move_to_end(key)
    return scopes


def adapter_weights(path: str) -> str:
    """``fp:<fingerprint>`` of a local adapter, ``commit:<hash>`` of a cached hub one, or ""."""
    if not path:
        return ""
    local = Path(path).expanduser()
    if local.exists():
        fp = weights_fingerprint(str(local))
        return f"fp:{fp}" if fp else ""
    commit = hub_commit(path)
    return f"commit:{commit}" if commit else ""
