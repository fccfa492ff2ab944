"""The device checksum never makes its calling thread wait for the device.

On CUDA, indexing a tensor with a Python list (or a host tensor) copies the index to the device and
synchronizes the stream, and ``.item()``, ``.tolist()``, ``bool()`` or ``.cpu()`` wait for every
kernel queued before them. The CPU tests record every such call the hash makes through a torch
function mode; the gpu-marked test runs it under CUDA's sync debug mode, which raises on any.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import xxhash
from torch.overrides import TorchFunctionMode

from dynamo_tiered_kv.blocks import device_codec
from dynamo_tiered_kv.blocks.codec import header_bytes
from dynamo_tiered_kv.kernels import to_unsigned, xxh3_64_rows
from dynamo_tiered_kv.kernels import xxh3 as xxh3_module

# one length per XXH3 path (0, 1-3, 4-8, 9-16, 17-128, 129-240, long) and the long path's edges
LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 240, 241, 1024, 1025, 2048 + 64, 4096 + 8]

_HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.any, torch.Tensor.all,
}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _advanced(index: Any) -> bool:
    """Whether a ``__getitem__`` index holds a sequence or a tensor: an index copied to the device."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (list, tuple, torch.Tensor)) for p in parts)


class _SyncRecorder(TorchFunctionMode):
    """Records each torch call that would block the calling thread on a CUDA tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if func in _HOST_READS:
            self.calls.append(name)
        elif func in _INDEXING and len(args) > 1 and _advanced(args[1]):
            self.calls.append(f"{name}[{args[1]!r}]")
        elif name == "to" and not kwargs.get("non_blocking", False) and _moves_device(args, kwargs):
            self.calls.append("to(device) without non_blocking")
        return func(*args, **kwargs)


def _moves_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, (torch.device, str)) for t in targets if t is not None)


@contextmanager
def _recording() -> Iterator[_SyncRecorder]:
    with _SyncRecorder() as rec:
        yield rec


def _expected(rows: torch.Tensor) -> list[int]:
    flat = rows.flatten(0, -2).cpu()
    return [xxhash.xxh3_64_intdigest(flat[i].numpy().tobytes()) for i in range(flat.shape[0])]


def _layer_rows(n: int, length: int, offset: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(length + offset)
    record = offset + length + 16
    buf = torch.randint(0, 256, (n * record,), dtype=torch.uint8, generator=g).to(device)
    return buf.view(n, record)[:, offset : offset + length]


@pytest.mark.parametrize("offset", [0, 3])  # 8-aligned rows (word views) and unaligned ones (copied)
def test_hash_makes_no_host_reads_and_no_list_indexing(offset: int) -> None:
    for length in LENGTHS:
        rows = _layer_rows(5, length, offset)
        with _recording() as rec:
            got = xxh3_64_rows(rows)
        assert rec.calls == [], f"length {length}: {rec.calls}"
        assert to_unsigned(got) == _expected(rows)


def test_the_recorder_sees_what_it_looks_for() -> None:
    t = torch.arange(8)
    with _recording() as rec:
        t[[1, 0]]
        t[..., [1, 0]]
        t[0].item()
        bool(t[0])
        t.tolist()
        t.to("cpu")
        t[1:3]  # a view: not recorded
        t[..., 2]
        t.to(torch.int32)
        t.to("cpu", non_blocking=True)
    assert len(rec.calls) == 6, rec.calls


@pytest.mark.parametrize("layer_bytes", [8, 100, 1024, 1028])
def test_records_by_layers_view_hashes_in_place(layer_bytes: int) -> None:
    # the codec's payloads, records x layers x bytes: hashed as a strided 3-D view, results in record order
    n, nl = 3, 4
    hb = header_bytes(nl)
    rb = hb + nl * layer_bytes + 4096
    g = torch.Generator().manual_seed(layer_bytes)
    recs = torch.randint(0, 256, (n * rb,), dtype=torch.uint8, generator=g).view(n, rb)
    view = recs[:, hb : hb + nl * layer_bytes].unflatten(1, (nl, layer_bytes))
    with _recording() as rec:
        sums = device_codec._layer_sums_on_device(recs, hb, nl, layer_bytes)
    assert rec.calls == []
    assert sums.shape == (n * nl,)
    assert to_unsigned(sums) == _expected(view)
    assert to_unsigned(xxh3_64_rows(view).reshape(-1)) == _expected(view)


def test_records_by_layers_are_not_copied_when_words_align(monkeypatch: pytest.MonkeyPatch) -> None:
    n, nl, lb = 3, 4, 2048
    hb = header_bytes(nl)
    recs = torch.zeros((n, hb + nl * lb + 4096), dtype=torch.uint8)
    seen: list[torch.Tensor] = []
    real = xxh3_module._as_words

    def as_words(x: torch.Tensor) -> torch.Tensor:
        words = real(x)
        seen.append(words)
        return words

    monkeypatch.setattr(xxh3_module, "_as_words", as_words)
    device_codec._layer_sums_on_device(recs, hb, nl, lb)
    first = seen[0]  # the stripes: a word view of the records themselves
    assert first.data_ptr() == recs.data_ptr() + hb
    assert first.shape[:2] == (n, nl)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 3])
def test_cuda_hash_never_synchronizes(offset: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows = {length: _layer_rows(9, length, offset, device="cuda") for length in LENGTHS}
    nl, lb = 4, 1024
    hb = header_bytes(nl)
    recs = torch.randint(0, 256, (3, hb + nl * lb + 4096), dtype=torch.uint8).to("cuda")
    torch.cuda.synchronize()
    got: dict[int, torch.Tensor] = {}
    stream = torch.cuda.Stream()  # a stream the hash has not run on: its tables are built now, too
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            for length, r in rows.items():
                got[length] = xxh3_64_rows(r)
            sums = device_codec._layer_sums_on_device(recs, hb, nl, lb)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream.synchronize()
    for length, r in rows.items():
        assert to_unsigned(got[length]) == _expected(r), f"length {length}"
    assert to_unsigned(sums) == _expected(recs[:, hb : hb + nl * lb].unflatten(1, (nl, lb)))
