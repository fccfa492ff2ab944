import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_tiered_kv.blocks.keys import (
    ROOT_KEY,
    Namespace,
    block_key,
    chain_engine_keys,
    chain_keys,
    parents_of,
)

NS = Namespace("meta-llama/Llama-3.1-8B", "bfloat16", "KV_SPLIT", 16, 32, 8, 128)


def test_namespace_digest_depends_on_every_field() -> None:
    base = NS.digest
    for change in (
        dict(model_id="x"),
        dict(kv_dtype="float16"),
        dict(layout="MLA"),
        dict(block_size=32),
        dict(num_layers=31),
        dict(num_kv_heads=4),
        dict(head_size=64),
        dict(tp_rank=1, tp_size=2),
        dict(tp_size=2),
        dict(tenant_salt="acme"),
    ):
        fields = {**NS.__dict__, **change}
        fields.pop("_digest", None)
        assert Namespace(**fields).digest != base, change


def test_tenant_salt_hidden_from_repr() -> None:
    assert "acme" not in repr(Namespace("m", "bf16", "KV_SPLIT", 16, 1, 1, 1, tenant_salt="acme"))


def test_invalid_namespace_rejected() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        Namespace("m", "bf16", "KV_SPLIT", 16, 1, 1, 1, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="block_size"):
        Namespace("m", "bf16", "KV_SPLIT", 0, 1, 1, 1)


@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=100))
def test_chain_is_prefix_stable(tokens: list[int]) -> None:
    keys = chain_keys(NS, tokens)
    assert len(keys) == len(tokens) // NS.block_size
    # a longer sequence shares the keys of its prefix; the chain encodes the whole prefix
    longer = chain_keys(NS, [*tokens, *range(NS.block_size)])
    assert longer[: len(keys)] == keys
    assert parents_of(keys) == ([ROOT_KEY, *keys[:-1]] if keys else [])


def test_same_tokens_different_prefix_differ() -> None:
    a = list(range(32))
    b = [7] * 16 + list(range(16, 32))
    assert chain_keys(NS, a)[1] != chain_keys(NS, b)[1]  # same 2nd block tokens, other parent


def test_token_range_checked() -> None:
    with pytest.raises(ValueError):
        block_key(NS, ROOT_KEY, [-1] * 16)


def test_engine_hash_chain_deterministic_and_distinct() -> None:
    hashes = [bytes([i]) * 32 for i in range(4)]
    k1 = chain_engine_keys(NS, hashes)
    assert k1 == chain_engine_keys(NS, hashes)
    assert len(set(k1)) == 4
    assert chain_engine_keys(NS, [int.from_bytes(h, "little") for h in hashes]) == k1
    salted = Namespace(**{**{k: v for k, v in NS.__dict__.items() if k != "_digest"}, "tenant_salt": "t2"})
    assert set(chain_engine_keys(salted, hashes)).isdisjoint(k1)


def test_keys_identical_across_processes() -> None:
    code = (
        "from dynamo_tiered_kv.blocks.keys import Namespace, chain_keys;"
        "ns=Namespace('meta-llama/Llama-3.1-8B','bfloat16','KV_SPLIT',16,32,8,128);"
        "print(','.join(k.hex() for k in chain_keys(ns, list(range(64)))))"
    )
    outs = set()
    for seed in ("0", "12345"):
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        outs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            ).stdout.strip()
        )
    assert outs == {",".join(k.hex() for k in chain_keys(NS, np.arange(64)))}
