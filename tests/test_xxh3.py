"""kernels.xxh3 matches xxhash.xxh3_64_intdigest bit for bit, on every length path and row layout."""

from __future__ import annotations

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_tiered_kv.kernels import to_unsigned, xxh3_64_rows
from dynamo_tiered_kv.kernels.xxh3 import _as_words

# Every XXH3 path and its edges: 0, 1-3, 4-8, 9-16, 17-128 (each 32-byte round), 129-240, and the long
# path around stripe (64 B) and block (1 KiB) boundaries.
LENGTHS = [0, 1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 32, 33, 64, 65, 96, 97, 100, 128, 129, 143, 144, 200, 240]
LENGTHS += [241, 255, 256, 1023, 1024, 1025, 1087, 1088, 2048 + 64, 4096, 65536, 65536 + 8]


def _expected(rows: torch.Tensor) -> list[int]:
    host = rows.cpu()
    return [xxhash.xxh3_64_intdigest(host[i].numpy().tobytes()) for i in range(host.shape[0])]


def _records(n: int, record_bytes: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n * record_bytes,), dtype=torch.uint8, generator=g).to(device)


def _layer_rows(n: int, length: int, offset: int, pad: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Rows as the codec lays out layers: a column slice of ``n`` records inside one flat buffer."""
    record_bytes = offset + length + pad
    return _records(n, record_bytes, seed, device).view(n, record_bytes)[:, offset : offset + length]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("offset", [0, 8, 3])  # 8-aligned rows (zero-copy word view) and unaligned ones
def test_matches_xxhash(length: int, offset: int) -> None:
    rows = _layer_rows(5, length, offset, pad=16, seed=length)
    assert to_unsigned(xxh3_64_rows(rows)) == _expected(rows)


@pytest.mark.parametrize("length", [1, 7, 16, 100, 240, 241, 1025, 4096])
def test_contiguous_and_single_row(length: int) -> None:
    rows = _records(37, length, seed=7).view(37, length)
    assert to_unsigned(xxh3_64_rows(rows)) == _expected(rows)
    assert to_unsigned(xxh3_64_rows(rows[11:12])) == _expected(rows[11:12])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 37),
    length=st.one_of(st.integers(0, 300), st.integers(0, 5000)),
    offset=st.integers(0, 24),
    pad=st.integers(0, 24),
    seed=st.integers(0, 2**31),
)
def test_random_layouts(n: int, length: int, offset: int, pad: int, seed: int) -> None:
    rows = _layer_rows(n, length, offset, pad, seed)
    assert to_unsigned(xxh3_64_rows(rows)) == _expected(rows)


def test_extreme_bytes() -> None:
    # All-0xFF rows drive every 32x32 product and carry to its maximum; all-zero rows to its minimum.
    for fill in (0, 255):
        rows = torch.full((3, 3000), fill, dtype=torch.uint8)
        assert to_unsigned(xxh3_64_rows(rows)) == _expected(rows)


def test_empty_batch_and_bad_input() -> None:
    assert xxh3_64_rows(torch.empty((0, 500), dtype=torch.uint8)).shape == (0,)
    with pytest.raises(ValueError):
        xxh3_64_rows(torch.zeros((2, 8), dtype=torch.int8))
    with pytest.raises(ValueError):
        xxh3_64_rows(torch.zeros(8, dtype=torch.uint8))


def test_non_contiguous_columns() -> None:
    base = _records(4, 2 * 600, seed=3).view(4, 1200)
    rows = base[:, ::2]  # stride 2 along the row: hashed from a compact copy
    assert to_unsigned(xxh3_64_rows(rows)) == _expected(rows)


def test_aligned_rows_are_not_copied() -> None:
    rows = _layer_rows(6, 1024, offset=16, pad=8, seed=1)
    words = _as_words(rows)
    assert words.data_ptr() == rows.data_ptr()
    assert to_unsigned(words[2, :1]) == [int.from_bytes(rows[2, :8].numpy().tobytes(), "little")]


def test_single_aligned_row_with_odd_record_stride() -> None:
    rows = _records(20, 241, seed=5).view(20, 241)[8:9]  # starts 8-aligned, row stride 241
    assert _as_words(rows[:, :192]).data_ptr() == rows.data_ptr()
    assert to_unsigned(xxh3_64_rows(rows)) == _expected(rows)


def test_to_unsigned() -> None:
    assert to_unsigned(torch.tensor([-1, 0, -(2**63), 5])) == [2**64 - 1, 0, 2**63, 5]


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 3])
def test_matches_xxhash_on_cuda(offset: int) -> None:
    for length in LENGTHS:
        rows = _layer_rows(9, length, offset, pad=16, seed=length, device="cuda")
        got = xxh3_64_rows(rows)
        assert got.device.type == "cuda"
        assert to_unsigned(got) == _expected(rows)
