"""An independent reader written from docs/FORMAT.md alone must agree with the codec."""

import hashlib
import struct

import numpy as np
import torch
import xxhash

from dynamo_tiered_kv.blocks import codec
from dynamo_tiered_kv.blocks.keys import ROOT_KEY, Namespace, block_key
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv


def spec_align(n: int) -> int:
    return (n + 4095) // 4096 * 4096


def spec_read(rec: bytes) -> dict:
    f = struct.unpack_from("<8sHHI16s16s16sBBBBIIIIIQQQ8s", rec, 0)
    magic, version, _flags, hb, ns, key, parent, canon, dtype, _ek, algo, nl, bs, h, d, ntok, lb, pb, rb, _ = f
    assert magic == b"DTKVBLK\x00" and version == 1 and algo == 1
    assert hb == spec_align(128 + 8 * nl)
    table = rec[128 : 128 + 8 * nl]
    assert xxhash.xxh3_64_intdigest(rec[:120] + table) == struct.unpack_from("<Q", rec, 120)[0]
    itemsize = {1: 2, 2: 2, 3: 4, 4: 1, 5: 1, 6: 1, 7: 1}[dtype]
    planes = 1 if canon == 2 else 2
    assert lb == planes * bs * h * d * itemsize and pb == nl * lb and rb == hb + spec_align(pb) and ntok == bs
    sums = struct.unpack_from(f"<{nl}Q", rec, 128)
    layers = [rec[hb + j * lb : hb + (j + 1) * lb] for j in range(nl)]
    assert all(xxhash.xxh3_64_intdigest(x) == s for x, s in zip(layers, sums))
    return {"namespace": ns, "key": key, "parent": parent, "layers": layers, "bs": bs, "h": h, "d": d}


def spec_namespace(model, dtype, layout, salt, *ints) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=b"dtkv-ns-v2")
    for s in (model, dtype, layout, salt):
        b = s.encode()
        h.update(struct.pack("<I", len(b)) + b)
    h.update(struct.pack("<8q", *ints))
    return h.digest()


def test_independent_reader_agrees() -> None:
    ns = Namespace("m", "bfloat16", "KV_SPLIT", 4, 2, 2, 8, tenant_salt="t")
    assert ns.digest == spec_namespace("m", "bfloat16", "KV_SPLIT", "t", 4, 2, 2, 8, 0, 1, 0, 1)
    tokens = [1, 2, 3, 4]
    spec_key = hashlib.blake2b(
        ns.digest + ROOT_KEY + b"T" + np.array(tokens, "<u4").tobytes(), digest_size=16, person=b"dtkv-key-v2"
    ).digest()
    key = block_key(ns, ROOT_KEY, tokens)
    assert key == spec_key
    ts = allocate_engine_kv(
        EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_size=8
    )
    for t in ts:
        t.uniform_()
    lay = EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 4, 2, 8)
    rec = np.zeros(codec.record_bytes(lay.shape), np.uint8)
    codec.encode_block(lay, 1, ns.digest, key, ROOT_KEY, rec)
    got = spec_read(rec.tobytes())
    assert got["namespace"] == ns.digest and got["key"] == key and got["parent"] == ROOT_KEY
    for j, layer in enumerate(got["layers"]):
        kv = np.frombuffer(layer, dtype=np.uint16).reshape(2, 4, 2, 8)  # K[bs][h][d] then V[bs][h][d]
        assert np.array_equal(kv[0], ts[j][0, 1].view(torch.uint16).numpy())
        assert np.array_equal(kv[1], ts[j][1, 1].view(torch.uint16).numpy())
