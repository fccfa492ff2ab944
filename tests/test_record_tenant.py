"""Every record names its tenant (header bytes [112, 120), docs/FORMAT.md): written by every encode
path, covered by the header checksum, read back by ``decode_header`` and ``record_tenant``, and not
a reader's concern (records of any tenant decode where their keys match). Tenant ids are keyed
digests, never the tenant's name."""

import numpy as np
import pytest
import torch

from dynamo_tiered_kv._native import fast
from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.blocks.tenant import DEFAULT_TENANT, parse_tenant, tenant_hex, tenant_id
from dynamo_tiered_kv.errors import HeaderCorrupt

NS = Namespace("m", "bf16", "KV_SPLIT", 4, 3, 2, 8)
T1 = tenant_id("acme", deployment_salt="s3cret")


def _layout(seed: int) -> EngineLayout:
    ts = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2,
                            head_size=8, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 4, 2, 8)


def _encode(tenant: bytes, n: int = 3) -> tuple[EngineLayout, np.ndarray, list[bytes]]:
    src = _layout(1)
    keys = chain_keys(NS, list(range(4 * n)))
    rb = codec.record_bytes(src.shape)
    buf = np.zeros(n * rb, np.uint8)
    codec.encode_blocks(src, list(range(n)), [NS.digest] * n, keys, parents_of(keys), buf, tenant=tenant)
    return src, buf, keys


def test_every_record_of_a_batch_names_its_tenant() -> None:
    src, buf, _ = _encode(T1)
    rb = codec.record_bytes(src.shape)
    for i in range(3):
        rec = buf[i * rb : (i + 1) * rb]
        assert codec.decode_header(rec).tenant == T1
        assert codec.record_tenant(rec) == T1
        assert bytes(rec[112:120]) == T1


def test_records_without_a_tenant_are_the_default_tenant() -> None:
    _, buf, _ = _encode(DEFAULT_TENANT, 1)
    assert bytes(buf[112:120]) == bytes(8)  # the field readers of the old format saw as reserved
    assert codec.decode_header(buf).tenant == DEFAULT_TENANT
    assert codec.record_tenant(b"not a record at all, just bytes in a tier" * 4) == DEFAULT_TENANT


def test_the_header_checksum_covers_the_tenant() -> None:
    _, buf, _ = _encode(T1, 1)
    buf[115] ^= 1
    with pytest.raises(HeaderCorrupt):
        codec.decode_header(buf)


@pytest.mark.parametrize("native", [True, False])
def test_records_of_any_tenant_decode_in_both_codec_paths(native: bool, monkeypatch) -> None:
    if native and not fast.AVAILABLE:
        pytest.skip("compiled codec not built")
    if not native:
        monkeypatch.setattr(fast, "AVAILABLE", False)
    src, buf, keys = _encode(T1)
    dst = _layout(2)
    assert codec.decode_blocks(buf, dst, [3, 4, 5], namespace=NS.digest, keys=keys) == [None, None, None]
    for s, d in zip(src.layer_views, dst.layer_views, strict=True):
        for b in range(3):
            assert np.array_equal(np.asarray(s[b]), np.asarray(d[3 + b]))


def test_tenant_ids_are_keyed_digests_never_names() -> None:
    assert tenant_id(None) == DEFAULT_TENANT and tenant_id("") == DEFAULT_TENANT
    a, b = tenant_id("acme", deployment_salt="x"), tenant_id("acme", deployment_salt="y")
    assert a != b, "the deployment's salt keys the digest"
    assert a != tenant_id("acme2", deployment_salt="x")
    assert b"acme" not in a and len(a) == 8 and a != DEFAULT_TENANT
    # a deployment with a salt and no per-request names is one tenant, not the default one
    assert tenant_id(None, deployment_salt="x") not in (DEFAULT_TENANT, a)
    assert tenant_id("a" * 1000, deployment_salt="k" * 500) != tenant_id("a" * 1000, deployment_salt="k" * 499)


def test_tenants_named_on_a_command_line() -> None:
    assert parse_tenant("default") == DEFAULT_TENANT
    assert parse_tenant("acme", deployment_salt="s3cret") == T1
    assert parse_tenant(f"id:{tenant_hex(T1)}") == T1
    assert parse_tenant(f"id:{tenant_hex(T1).upper()}") == T1
    for bad in ("id:123", "id:zzzzzzzzzzzzzzzz", ""):
        with pytest.raises(ValueError):
            parse_tenant(bad)
