"""XXH3-64 (seed 0, default secret) of many equal-length byte rows, in plain torch integer ops.

Bit-exact with ``xxhash.xxh3_64_intdigest``; runs unchanged on CPU and CUDA, so the GPUDirect path can
checksum layers without a host copy. All rows share one length, so every branch of XXH3 is chosen once
per call and the work is vectorized over rows (and, for long inputs, over stripes).

Never waits for the device: on CUDA every op is queued on the calling thread's current stream and
the call returns at once. Bytes are picked with slices, ``cat`` and ``flip`` (a Python list or host
tensor used as an index would be copied to the device with a stream synchronize), nothing is read
back to the host, and the key tables are copied from pinned memory without blocking, once per
stream (a table is only ever read on the stream that filled it, so no other stream can see it
half-written).

u64 arithmetic is emulated on int64: add/mul/xor/shift-left wrap to the same bits, but ``>>`` is
arithmetic, so logical shifts mask off the sign fill (``_lsr``). Bytes become words by reinterpreting
memory (``Tensor.view(dtype)``), which is little-endian on every device torch runs this on.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1

_P32_1 = 0x9E3779B1
_P32_2 = 0x85EBCA77
_P32_3 = 0xC2B2AE3D
_P64_1 = 0x9E3779B185EBCA87
_P64_2 = 0xC2B2AE3D27D4EB4F
_P64_3 = 0x165667B19E3779F9
_P64_4 = 0x85EBCA77C2B2AE63
_P64_5 = 0x27D4EB2F165667C5
_PMX1 = 0x165667919E3779F9
_PMX2 = 0x9FB21C651E98DF25

# XXH3_kSecret, the 192-byte default secret (xxhash.h).
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_STRIPE = 64
_STRIPES_PER_BLOCK = (len(_SECRET) - _STRIPE) // 8  # 16
_BLOCK = _STRIPE * _STRIPES_PER_BLOCK  # 1024
_SCRAMBLE_OFF = len(_SECRET) - _STRIPE  # 128
_LAST_STRIPE_OFF = len(_SECRET) - _STRIPE - 7  # 121
_MERGE_OFF = 11
_MID_START_OFF = 3
_MID_LAST_OFF = 136 - 17  # XXH3_SECRET_SIZE_MIN - XXH3_MIDSIZE_LASTOFFSET


def _s64(x: int) -> int:
    """u64 -> the int64 with the same bits (torch scalars must fit int64)."""
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


def _sec(off: int, width: int = 8) -> int:
    return int.from_bytes(_SECRET[off : off + width], "little")


class _Where(NamedTuple):
    """Where a call's tables live: the data's device and, on CUDA, the calling thread's current stream."""

    device: torch.device
    stream: int  # the CUDA stream handle; 0 off CUDA


def _where(device: torch.device) -> _Where:
    if device.type == "cuda":
        return _Where(device, torch.cuda.current_stream(device).cuda_stream)
    return _Where(device, 0)


@lru_cache(maxsize=1024)
def _table(values: tuple[int, ...], where: _Where) -> torch.Tensor:
    """Small int64 tables (secret keys, initial lanes), built once per device and stream.

    On CUDA the copy is queued from pinned memory without blocking the caller (a pageable copy waits
    for the stream), on ``where.stream``, which is the only stream that reads the result: work queued
    there after the copy sees the table. Torch keeps the pinned block until the copy has run.
    """
    host = torch.tensor([_s64(v) for v in values], dtype=torch.int64)
    if where.device.type == "cpu":
        return host
    if where.device.type == "cuda":
        return host.pin_memory().to(where.device, non_blocking=True)
    return host.to(where.device)


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x << r) | _lsr(x, 64 - r)


