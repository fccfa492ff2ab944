"""Engine KV layouts and the canonical per-block layout they map to.

Canonical block (what a stored record's payload holds), layer-major so that a layer range is a
byte range::

    payload = layer[0] | layer[1] | ... | layer[L-1]
    KV_SPLIT  layer = K[block_size][kv_heads][head_size] | V[block_size][kv_heads][head_size]
    MLA       layer = latent[block_size][dim]                      (kv_heads = 1, head_size = dim)
    VLLM_CPU  layer = the engine's own block bytes [kv_heads][block_size][2*head_size], opaque

Engine layouts (per-layer tensors unless noted) and the canonical format each maps to:

    FLASH_ATTN   [2, num_blocks, block_size, kv_heads, head_size]   -> KV_SPLIT
    FLASHINFER   [num_blocks, 2, block_size, kv_heads, head_size]   -> KV_SPLIT
    KVBM_FC      one tensor [num_blocks, layers, 2, block_size, kv_heads*head_size] -> KV_SPLIT
    MLA          [num_blocks, block_size, dim]                      -> MLA
    VLLM_CPU     [num_blocks, kv_heads, block_size, 2*head_size]    -> VLLM_CPU (packing is the
                 CPU attention backend's; stored as-is, restorable only into the same layout)

SGLang HiCache host pools (one tensor for all layers; a "block" is a host page of ``page_size``
tokens, ``from_sglang_host``):

    SGL_LAYER_FIRST        [2, layers, tokens, heads, head_dim]              -> KV_SPLIT
    SGL_PAGE_FIRST         [2, tokens, layers, heads, head_dim]              -> KV_SPLIT
    SGL_PAGE_FIRST_DIRECT  [2, pages, layers, page_size, heads, head_dim]    -> KV_SPLIT
    SGL_PAGE_HEAD          [2, pages, heads, page_size, layers, head_dim]    -> KV_SPLIT
    SGL_MLA_LAYER_FIRST    [layers, tokens, 1, dim]                          -> MLA
    SGL_MLA_PAGE_FIRST     [tokens, layers, 1, dim]                          -> MLA
    SGL_MLA_PAGE_FIRST_DIRECT [pages, layers, page_size, 1, dim]             -> MLA

Blocks written from FlashAttention restore into FlashInfer and KVBM and back, since they share
the KV_SPLIT canonical format; a SGLang host page of the same model shape holds the same canonical
payload bytes as a vLLM block of the same tokens (tests/test_sglang_layout.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from ..errors import LayoutMismatch


class CanonicalFormat(IntEnum):
    KV_SPLIT = 1
    MLA = 2
    VLLM_CPU = 3


class EngineLayoutKind(IntEnum):
    FLASH_ATTN = 1
    FLASHINFER = 2
    KVBM_FC = 3
    MLA = 4
    VLLM_CPU = 5
    SGL_LAYER_FIRST = 6
    SGL_PAGE_FIRST = 7
    SGL_PAGE_FIRST_DIRECT = 8
    SGL_PAGE_HEAD = 9
    SGL_MLA_LAYER_FIRST = 10
    SGL_MLA_PAGE_FIRST = 11
    SGL_MLA_PAGE_FIRST_DIRECT = 12


#: SGLang ``--hicache-mem-layout`` names -> (MHA kind, MLA kind); None: not mapped
SGLANG_HOST_LAYOUTS: Mapping[str, tuple[EngineLayoutKind, EngineLayoutKind | None]] = {
    "layer_first": (EngineLayoutKind.SGL_LAYER_FIRST, EngineLayoutKind.SGL_MLA_LAYER_FIRST),
    "page_first": (EngineLayoutKind.SGL_PAGE_FIRST, EngineLayoutKind.SGL_MLA_PAGE_FIRST),
    "page_first_direct": (EngineLayoutKind.SGL_PAGE_FIRST_DIRECT, EngineLayoutKind.SGL_MLA_PAGE_FIRST_DIRECT),
    "page_head": (EngineLayoutKind.SGL_PAGE_HEAD, None),
}


CANONICAL_OF: Mapping[EngineLayoutKind, CanonicalFormat] = {
    EngineLayoutKind.FLASH_ATTN: CanonicalFormat.KV_SPLIT,
    EngineLayoutKind.FLASHINFER: CanonicalFormat.KV_SPLIT,
    EngineLayoutKind.KVBM_FC: CanonicalFormat.KV_SPLIT,
    EngineLayoutKind.MLA: CanonicalFormat.MLA,
    EngineLayoutKind.VLLM_CPU: CanonicalFormat.VLLM_CPU,
    **{k: CanonicalFormat.KV_SPLIT for k in (EngineLayoutKind.SGL_LAYER_FIRST, EngineLayoutKind.SGL_PAGE_FIRST,
                                             EngineLayoutKind.SGL_PAGE_FIRST_DIRECT, EngineLayoutKind.SGL_PAGE_HEAD)},
    **{k: CanonicalFormat.MLA for k in (EngineLayoutKind.SGL_MLA_LAYER_FIRST, EngineLayoutKind.SGL_MLA_PAGE_FIRST,
                                        EngineLayoutKind.SGL_MLA_PAGE_FIRST_DIRECT)},
}


class DType(IntEnum):
    """On-disk dtype codes (FORMAT.md). fp8 variants are stored as their raw byte."""

    BFLOAT16 = 1
    FLOAT16 = 2
    FLOAT32 = 3
    FP8_E4M3 = 4
    FP8_E5M2 = 5
    UINT8 = 6
    INT8 = 7

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2 if self in (DType.BFLOAT16, DType.FLOAT16) else 1

    @classmethod
    def from_torch(cls, dt: torch.dtype) -> DType:
        table = {
            torch.bfloat16: cls.BFLOAT16,
            torch.float16: cls.FLOAT16,
            torch.float32: cls.FLOAT32,
            torch.uint8: cls.UINT8,
            torch.int8: cls.INT8,
        }
        for name, code in (("float8_e4m3fn", cls.FP8_E4M3), ("float8_e5m2", cls.FP8_E5M2)):
            if hasattr(torch, name):
                table[getattr(torch, name)] = code
        try:
            return table[dt]
        except KeyError:
            raise LayoutMismatch(f"unsupported KV dtype {dt}") from None


@dataclass(frozen=True)
class BlockShape:
    """Shape of one canonical block: the layout descriptor stored in every record."""

    canonical: CanonicalFormat
    dtype: DType
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"BlockShape.{name} must be positive")

    @functools.cached_property
    def planes(self) -> int:
        """2 for K and V, 1 for MLA's single latent."""
        return 1 if self.canonical is CanonicalFormat.MLA else 2

    @functools.cached_property
    def layer_bytes(self) -> int:
        return self.planes * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @functools.cached_property
    def payload_bytes(self) -> int:
        return self.num_layers * self.layer_bytes


