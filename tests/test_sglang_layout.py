"""SGLang host layouts -> canonical records (``EngineLayout.from_sglang_host``).

Two oracles that never use our views: SGLang's own ``get_data_page`` (each host layout's page,
permuted by hand to the canonical order), and vLLM's FlashAttention / MLA layouts holding the
same KV, whose records must carry the same payload bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynamo_tiered_kv.blocks.codec import decode_block, encode_blocks, record_bytes
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.errors import LayoutMismatch

L, H, D, PS, PAGES = 3, 2, 16, 4, 8
NS, KEY, PARENT = b"n" * 16, b"k" * 16, b"p" * 16


def _records(layout: EngineLayout, blocks: list[int]) -> np.ndarray:
    rb = record_bytes(layout.shape)
    out = np.zeros(len(blocks) * rb, np.uint8)
    encode_blocks(layout, blocks, [NS] * len(blocks), [KEY] * len(blocks), [PARENT] * len(blocks), out)
    return out.reshape(len(blocks), rb)


def _payload(layout: EngineLayout, block: int) -> bytes:
    from dynamo_tiered_kv.blocks.codec import payload_view

    return payload_view(_records(layout, [block])[0]).tobytes()


def _random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)


def _canonical_from_sglang_page(page: torch.Tensor, layout: str) -> bytes:
    """SGLang's ``get_data_page(flat=False)`` -> [layer][K/V][token][head][dim] bytes, by hand."""
    if layout == "layer_first":  # [2, L, ps, H, D]
        c = page.permute(1, 0, 2, 3, 4)
    elif layout == "page_first":  # [2, ps, L, H, D]
        c = page.permute(2, 0, 1, 3, 4)
    elif layout == "page_first_direct":  # [2, 1, L, ps, H, D]
        c = page[:, 0].permute(1, 0, 2, 3, 4)
    else:  # page_head [2, 1, H, ps, L, D]
        c = page[:, 0].permute(3, 0, 2, 1, 4)
    return c.contiguous().view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_every_sglang_mha_layout_matches_sglangs_own_pages(layout: str) -> None:
    pytest.importorskip("sglang", reason="sglang 0.5.23 not installed (bash .ci/install-sglang.sh)")
    from dynamo_tiered_kv.testing import sglang_host as sh

    sgl = sh.load_sglang()
    pool = sh.mha_host_pool(sgl, layout, layers=L, heads=H, head_dim=D, page_size=PS, pages=PAGES)
    pool.kv_buffer.copy_(_random(tuple(pool.kv_buffer.shape), 7))
    eng = EngineLayout.from_sglang_host(pool.kv_buffer, layout, PS, mla=False)
    assert (eng.shape.num_layers, eng.shape.block_size, eng.shape.num_kv_heads, eng.shape.head_size) == (L, PS, H, D)
    assert eng.num_blocks == PAGES
    for page in (0, 3, PAGES - 1):
        want = _canonical_from_sglang_page(pool.get_data_page(page * PS, flat=False), layout)
        assert _payload(eng, page) == want


def test_sglang_page_first_record_equals_vllm_flash_attention_record() -> None:
    """Same model shape, same KV: payload and every header byte but the informational
    ``engine_layout`` (66) and the header checksum over it (120-127) are identical, and each
    engine's layout decodes the other's record into the right place."""
    kv = _random((2, PAGES * PS, L, H, D), 11)  # SGLang page_first [2, tokens, layers, heads, dim]
    sgl = EngineLayout.from_sglang_host(kv, "page_first", PS, mla=False)
    fa = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=L, num_blocks=PAGES, block_size=PS,
                            num_kv_heads=H, head_size=D)
    for layer in range(L):
        fa[layer].copy_(kv[:, :, layer].reshape(2, PAGES, PS, H, D))
    vllm = EngineLayout(EngineLayoutKind.FLASH_ATTN, fa, PS, H, D)
    assert sgl.shape == vllm.shape
    a, b = _records(sgl, [5])[0], _records(vllm, [5])[0]
    diff = np.flatnonzero(a != b)
    assert diff.tolist() == [66, *range(120, 128)]
    decode_block(a, vllm, 2, namespace=NS, key=KEY)  # SGLang's record into a vLLM block
    assert torch.equal(fa[1][:, 2].view(torch.int16), kv[:, 5 * PS:6 * PS, 1].view(torch.int16))
    decode_block(b, sgl, 0, namespace=NS, key=KEY)  # vLLM's record into a SGLang host page
    assert torch.equal(kv[:, 0:PS].view(torch.int16), kv[:, 5 * PS:6 * PS].view(torch.int16))


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_sglang_mla_layouts_match_vllm_mla(layout: str) -> None:
    dim = 24
    lat = _random((L, PAGES * PS, dim), 13)  # per layer, per token: the latent
    if layout == "layer_first":  # [L, T, 1, dim]
        buf = lat.unsqueeze(2).contiguous()
    elif layout == "page_first":  # [T, L, 1, dim]
        buf = lat.permute(1, 0, 2).unsqueeze(2).contiguous()
    else:  # [P, L, ps, 1, dim]
        buf = lat.reshape(L, PAGES, PS, dim).permute(1, 0, 2, 3).unsqueeze(3).contiguous()
    sgl = EngineLayout.from_sglang_host(buf, layout, PS, mla=True)
    mla = [lat[j].reshape(PAGES, PS, dim).contiguous() for j in range(L)]  # vLLM MLA [blocks, bs, dim]
    vllm = EngineLayout(EngineLayoutKind.MLA, mla, PS, 1, dim)
    assert sgl.shape == vllm.shape
    for page in (0, PAGES - 1):
        assert _payload(sgl, page) == _payload(vllm, page)


def test_unmapped_layout_is_refused() -> None:
    with pytest.raises(LayoutMismatch, match="page_unified"):
        EngineLayout.from_sglang_host(torch.zeros(2, 8, 2, 2, 4), "page_unified", 4, mla=False)
    with pytest.raises(LayoutMismatch, match="page_head"):
        EngineLayout.from_sglang_host(torch.zeros(2, 2, 1, 4, 2, 4), "page_head", 4, mla=True)