def _fold(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """XXH3_mul128_fold64: low ^ high of the 128-bit product, from 32-bit halves (each partial fits u64)."""
    al, ah = a & _M32, _lsr(a, 32)
    bl, bh = b & _M32, _lsr(b, 32)
    ll, hl, lh, hh = al * bl, ah * bl, al * bh, ah * bh
    cross = _lsr(ll, 32) + (hl & _M32) + lh
    upper = _lsr(hl, 32) + _lsr(cross, 32) + hh
    lower = (cross << 32) | (ll & _M32)
    return lower ^ upper


def _avalanche(h: torch.Tensor) -> torch.Tensor:
    h = h ^ _lsr(h, 37)
    h = h * _s64(_PMX1)
    return h ^ _lsr(h, 32)


def _xxh64_avalanche(h: torch.Tensor) -> torch.Tensor:
    h = h ^ _lsr(h, 33)
    h = h * _s64(_P64_2)
    h = h ^ _lsr(h, 29)
    h = h * _s64(_P64_3)
    return h ^ _lsr(h, 32)


def _rrmxmx(h: torch.Tensor, length: int) -> torch.Tensor:
    h = h ^ _rotl(h, 49) ^ _rotl(h, 24)
    h = h * _s64(_PMX2)
    h = h ^ (_lsr(h, 35) + length)
    h = h * _s64(_PMX2)
    return h ^ _lsr(h, 28)


def _read_le(data: torch.Tensor, offsets: list[int], width: int) -> torch.Tensor:
    """Little-endian words of ``width`` (4 or 8) bytes at byte ``offsets`` of every row -> int64 [..., len(offsets)].

    The words' bytes are sliced out (adjacent words as one run) and packed into fresh, aligned memory,
    which is then read as words.
    """
    runs: list[list[int]] = []  # [start, end) byte ranges, in offset order
    for o in offsets:
        if runs and runs[-1][1] == o:
            runs[-1][1] = o + width
        else:
            runs.append([o, o + width])
    parts = [data[..., a:b] for a, b in runs]
    packed = torch.cat(parts, -1) if len(parts) > 1 else parts[0].clone(memory_format=torch.contiguous_format)
    if width == 8:
        return packed.view(torch.int64)
    return packed.view(torch.int32).to(torch.int64) & _M32


def _mix16(data: torch.Tensor, in_offs: list[int], sec_offs: list[int], where: _Where) -> torch.Tensor:
    """XXH3_mix16B (seed 0) for every (input offset, secret offset) pair -> int64 [..., K]."""
    w = _read_le(data, [o + d for o in in_offs for d in (0, 8)], 8)
    k = _table(tuple(_sec(s + d) for s in sec_offs for d in (0, 8)), where)
    w = w ^ k
    return _fold(w[..., 0::2], w[..., 1::2])


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 8m] with contiguous rows -> int64 [..., m]; zero-copy when every row starts 8-byte aligned."""
    lead = x.shape[:-1]
    if x.numel() == 0:
        return x.new_empty((*lead, x.shape[-1] // 8), dtype=torch.int64)
    strides = x.stride()[:-1]
    aligned = (x.data_ptr() % 8 == 0 and x.storage_offset() % 8 == 0 and x.stride(-1) == 1
               and all(s % 8 == 0 for s, d in zip(strides, lead, strict=True) if d > 1))
    if not aligned:
        return x.clone(memory_format=torch.contiguous_format).view(torch.int64)  # fresh storage: aligned rows
    if any(s % 8 for s in strides):
        # only dimensions of size 1 have such strides: they address nothing, but view(dtype) checks them
        x = x.as_strided(x.shape, (*(s if d > 1 else 0 for s, d in zip(strides, lead, strict=True)), 1))
    return x.view(torch.int64)


def _accumulate(words: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-stripe XXH3_accumulate_512 terms, split so the lane swap can be done after summing.

    words [..., 8] stripes, keys broadcastable to it. Returns (products, words): the stripe adds
    ``products[i]`` to acc[i] and ``words[i]`` to acc[i ^ 1].
    """
    dk = words ^ keys
    hi = dk >> 32  # then masked in place: _lsr would hold a third batch-sized temporary at once
    hi &= _M32
    dk &= _M32
    dk *= hi
    return dk, words


def _swap_lanes(x: torch.Tensor) -> torch.Tensor:
    """Lanes i and i ^ 1 of the last dimension (8 accumulator lanes) exchanged."""
    return x.unflatten(-1, (4, 2)).flip(-1).flatten(-2)


def _long(data: torch.Tensor, length: int, where: _Where) -> torch.Tensor:
    lead = data.shape[:-1]
    stripes = (length - 1) // _STRIPE  # full stripes before the final (overlapping) last stripe
    blocks = (length - 1) // _BLOCK
    ktab = _table(tuple(_sec(8 * s + 8 * i) for s in range(_STRIPES_PER_BLOCK) for i in range(8)), where).view(16, 8)

    w = _as_words(data[..., : stripes * _STRIPE]).unflatten(-1, (stripes, 8))
    keys = ktab.repeat(blocks + 1, 1)[:stripes]
    prod, w = _accumulate(w, keys)
    # Every stripe's add is independent of acc, so sum each 1 KiB block's 16 stripes at once.
    nfull = blocks * _STRIPES_PER_BLOCK
    psum = prod[..., :nfull, :].unflatten(-2, (blocks, _STRIPES_PER_BLOCK)).sum(-2)
    wsum = w[..., :nfull, :].unflatten(-2, (blocks, _STRIPES_PER_BLOCK)).sum(-2)
    bsum = psum + _swap_lanes(wsum)
    tail = prod[..., nfull:, :].sum(-2) + _swap_lanes(w[..., nfull:, :].sum(-2))
    del prod, w

    last = _as_words(data[..., length - _STRIPE : length])
    lk = _table(tuple(_sec(_LAST_STRIPE_OFF + 8 * i) for i in range(8)), where)
    lp, lw = _accumulate(last, lk)
    tail = tail + lp + _swap_lanes(lw)

    acc = _table((_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1), where).expand(*lead, 8)
    skey = _table(tuple(_sec(_SCRAMBLE_OFF + 8 * i) for i in range(8)), where)
    for b in range(blocks):  # the scramble is nonlinear: the only sequential part
        acc = acc + bsum[..., b, :]
        acc = acc ^ _lsr(acc, 47) ^ skey
        acc = acc * _P32_1
    acc = acc + tail

    mk = _table(tuple(_sec(_MERGE_OFF + 8 * i) for i in range(8)), where)
    acc = acc ^ mk
    res = _fold(acc[..., 0::2], acc[..., 1::2]).sum(-1) + _s64(length * _P64_1)
    return _avalanche(res)