def _u8(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a tensor's last dim as bytes (works for bf16/fp8, which numpy lacks)."""
    if t.dtype == torch.uint8:
        return t
    return t.view(torch.uint8)


class EngineLayout:
    """Binds an engine's KV tensors to a BlockShape and copies blocks between them and records.

    ``layer_views`` are per-layer byte views ``[block][plane][bytes]`` (numpy on CPU, torch on
    CUDA) built once, which the codec and ``kernels/`` copy from and to. ``gather_layer`` copies
    one layer of one block into a 1-D uint8 destination (tools and tests); on CUDA the copy is
    asynchronous and the caller synchronizes before reading the bytes.
    """

    def __init__(
        self, kind: EngineLayoutKind, layers: Sequence[torch.Tensor], block_size: int, num_kv_heads: int, head_size: int
    ) -> None:
        if not layers:
            raise LayoutMismatch("no KV tensors given")
        if kind.name.startswith("SGL_"):  # one SGLang host buffer for all layers; a block is a host page
            views, heads, hs = _sglang_views(kind, layers[0], block_size)
            if CANONICAL_OF[kind] is CanonicalFormat.KV_SPLIT and (heads, hs) != (num_kv_heads, head_size):
                raise LayoutMismatch(f"{kind.name} buffer has {heads} heads of {hs}, expected {num_kv_heads} of "
                                     f"{head_size}")
            self._adopt(kind, layers[:1], views, BlockShape(CANONICAL_OF[kind], DType.from_torch(layers[0].dtype),
                                                            len(views), block_size, heads, hs))
            return
        self.kind = kind
        self.device = layers[0].device
        num_layers = layers[0].shape[1] if kind is EngineLayoutKind.KVBM_FC else len(layers)
        if kind is EngineLayoutKind.MLA and num_kv_heads != 1:
            raise LayoutMismatch("MLA layouts have a single latent per token (num_kv_heads=1)")
        self.shape = BlockShape(
            CANONICAL_OF[kind], DType.from_torch(layers[0].dtype), num_layers, block_size, num_kv_heads, head_size
        )
        t0 = layers[0]
        for t in layers[1:]:  # block ids are checked once against all layers: geometry must match
            if t.shape != t0.shape or t.dtype != t0.dtype or t.stride() != t0.stride() or t.device != t0.device:
                raise LayoutMismatch(
                    f"KV tensors differ across layers: {tuple(t.shape)} {t.dtype} vs {tuple(t0.shape)} {t0.dtype}"
                )
        self.tensors = list(layers)
        self.is_cuda = self.device.type == "cuda"
        views = [self._block_view(t) for t in layers]
        if kind is EngineLayoutKind.KVBM_FC:  # one tensor -> a [block][1][bytes] view per layer
            views = [views[0][:, j].unsqueeze(1) for j in range(num_layers)]
        self.num_blocks = int(views[0].shape[0])
        #: per layer, a byte view indexed [block][plane][bytes]; numpy on CPU, torch on CUDA
        self.layer_views = views if self.is_cuda else [v.numpy() for v in views]
        self._fast = False  # built on first use by fast_table()

    def _block_view(self, t: torch.Tensor) -> torch.Tensor:
        """A uint8 view indexed [block][plane][bytes] (plane count = 1 if contiguous per block)."""
        s, kind = self.shape, self.kind
        inner = s.block_size * s.num_kv_heads * s.head_size
        expect: tuple[int, ...]
        if kind is EngineLayoutKind.FLASH_ATTN:
            expect = (2, t.shape[1], s.block_size, s.num_kv_heads, s.head_size)
        elif kind is EngineLayoutKind.FLASHINFER:
            expect = (t.shape[0], 2, s.block_size, s.num_kv_heads, s.head_size)
        elif kind is EngineLayoutKind.MLA:
            expect = (t.shape[0], s.block_size, s.head_size)
        elif kind is EngineLayoutKind.VLLM_CPU:
            expect = (t.shape[0], s.num_kv_heads, s.block_size, 2 * s.head_size)
        else:  # KVBM_FC: one tensor for all layers
            expect = (t.shape[0], t.shape[1], 2, s.block_size, s.num_kv_heads * s.head_size)
        if tuple(t.shape) != expect:
            raise LayoutMismatch(f"{kind.name} tensor shape {tuple(t.shape)} != expected {expect}")
        if not t.is_contiguous():
            return self._strided_view(t)
        b = _u8(t)
        isz = s.dtype.itemsize
        if kind is EngineLayoutKind.FLASH_ATTN:
            return b.reshape(2, t.shape[1], inner * isz).transpose(0, 1)  # [block][K/V][bytes]
        if kind is EngineLayoutKind.KVBM_FC:
            return b.reshape(t.shape[0], s.num_layers, s.layer_bytes)  # [block][layer][bytes]
        return b.reshape(t.shape[0], 1, s.layer_bytes)  # block-contiguous per layer

    def _strided_view(self, t: torch.Tensor) -> torch.Tensor:
        """A non-contiguous KV tensor (vLLM's HND cache layout: the logical shape above over memory
        ordered [block][heads][tokens][dim]) as [block][plane][tokens][heads][bytes] views in canonical
        order: records hold the same bytes as from the NHD layout, and the codec's strided paths
        copy them. Only the head dimension must be contiguous."""
        kind = self.kind
        if kind not in (EngineLayoutKind.FLASH_ATTN, EngineLayoutKind.FLASHINFER, EngineLayoutKind.MLA):
            raise LayoutMismatch(f"{kind.name} KV tensor must be contiguous")
        if t.stride(-1) != 1:
            raise LayoutMismatch(f"{kind.name} KV tensor's head dimension is strided {tuple(t.stride())}")
        b = _u8(t)
        if kind is EngineLayoutKind.FLASH_ATTN:
            return b.transpose(0, 1)  # [block][K/V][tokens][heads][bytes]
        if kind is EngineLayoutKind.FLASHINFER:
            return b
        return b.unsqueeze(1)  # MLA: [block][1][tokens][bytes]

    def fast_table(self):  # -> fast.LayerTable | None
        """Geometry for the compiled CPU helpers, or None (CUDA, not built, or odd strides)."""
        if self._fast is False:
            from .._native import fast

            table = None
            if fast.AVAILABLE and not self.is_cuda:
                try:
                    table = fast.LayerTable(self.layer_views)
                except ValueError:
                    table = None
            self._fast = table
        return self._fast

    def gather_layer(self, block_id: int, layer: int, dest) -> None:  # dest: np.ndarray | Tensor
        src = self.layer_views[layer][block_id]
        if self.is_cuda:
            dest.view(src.shape).copy_(src, non_blocking=True)
        else:
            np.copyto(dest.reshape(src.shape), src)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()

    @classmethod
    def from_vllm(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        *,
        is_mla: bool = False,
    ) -> EngineLayout:
        """Detect the layout from vLLM's ``register_kv_caches`` tensors (ordered by layer name)."""
        tensors = list(kv_caches.values())
        t = tensors[0]
        if is_mla or t.dim() == 3:
            return cls(EngineLayoutKind.MLA, tensors, block_size, 1, t.shape[-1])
        if t.dim() == 5 and t.shape[0] == 2 and t.shape[2:] == (block_size, num_kv_heads, head_size):
            return cls(EngineLayoutKind.FLASH_ATTN, tensors, block_size, num_kv_heads, head_size)
        if t.dim() == 5 and t.shape[1] == 2:
            return cls(EngineLayoutKind.FLASHINFER, tensors, block_size, num_kv_heads, head_size)
        if t.dim() == 4 and t.shape[1:] == (num_kv_heads, block_size, 2 * head_size):
            return cls(EngineLayoutKind.VLLM_CPU, tensors, block_size, num_kv_heads, head_size)
        raise LayoutMismatch(
            f"unrecognised KV cache tensor shape {tuple(t.shape)} for block_size={block_size}, "
            f"kv_heads={num_kv_heads}, head_size={head_size}"
        )

    @classmethod
    def from_sglang_host(cls, kv_buffer: torch.Tensor, layout: str, page_size: int, *, mla: bool) -> EngineLayout:
        """Bind a SGLang HiCache host pool's ``kv_buffer`` (``HostKVCache.kv_buffer``); block = host page.

        Each layer's view is ``[page][plane][...]`` with the trailing dims in canonical order
        (token, head, dim), so the codec copies a page's layer straight into a record and back:
        one copy, no intermediate page. Layouts whose per-layer plane is contiguous
        (layer_first, page_first_direct) use the compiled gather/verify; page_first and page_head
        interleave layers per token, so their planes are strided and take the numpy path.
        """
        kinds = SGLANG_HOST_LAYOUTS.get(layout)
        kind = None if kinds is None else kinds[1 if mla else 0]
        if kind is None:
            raise LayoutMismatch(f"SGLang host layout {layout!r} ({'MLA' if mla else 'MHA'}) is not mapped; "
                                 f"use one of {sorted(k for k, v in SGLANG_HOST_LAYOUTS.items() if v[int(mla)])}")
        _, heads, head_size = _sglang_views(kind, kv_buffer, page_size)
        return cls(kind, [kv_buffer], page_size, heads, head_size)

    def _adopt(self, kind: EngineLayoutKind, tensors: Sequence[torch.Tensor], views: Sequence[torch.Tensor],
               shape: BlockShape) -> None:
        """Bind ready-made per-layer byte views ``[block][plane][...]`` (canonical order)."""
        per_layer = int(np.prod(views[0].shape[1:]))
        if per_layer != shape.layer_bytes:
            raise LayoutMismatch(f"{kind.name}: a layer view holds {per_layer} bytes, the canonical layer "
                                 f"{shape.layer_bytes}")
        self.kind, self.shape, self.tensors = kind, shape, list(tensors)
        self.device = tensors[0].device
        self.is_cuda = self.device.type == "cuda"
        self.num_blocks = int(views[0].shape[0])
        self.layer_views = list(views) if self.is_cuda else [v.numpy() for v in views]
        self._fast = False


def _sglang_views(kind: EngineLayoutKind, kv_buffer: torch.Tensor, ps: int) -> tuple[list[torch.Tensor], int, int]:
    """Per-layer byte views ``[page][plane][...]`` (canonical order) of a SGLang host ``kv_buffer``,
    and its KV heads and head size (1 and the latent width for MLA)."""
    if not kv_buffer.is_contiguous():
        raise LayoutMismatch("SGLang host kv_buffer must be contiguous")
    b = _u8(kv_buffer)
    views: list[torch.Tensor]
    try:
        if kind is EngineLayoutKind.SGL_MLA_LAYER_FIRST:  # [L, T, 1, dim]
            L, T = kv_buffer.shape[0], kv_buffer.shape[1]
            r = b.reshape(L, T // ps, 1, ps * b.shape[-1])
            views = [r[j] for j in range(L)]
        elif kind is EngineLayoutKind.SGL_MLA_PAGE_FIRST:  # [T, L, 1, dim]
            T, L = kv_buffer.shape[0], kv_buffer.shape[1]
            r = b.reshape(T // ps, ps, L, b.shape[-1])
            views = [r[:, :, j].unsqueeze(1) for j in range(L)]
        elif kind is EngineLayoutKind.SGL_MLA_PAGE_FIRST_DIRECT:  # [P, L, ps, 1, dim]
            L = kv_buffer.shape[1]
            r = b.reshape(kv_buffer.shape[0], L, 1, ps * b.shape[-1])
            views = [r[:, j] for j in range(L)]
        elif kind is EngineLayoutKind.SGL_LAYER_FIRST:  # [2, L, T, H, D]; K is [0], V is [1]
            _, L, T, heads, _ = kv_buffer.shape
            r = b.reshape(2, L, T // ps, ps * heads * b.shape[-1])
            views = [r[:, j].transpose(0, 1) for j in range(L)]
        elif kind is EngineLayoutKind.SGL_PAGE_FIRST:  # [2, T, L, H, D]
            _, T, L, heads, _ = kv_buffer.shape
            r = b.reshape(2, T // ps, ps, L, heads * b.shape[-1])
            views = [r[:, :, :, j].transpose(0, 1) for j in range(L)]
        elif kind is EngineLayoutKind.SGL_PAGE_FIRST_DIRECT:  # [2, P, L, ps, H, D]
            _, P, L, _, heads, _ = kv_buffer.shape
            r = b.reshape(2, P, L, ps * heads * b.shape[-1])
            views = [r[:, :, j].transpose(0, 1) for j in range(L)]
        elif kind is EngineLayoutKind.SGL_PAGE_HEAD:  # [2, P, H, ps, L, D] -> per layer [P][2][ps][H][D]
            heads, L = kv_buffer.shape[2], kv_buffer.shape[4]
            views = [b[:, :, :, :, j].permute(1, 0, 3, 2, 4) for j in range(L)]
        else:
            raise LayoutMismatch(f"{kind.name} is not a SGLang host layout")
    except (ValueError, RuntimeError) as e:  # wrong rank or a token count that is not whole pages
        raise LayoutMismatch(f"{kind.name} buffer {tuple(kv_buffer.shape)} does not split into pages of {ps}: {e}") \
            from None
    mla = CANONICAL_OF[kind] is CanonicalFormat.MLA
    return views, 1 if mla else int(heads), int(kv_buffer.shape[-1])


def allocate_engine_kv(
    kind: EngineLayoutKind,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """Allocate zeroed engine-shaped KV tensors (tests, benchmarks, the demo)."""
    shapes = {
        EngineLayoutKind.FLASH_ATTN: (2, num_blocks, block_size, num_kv_heads, head_size),
        EngineLayoutKind.FLASHINFER: (num_blocks, 2, block_size, num_kv_heads, head_size),
        EngineLayoutKind.MLA: (num_blocks, block_size, head_size),
        EngineLayoutKind.VLLM_CPU: (num_blocks, num_kv_heads, block_size, 2 * head_size),
    }
    if kind is EngineLayoutKind.KVBM_FC:
        return [
            torch.zeros(num_blocks, num_layers, 2, block_size, num_kv_heads * head_size, dtype=dtype, device=device)
        ]
    tokens = num_blocks * block_size
    sglang = {  # one host buffer for all layers (SGLang HiCache); MLA: one latent of head_size per token
        EngineLayoutKind.SGL_LAYER_FIRST: (2, num_layers, tokens, num_kv_heads, head_size),
        EngineLayoutKind.SGL_PAGE_FIRST: (2, tokens, num_layers, num_kv_heads, head_size),
        EngineLayoutKind.SGL_PAGE_FIRST_DIRECT: (2, num_blocks, num_layers, block_size, num_kv_heads, head_size),
        EngineLayoutKind.SGL_PAGE_HEAD: (2, num_blocks, num_kv_heads, block_size, num_layers, head_size),
        EngineLayoutKind.SGL_MLA_LAYER_FIRST: (num_layers, tokens, 1, head_size),
        EngineLayoutKind.SGL_MLA_PAGE_FIRST: (tokens, num_layers, 1, head_size),
        EngineLayoutKind.SGL_MLA_PAGE_FIRST_DIRECT: (num_blocks, num_layers, block_size, 1, head_size),
    }
    if kind in sglang:
        return [torch.zeros(sglang[kind], dtype=dtype, device=device)]
    return [torch.zeros(shapes[kind], dtype=dtype, device=device) for _ in range(num_layers)]
