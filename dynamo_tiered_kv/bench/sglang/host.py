"""SGLang's own host KV pools on CPU tensors, and our backend built the way SGLang builds it.

For tests and ``dtkv bench sglang``. Needs sglang 0.5.23 (``.ci/install-sglang.sh``).

One workaround, for import only: ``sglang.srt.configs`` (which the host pool modules import)
loads every model config at import, and two of them (InternVL, DeepSeek-OCR image processing)
import ``torchvision`` at module level. PyPI's torchvision wheels are CUDA builds that fail to
import against this CPU torch ("operator torchvision::nms does not exist"), so when torchvision
cannot be imported, ``load_sglang`` puts a placeholder (``InterpolationMode`` only) in
``sys.modules`` after transformers has decided that torchvision is absent. Nothing on the KV
path touches it; the backend module itself imports without it.
"""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

SGLANG_VERSION = "0.5.23"


def _torchvision_placeholder() -> None:
    try:
        import torchvision  # noqa: F401
        return
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]  # a half-imported CUDA build
    # transformers decides "no torchvision" at import: let it decide before the placeholder exists
    import transformers.image_utils
    import transformers.modeling_utils  # noqa: F401

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    tv, tr, fn = (types.ModuleType(n) for n in ("torchvision", "torchvision.transforms",
                                                "torchvision.transforms.functional"))
    tv.__path__, tr.__path__ = [], []  # type: ignore[attr-defined]
    fn.InterpolationMode = tr.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    tr.functional, tv.transforms = fn, tr  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tr, "torchvision.transforms.functional": fn})


@dataclass(frozen=True)
class Sglang:
    """The SGLang classes the tests and the bench drive."""

    version: str
    HiCacheStorageConfig: Any
    HiCacheStorageExtraInfo: Any
    StorageBackendFactory: Any
    MHATokenToKVPoolHost: Any
    MHABufferInfo: Any
    KVBuffers: Any
    KVBufferLayout: Any
    get_hash_str: Any
    MLATokenToKVPoolHost: Any
    MLABufferInfo: Any


def load_sglang() -> Sglang:
    """Import SGLang's storage interface, backend factory and host pools (raises ImportError if absent)."""
    import sglang

    _torchvision_placeholder()
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    return Sglang(sglang.__version__, HiCacheStorageConfig, HiCacheStorageExtraInfo, StorageBackendFactory,
                  MHATokenToKVPoolHost, MHABufferInfo, KVBuffers, KVBufferLayout, get_hash_str,
                  MLATokenToKVPoolHost, MLABufferInfo)


def mha_host_pool(sgl: Sglang, layout: str, *, layers: int, heads: int, head_dim: int, page_size: int,
                  pages: int, dtype: torch.dtype = torch.bfloat16) -> Any:
    """SGLang's ``MHATokenToKVPoolHost`` on CPU memory, sized for ``pages`` host pages.

    The "device" pool it mirrors is CPU tensors too: the host pool only reads its geometry here.
    """
    dev_tokens = page_size * 2
    k = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (k, v)]
    info = sgl.MHABufferInfo(
        buffers=sgl.KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=sgl.KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
        device=torch.device("cpu"))
    return sgl.MHATokenToKVPoolHost(info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers,
                                    host_token_capacity=pages * page_size)


def mla_host_pool(sgl: Sglang, layout: str, *, layers: int, kv_lora_rank: int, rope_dim: int, page_size: int,
                  pages: int, dtype: torch.dtype = torch.bfloat16) -> Any:
    """SGLang's ``MLATokenToKVPoolHost`` on CPU memory: one latent of ``kv_lora_rank + rope_dim`` per token."""
    dim, dev_tokens = kv_lora_rank + rope_dim, page_size * 2
    bufs = tuple(torch.zeros(dev_tokens, 1, dim, dtype=dtype) for _ in range(layers))
    info = sgl.MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
                             layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page_size,
                             kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, kv_cache_dim=dim, dtype=dtype,
                             device=torch.device("cpu"))
    return sgl.MLATokenToKVPoolHost(info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers,
                                    target_layer_num=layers, host_token_capacity=pages * page_size)


def storage_config(sgl: Sglang, extra: dict[str, Any], *, model_name: str = "test-model", tp_rank: int = 0,
                   tp_size: int = 1, is_mla: bool = False, page_first: bool = True) -> Any:
    """A ``HiCacheStorageConfig`` as SGLang's cache controller fills it for a ``dynamic`` backend."""
    return sgl.HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                    attn_cp_size=1, is_mla_model=is_mla, enable_storage_metrics=False,
                                    is_page_first_layout=page_first, model_name=model_name,
                                    extra_config=dict(extra))


def attach(sgl: Sglang, config: Any, host_pool: Any) -> Any:
    """What ``HiCacheController.attach_storage_backend`` does: the factory's ``dynamic`` path, then
    the host pool registration."""
    backend = sgl.StorageBackendFactory.create_backend("dynamic", config, host_pool)
    backend.register_mem_pool_host(host_pool)
    backend.on_host_pools_registered()
    return backend


def backend_extra(**settings: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` JSON for our backend, plus tier settings."""
    return {"backend_name": "dynamo_tiered_kv", "module_path": "dynamo_tiered_kv.connectors.sglang",
            "class_name": "TieredHiCacheStorage", "interface_v1": 1, **settings}


def page_hashes(sgl: Sglang, tokens: list[int], page_size: int, prior: str | None = None) -> list[str]:
    """SGLang's own storage page hashes of ``tokens`` (full pages only)."""
    out: list[str] = []
    for i in range(0, len(tokens) - page_size + 1, page_size):
        prior = sgl.get_hash_str(tokens[i:i + page_size], prior)
        out.append(prior)
    return out