def _short(data: torch.Tensor, length: int, where: _Where) -> torch.Tensor:
    lead = data.shape[:-1]
    if length == 0:
        return _xxh64_avalanche(torch.full(lead, _s64(_sec(56) ^ _sec(64)), dtype=torch.int64, device=data.device))
    if length <= 3:
        c0, c1, c2 = (data[..., i].to(torch.int64) for i in (0, length >> 1, length - 1))
        combined = (c0 << 16) | (c1 << 24) | c2 | (length << 8)
        return _xxh64_avalanche(combined ^ (_sec(0, 4) ^ _sec(4, 4)))
    if length <= 8:
        w = _read_le(data, [0, length - 4], 4)
        keyed = (w[..., 1] + (w[..., 0] << 32)) ^ _s64(_sec(8) ^ _sec(16))
        return _rrmxmx(keyed, length)
    if length <= 16:
        w = _read_le(data, [0, length - 8], 8)
        lo = w[..., 0] ^ _s64(_sec(24) ^ _sec(32))
        hi = w[..., 1] ^ _s64(_sec(40) ^ _sec(48))
        swapped = lo.unsqueeze(-1).view(torch.uint8).flip(-1).contiguous().view(torch.int64).squeeze(-1)
        return _avalanche(length + swapped + hi + _fold(lo, hi))
    acc0 = _s64(length * _P64_1)
    if length <= 128:
        in_offs, sec_offs = [], []
        for r in range((length - 1) // 32 + 1):  # 1..4 rounds, each a pair from the front and the back
            in_offs += [16 * r, length - 16 * (r + 1)]
            sec_offs += [32 * r, 32 * r + 16]
        return _avalanche(_mix16(data, in_offs, sec_offs, where).sum(-1) + acc0)
    rounds = length // 16
    in_offs = [16 * i for i in range(rounds)] + [length - 16]
    sec_offs = [16 * i for i in range(8)] + [16 * (i - 8) + _MID_START_OFF for i in range(8, rounds)] + [_MID_LAST_OFF]
    m = _mix16(data, in_offs, sec_offs, where)
    acc = _avalanche(m[..., :8].sum(-1) + acc0)
    return _avalanche(acc + m[..., 8:].sum(-1))


def xxh3_64_rows(data: torch.Tensor) -> torch.Tensor:
    """XXH3-64 (seed 0) of each row of ``data`` (a row: the last dimension).

    Args:
        data: uint8 tensor [..., L] (two or more dimensions) on any device. It may be a strided view
            whose rows are contiguous, e.g. one layer's slice of many records, or records x layers x
            bytes of a batch of records: rows that start 8-byte aligned are hashed where they lie,
            others from one aligned copy.

    Returns:
        int64 tensor [...] (``data.shape[:-1]``) on ``data.device``: the two's-complement bit pattern
        of each row's unsigned XXH3-64 (``to_unsigned`` recovers the Python ints
        ``xxhash.xxh3_64_intdigest`` returns). On CUDA the work is queued on the calling thread's
        current stream and the call returns without waiting for the device; the result is ready
        when that stream reaches it.
    """
    if data.dtype != torch.uint8 or data.dim() < 2:
        raise ValueError(f"expected a uint8 tensor of 2 or more dimensions, got {data.dtype} with shape "
                         f"{tuple(data.shape)}")
    lead, length = data.shape[:-1], data.shape[-1]
    if any(d == 0 for d in lead):
        return torch.empty(lead, dtype=torch.int64, device=data.device)
    if length > 1 and data.stride(-1) != 1:
        data = data.contiguous()
    where = _where(data.device)
    return _long(data, length, where) if length > 240 else _short(data, length, where)


def to_unsigned(t: torch.Tensor) -> list[int]:
    """int64 bit patterns (any device) -> Python ints in [0, 2**64)."""
    return [v & _M64 for v in t.tolist()]
