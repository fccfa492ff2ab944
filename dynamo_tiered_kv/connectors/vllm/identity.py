"""Model identity: everything about the served model that changes the bytes of its KV cache.

Two engines may share stored KV only if their ``model_id`` strings are equal, so the string must
change whenever the weights or the way they are applied change: a new revision, another
quantization, ``hf_overrides`` (e.g. a different number of layers or rope settings), rope
scaling, the compute dtype behind a non-default KV cache dtype, and, for a model loaded from a
local path without a revision, the weight files themselves (a fine-tuned checkpoint written over
the same directory). Layout, KV dtype, TP/PP shape and the tenant live in the ``Namespace``.

The string is deterministic across machines: JSON with sorted keys, and a weights fingerprint
from file names, sizes and sampled contents (never paths or mtimes, which differ between nodes
that hold copies of the same checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: files whose contents are weights (or configure how weights are applied)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
_CONFIG_NAMES = ("config.json", "generation_config.json", "quant_config.json", "hf_quant_config.json")
_SAMPLES = 16  # reads per weight file; fine-tuned weights differ in every sample
_SAMPLE_BYTES = 4096


def model_identity(model_config: Any, *, override: str = "", kv_cache_dtype: str = "auto") -> str:
    """``name[@revision]`` plus ``|key=value`` for each KV-relevant property that is set.

    ``override`` (the ``model_id`` setting) replaces the name and revision, e.g. to share KV
    between nodes that mount one checkpoint under different paths; the other properties and the
    weights fingerprint are still appended, so an override can never make different weights or
    settings share KV.
    """
    model = str(model_config.model)
    revision = getattr(model_config, "revision", None)
    base = override or (f"{model}@{revision}" if revision else model)
    parts = [base]
    for name, value in _properties(model_config, kv_cache_dtype):
        parts.append(f"{name}={value}")
    if not revision:
        fp = weights_fingerprint(model)
        if fp:
            parts.append(f"weights={fp}")
    return "|".join(parts)


def _properties(model_config: Any, kv_cache_dtype: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    quant = getattr(model_config, "quantization", None)
    if quant:
        out.append(("quantization", str(quant)))
    overrides = getattr(model_config, "hf_overrides", None)
    if overrides:
        out.append(("hf_overrides", _canonical(overrides)))
    hf_config = getattr(model_config, "hf_config", None)
    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None)
    if rope:
        out.append(("rope", _canonical(rope)))
    if kv_cache_dtype not in ("auto", ""):
        # the KV dtype names only the stored type; values quantized from fp16 and bf16 differ
        out.append(("dtype", str(getattr(model_config, "dtype", "")).removeprefix("torch.")))
    return out


def _canonical(value: Any) -> str:
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
