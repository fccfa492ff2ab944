"""Namespace and keys for SGLang pages, under the same rules as the vLLM connector.

SGLang hands the backend page hashes (strings; each already chains its whole token prefix), a
``HiCacheStorageConfig`` (parallel ranks, model name, MLA or not) and its host pool (dtype,
geometry, layout); the scheduler process also publishes its ``ServerArgs``. The ``Namespace`` pins
what makes the bytes interchangeable: model identity (every ``identity:`` field of
``server_args_table``, the hub snapshot commit of a hub model without a pinned commit, the
weights fingerprint of a local checkpoint, as ``connectors/common/identity.py``), KV dtype,
canonical layout and shape, TP rank and size, pipeline stage, and the tenant salt. A key is
``engine_block_key(namespace, ROOT_KEY, epoch + page_hash)``, the vLLM worker's rule for
engine-supplied hashes, so tenants and models can never read each other's pages.

MLA KV is the same on every TP rank (SGLang writes it from one rank), so an MLA namespace uses
TP rank 0 of 1 and every rank reads the one copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...blocks.keys import ROOT_KEY, BlockKey, Namespace, engine_block_key
from ...blocks.layout import BlockShape
from ...errors import ConfigError
from ...factory import worker_rank
from ..common.identity import hub_commit as vllm_hub_commit
from ..common.identity import weights_fingerprint
from .epoch import served_weight_version
from .server_args_table import IDENTITY, SERVER_ARGS_FIELDS

__all__ = ["SERVER_ARGS_FIELDS", "hub_commit", "model_identity", "namespace_for", "page_keys", "published_server_args",
           "ranks_of", "server_identity", "split_extra_config"]

log = logging.getLogger(__name__)
_COMMIT = re.compile(r"[0-9a-f]{40}")

#: keys of SGLang's ``--hicache-storage-backend-extra-config`` that SGLang itself reads
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "enable_metadata_cache",
                         "metadata_ttl", "tp_lcm_size"})


def split_extra_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    """Our settings from SGLang's extra config (SGLang's own keys removed; the rest must be ours)."""
    return {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}


@dataclass(frozen=True)
class Ranks:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int

    @property
    def process_rank(self) -> int:
        """Unique per worker process of a host: names its SSD directory, offsets its metrics port."""
        return worker_rank(tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size,
                           dp_rank=self.dp_rank)


def ranks_of(storage_config: Any) -> Ranks:
    """Parallel identity from a ``HiCacheStorageConfig``; context parallelism is refused (each rank
    would hold an interleaved share of a page's tokens, which the key does not name)."""
    if int(getattr(storage_config, "attn_cp_size", 1) or 1) > 1 or int(getattr(storage_config, "dcp_size", 1) or 1) > 1:
        raise ConfigError("dynamo_tiered_kv SGLang backend: attention/decode context parallelism is not supported")
    return Ranks(int(storage_config.tp_rank), int(storage_config.tp_size), int(storage_config.pp_rank),
                 int(storage_config.pp_size), int(getattr(storage_config, "dp_rank", 0) or 0))


def model_identity(model_name: str | None, override: str = "", server_args: Any = None) -> str:
    """``model_id`` override or SGLang's model name, plus the server's KV identity (``server_identity``)
    and the weights fingerprint of a local checkpoint."""
    base = override or model_name or ""
    if not base:
        raise ConfigError("SGLang gave no model name: set model_id in the backend's extra config")
    parts = [base]
    if server_args is not None:
        parts.append(server_identity(server_args, with_path=not override))
    model = _field(server_args, "model_path") if server_args is not None else model_name
    fp = weights_fingerprint(str(model)) if model else ""
    if fp:
        parts.append(f"weights={fp}")
    return "|".join(parts)


def published_server_args() -> Any:
    """The ``ServerArgs`` SGLang published in this scheduler process, or None outside one."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except (ImportError, ValueError):
        return None


def server_identity(server_args: Any, *, with_path: bool = True) -> str:
    """``sglang=<digest>`` over every ``identity:`` field as SGLang resolved it, plus ``commit=<sha>``
    for a hub model. ``with_path=False`` (a ``model_id`` override) leaves out the model path, so
    nodes that mount one checkpoint under different paths share KV; the commit and the weights
    fingerprint still tell other weights apart."""
    values = {name: _field(server_args, name) for name in sorted(IDENTITY) if with_path or name != "model_path"}
    # the version SGLang serves now: a backend attached after a named weight update names the new weights
    values["weight_version"] = served_weight_version() or values["weight_version"]
    blob = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str).encode()
    out = f"sglang={hashlib.blake2b(blob, digest_size=8, person=b'dtkv-sgl-args').hexdigest()}"
    commit = hub_commit(str(_field(server_args, "model_path") or ""), _field(server_args, "revision"),
                        _field(server_args, "download_dir"))
    return f"{out}|commit={commit}" if commit else out


def _field(server_args: Any, name: str) -> Any:
    """A field as SGLang's resolution left it (``auto`` dtypes, derived sizes), else as given."""
    try:
        from sglang.srt.arg_groups.overrides import resolution_result

        return resolution_result(server_args, name, None)
    except ImportError:
        return getattr(server_args, name, None)


def hub_commit(model: str, revision: str | None, cache_dir: str | None = None) -> str:
    """The commit a hub model's revision (``main`` when none) resolves to in the Hugging Face cache
    SGLang downloaded it to (``--download-dir``, else the default hub cache) before the backend
    starts; "" for a local path; the revision itself when it already is a commit. A moving branch
    then names its weights. Without ``cache_dir`` this is the vLLM side's rule (``hub_commit``)."""
    if not model or Path(model).exists():
        return ""
    if cache_dir is None or (revision and _COMMIT.fullmatch(revision)):
        commit = vllm_hub_commit(model, revision)
    else:
        repo = Path(cache_dir) / f"models--{model.replace('/', '--')}"
        try:
            commit = (repo / "refs" / (revision or "main")).read_text().strip()
        except OSError:
            commit = ""
        commit = commit if _COMMIT.fullmatch(commit) and (repo / "snapshots" / commit).is_dir() else ""
    if not commit:
        log.warning("no snapshot of %s@%s in the Hugging Face cache: the identity names the revision, not "
                    "its commit", model, revision or "main")
    return commit


def namespace_for(shape: BlockShape, *, model_id: str, kv_dtype: str, ranks: Ranks, is_mla: bool,
                  tenant_salt: str) -> Namespace:
    """The layout field is the canonical format (not the host layout): every SGLang host layout
    stores the same canonical bytes, so a restart with another ``--hicache-mem-layout`` still hits."""
    tp_rank, tp_size = (0, 1) if is_mla else (ranks.tp_rank, ranks.tp_size)
    return Namespace(model_id, kv_dtype, shape.canonical.name, shape.block_size, shape.num_layers,
                     shape.num_kv_heads, shape.head_size, tp_rank, tp_size, tenant_salt=tenant_salt,
                     pp_rank=ranks.pp_rank, pp_size=ranks.pp_size)


def page_keys(namespace: Namespace, page_hashes: Sequence[str], epoch: bytes = b"") -> list[BlockKey]:
    """Store keys of SGLang page hashes; ``epoch`` (empty until a cache reset) makes older keys unreachable."""
    return [engine_block_key(namespace, ROOT_KEY, epoch + h.encode()) for h in page_hashes]
