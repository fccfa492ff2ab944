"""XXH3-64 (seed 0, default secret) of many equal-length byte rows, in plain torch integer ops.

Bit-exact with ``xxhash.xxh3_64_intdigest``; runs unchanged on CPU and CUDA, so the GPUDirect path can
checksum layers without a host copy. All rows share one length, so every branch of XXH3 is chosen once
per call and the work is vectorized over rows (and, for long inputs, over stripes).

u64 arithmetic is emulated on int64: add/mul/xor/shift-left wrap to the same bits, but ``>>`` is
arithmetic, so logical shifts mask off the sign fill (``_lsr``).
"""

from __future__ import annotations

from functools import lru_cache

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


@lru_cache(maxsize=1024)
def _const(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Small int64 tables (keys, gather indices), built once per device: no host->device copy per call."""
    return torch.tensor([_s64(v) for v in values], dtype=torch.int64, device=device)


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
    """Little-endian words of ``width`` bytes at byte ``offsets`` of every row -> int64 [N, len(offsets)]."""
    idx = _const(tuple(o + i for o in offsets for i in range(width)), data.device)
    shifts = _const(tuple(range(0, 8 * width, 8)), data.device)
    b = data[:, idx].view(data.shape[0], len(offsets), width).to(torch.int64)
    return (b << shifts).sum(-1)  # disjoint bit ranges: the sum is the OR


def _mix16(data: torch.Tensor, in_offs: list[int], sec_offs: list[int]) -> torch.Tensor:
    """XXH3_mix16B (seed 0) for every (input offset, secret offset) pair -> int64 [N, K]."""
    w = _read_le(data, [o + d for o in in_offs for d in (0, 8)], 8)
    k = _const(tuple(_sec(s + d) for s in sec_offs for d in (0, 8)), data.device)
    w = w ^ k
    return _fold(w[:, 0::2], w[:, 1::2])


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 8m] with contiguous rows -> int64 [N, m]; zero-copy when rows are 8-byte aligned."""
    n = x.shape[0]
    if n == 0:
        return x.new_empty((0, x.shape[1] // 8), dtype=torch.int64)
    aligned = x.data_ptr() % 8 == 0 and x.storage_offset() % 8 == 0 and x.stride(1) == 1
    if aligned and n == 1:  # a lone row's stride is irrelevant, but view(dtype) would still check it
        return x[0].view(torch.int64).unsqueeze(0)
    if not aligned or x.stride(0) % 8 != 0:
        x = x.clone(memory_format=torch.contiguous_format)  # fresh storage: offset 0, stride 8m
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


_SWAP = [1, 0, 3, 2, 5, 4, 7, 6]


def _long(data: torch.Tensor, length: int) -> torch.Tensor:
    n, dev = data.shape[0], data.device
    stripes = (length - 1) // _STRIPE  # full stripes before the final (overlapping) last stripe
    blocks = (length - 1) // _BLOCK
    ktab = _const(tuple(_sec(8 * s + 8 * i) for s in range(_STRIPES_PER_BLOCK) for i in range(8)), dev).view(16, 8)

    w = _as_words(data[:, : stripes * _STRIPE]).view(n, stripes, 8)
    keys = ktab.repeat(blocks + 1, 1)[:stripes]
    prod, w = _accumulate(w, keys)
    # Every stripe's add is independent of acc, so sum each 1 KiB block's 16 stripes at once.
    nfull = blocks * _STRIPES_PER_BLOCK
    psum = prod[:, :nfull].reshape(n, blocks, _STRIPES_PER_BLOCK, 8).sum(2)
    wsum = w[:, :nfull].reshape(n, blocks, _STRIPES_PER_BLOCK, 8).sum(2)
    bsum = psum + wsum[..., _SWAP]
    tail = prod[:, nfull:].sum(1) + w[:, nfull:].sum(1)[:, _SWAP]
    del prod, w

    last = _as_words(data[:, length - _STRIPE : length])
    lk = _const(tuple(_sec(_LAST_STRIPE_OFF + 8 * i) for i in range(8)), dev)
    lp, lw = _accumulate(last, lk)
    tail = tail + lp + lw[:, _SWAP]

    acc = _const((_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1), dev).expand(n, 8)
    skey = _const(tuple(_sec(_SCRAMBLE_OFF + 8 * i) for i in range(8)), dev)
    for b in range(blocks):  # the scramble is nonlinear: the only sequential part
        acc = acc + bsum[:, b]
        acc = acc ^ _lsr(acc, 47) ^ skey
        acc = acc * _P32_1
    acc = acc + tail

    mk = _const(tuple(_sec(_MERGE_OFF + 8 * i) for i in range(8)), dev)
    acc = acc ^ mk
    res = _fold(acc[:, 0::2], acc[:, 1::2]).sum(1) + _s64(length * _P64_1)
    return _avalanche(res)


def _short(data: torch.Tensor, length: int) -> torch.Tensor:
    n, dev = data.shape[0], data.device
    if length == 0:
        return _xxh64_avalanche(torch.full((n,), _s64(_sec(56) ^ _sec(64)), dtype=torch.int64, device=dev))
    if length <= 3:
        c = data[:, [0, length >> 1, length - 1]].to(torch.int64)
        combined = (c[:, 0] << 16) | (c[:, 1] << 24) | c[:, 2] | (length << 8)
        return _xxh64_avalanche(combined ^ (_sec(0, 4) ^ _sec(4, 4)))
    if length <= 8:
        w = _read_le(data, [0, length - 4], 4)
        keyed = (w[:, 1] + (w[:, 0] << 32)) ^ _s64(_sec(8) ^ _sec(16))
        return _rrmxmx(keyed, length)
    if length <= 16:
        w = _read_le(data, [0, length - 8], 8)
        lo = w[:, 0] ^ _s64(_sec(24) ^ _sec(32))
        hi = w[:, 1] ^ _s64(_sec(40) ^ _sec(48))
        swapped = lo.unsqueeze(1).view(torch.uint8).flip(1).contiguous().view(torch.int64).squeeze(1)
        return _avalanche(length + swapped + hi + _fold(lo, hi))
    acc0 = _s64(length * _P64_1)
    if length <= 128:
        in_offs, sec_offs = [], []
        for r in range((length - 1) // 32 + 1):  # 1..4 rounds, each a pair from the front and the back
            in_offs += [16 * r, length - 16 * (r + 1)]
            sec_offs += [32 * r, 32 * r + 16]
        return _avalanche(_mix16(data, in_offs, sec_offs).sum(1) + acc0)
    rounds = length // 16
    in_offs = [16 * i for i in range(rounds)] + [length - 16]
    sec_offs = [16 * i for i in range(8)] + [16 * (i - 8) + _MID_START_OFF for i in range(8, rounds)] + [_MID_LAST_OFF]
    m = _mix16(data, in_offs, sec_offs)
    acc = _avalanche(m[:, :8].sum(1) + acc0)
    return _avalanche(acc + m[:, 8:].sum(1))


def xxh3_64_rows(data: torch.Tensor) -> torch.Tensor:
    """XXH3-64 (seed 0) of each row of ``data``.

    Args:
        data: uint8 tensor [N, L] on any device. Rows may be a strided view whose rows are contiguous
            (e.g. one layer's slice of many records).

    Returns:
        int64 tensor [N] on ``data.device``: the two's-complement bit pattern of each row's unsigned
        XXH3-64 (``to_unsigned`` recovers the Python ints ``xxhash.xxh3_64_intdigest`` returns).
    """
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(f"expected a 2-D uint8 tensor, got {data.dtype} with shape {tuple(data.shape)}")
    n, length = data.shape
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    if length > 1 and data.stride(1) != 1:
        data = data.contiguous()
    return _long(data, length) if length > 240 else _short(data, length)


def to_unsigned(t: torch.Tensor) -> list[int]:
    """int64 bit patterns (any device) -> Python ints in [0, 2**64)."""
    return [v & _M64 for v in t.tolist()]
