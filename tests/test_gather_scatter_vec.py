"""The Triton gather/scatter kernel moves 16 bytes per access where every address, stride, offset
and size is a multiple of 16, one byte per access otherwise, and is byte-exact either way.

Runs the kernel under Triton's interpreter over CPU tensors (as ``test_kernels`` does); where
Triton's CUDA backend can compile here, the sm_90 PTX of both variants is checked too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_kernels import _interpreted

from dynamo_tiered_kv.kernels import gather_scatter as gs


class _Launches:
    """Wraps the kernel: records each launch's ``VEC`` and ``GATHER``, then runs it."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*a: Any, **kw: Any) -> Any:
            self.seen.append((kw["GATHER"], kw["VEC"]))
            return self.kernel[grid](*a, **kw)

        return launch


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> _Launches:
    _interpreted(monkeypatch)
    rec = _Launches(gs._move_kernel)
    monkeypatch.setattr(gs, "_move_kernel", rec)
    return rec


def _tensors(num_blocks: int, layers: int, planes: int, plane_bytes: int, block_pad: int, seed: int,
             device: str = "cpu") -> list[torch.Tensor]:
    """Per layer ``[block][plane * plane_bytes + block_pad]`` random bytes (one allocation each)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (num_blocks, planes * plane_bytes + block_pad), dtype=torch.uint8,
                          generator=g).to(device) for _ in range(layers)]


def _views_of(tensors: list[torch.Tensor], planes: int, plane_bytes: int) -> list[torch.Tensor]:
    """Per layer a ``[block][plane][bytes]`` view, the spare bytes after each block left out."""
    return [t[:, : planes * plane_bytes].unflatten(1, (planes, plane_bytes)) for t in tensors]


def _views(num_blocks: int, layers: int, planes: int, plane_bytes: int, block_pad: int,
           seed: int) -> list[torch.Tensor]:
    return _views_of(_tensors(num_blocks, layers, planes, plane_bytes, block_pad, seed), planes, plane_bytes)


def _expected(views: list[torch.Tensor], ids: list[int], rb: int, hb: int, fill: int) -> torch.Tensor:
    planes, pb = views[0].shape[1], views[0].shape[2]
    lb = planes * pb
    want = torch.full((len(ids) * rb,), fill, dtype=torch.uint8)
    for i, b in enumerate(ids):
        for j, v in enumerate(views):
            start = i * rb + hb + j * lb
            want[start:start + lb] = v[b].reshape(-1)
    return want


CASES = {  # name: (planes, plane_bytes, block_pad, header_bytes, record offset, vector bytes expected)
    "aligned": (2, 4096 + 48, 32, 64, 0, 16),  # a plane spans two 4 KiB chunks, the second one masked
    "aligned_mla": (1, 1152, 0, 128, 0, 16),
    "odd_plane": (2, 1000 + 4, 0, 64, 0, 1),  # 1004 bytes: a multiple of 4, not of 16
    "odd_block_stride": (2, 1024, 8, 64, 0, 1),  # blocks 8 bytes apart from 16-byte alignment
    "odd_records": (2, 1024, 0, 64, 8, 1),  # the records buffer starts 8 bytes into an allocation
    "odd_header": (2, 1024, 0, 72, 0, 1),
}


def _check_case(case: str, launches: _Launches, device: str) -> None:
    """Gather and scatter through the kernel with ``CASES[case]``'s geometry on ``device``: byte-exact
    both ways, nothing outside the target blocks touched, the expected access width launched."""
    planes, pb, pad, hb, rec_off, vec = CASES[case]
    layers, num_blocks = 3, 10
    views = _views_of(_tensors(num_blocks, layers, planes, pb, pad, seed=1, device=device), planes, pb)
    lb = planes * pb
    rb = -(-(hb + layers * lb) // 16) * 16 + (16 if rec_off else 0)
    if case == "odd_plane":
        rb = hb + layers * lb + 4  # sizes that are not multiples of 16 all through
    ids = [7, 0, 3, 9]
    raw = torch.full((rec_off + len(ids) * rb,), 0xEE, dtype=torch.uint8, device=device)
    out = raw[rec_off:]
    gs.gather_records(views, torch.tensor(ids, device=device), out, record_bytes=rb, header_bytes=hb,
                      layer_bytes=lb)
    cpu_views = [v.cpu() for v in views]
    assert torch.equal(out.cpu(), _expected(cpu_views, ids, rb, hb, 0xEE)), "gathered bytes differ"

    engine = _tensors(num_blocks, layers, planes, pb, pad, seed=2, device=device)
    before = [t.cpu() for t in engine]
    dst = _views_of(engine, planes, pb)
    targets = [2, 5, 8, 1]
    gs.scatter_records(out, dst, torch.tensor(targets, device=device), record_bytes=rb, header_bytes=hb,
                       layer_bytes=lb)
    after = [t.cpu() for t in engine]
    for j in range(layers):
        for s, t in zip(ids, targets):
            assert torch.equal(after[j][t, :lb], cpu_views[j][s].reshape(-1)), f"layer {j} block {t} differs"
        for b in set(range(num_blocks)) - set(targets):
            assert torch.equal(after[j][b], before[j][b]), "a block outside the targets changed"
        assert torch.equal(after[j][:, lb:], before[j][:, lb:]), "bytes between blocks changed"
    assert launches.seen == [(True, vec), (False, vec)]


@pytest.mark.parametrize("case", list(CASES))
def test_vectorized_and_byte_kernels_are_byte_exact(case: str, launches: _Launches) -> None:
    _check_case(case, launches, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_vectorized_and_byte_kernels_are_byte_exact_on_cuda(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert gs.triton_available(), "Triton is missing: the CUDA copies would take the torch path"
    rec = _Launches(gs._move_kernel)
    monkeypatch.setattr(gs, "_move_kernel", rec)
    _check_case(case, rec, "cuda")


@pytest.mark.gpu
def test_warm_up_on_cuda_leaves_the_blocks_alone() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    views = _views(6, 2, 2, 1024, 0, seed=3)
    cuda = [v.cuda() for v in views]
    assert gs.warm_up(cuda, record_bytes=64 + 2 * 2048, header_bytes=64, layer_bytes=2048)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(cuda, views))


def test_warm_up_compiles_both_directions_and_leaves_the_blocks_alone(launches: _Launches) -> None:
    views = _views(6, 2, 2, 1024, 0, seed=3)
    before = [v.clone() for v in views]
    assert gs.warm_up(views, record_bytes=64 + 2 * 2048, header_bytes=64, layer_bytes=2048)
    assert launches.seen == [(True, 16), (False, 16)]
    assert all(torch.equal(a, b) for a, b in zip(views, before))


def test_launches_run_under_the_tensors_device(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[torch.device] = []

    @contextlib.contextmanager
    def device(d: torch.device) -> Iterator[None]:
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    with gs._device_guard(torch.device("cuda", 3)):
        pass
    with gs._device_guard(torch.device("cpu")):
        pass
    assert entered == [torch.device("cuda", 3)]


def _ptx(vec: int) -> str:
    """The sm_90 PTX of the gather kernel with ``VEC=vec`` (pointer and size arguments 16-byte
    aligned, as on a GPU), compiled by Triton's CUDA backend without a GPU."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the Triton version
        pytest.skip(f"this Triton cannot compile ahead of time: {e}")
    jit = gs._move_kernel
    names = list(jit.arg_names)
    types = {"layer_ptrs": "*i64", "block_ids": "*i64", "rec_ptr": "*u8"}
    signature = {n: types.get(n, "i64") for n in names}
    constexprs = {"GATHER": True, "CHUNK": 4096, "VEC": vec}
    for n in constexprs:
        signature[n] = "constexpr"
    aligned = ["rec_ptr", "block_ids", "layer_ptrs", "block_stride", "plane_stride", "plane_bytes", "record_bytes",
               "header_bytes", "layer_bytes"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    assert set(constexprs) <= set(names), f"the kernel takes {names}"
    at = {(names.index(k),): v for k, v in constexprs.items()}
    try:
        src = ASTSource(fn=jit, signature=signature, constexprs=at, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # no CUDA backend (ptxas) in this Triton install
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(e).__name__}: {e}")
    return compiled.asm["ptx"]


def test_sm90_ptx_moves_16_bytes_per_access_when_aligned() -> None:
    vec = _ptx(16)
    assert "ld.global.v4.b32" in vec and "st.global.v4.b32" in vec, "no 128-bit accesses in the vectorized kernel"
    assert "ld.global.b8" not in vec and "ld.global.u8" not in vec
    assert "ld.global.v4.b32" not in _ptx(1)  # the fallback assumes nothing about alignment


def test_the_vllm_worker_warms_the_kernels_when_it_registers_its_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    from dynamo_tiered_kv.blocks.layout import EngineLayoutKind, allocate_engine_kv
    from dynamo_tiered_kv.config import TieredKVConfig
    from dynamo_tiered_kv.connectors.vllm import worker

    warmed: list[Any] = []
    monkeypatch.setattr(worker, "warm_up_device_kernels", warmed.append)
    cfg = TieredKVConfig.from_mapping({"metrics_port": None, "host_capacity_bytes": 16 << 20})
    w = worker.WorkerRole(cfg, model_id="m", kv_dtype="bfloat16", block_size=4, num_kv_heads=2, head_size=8,
                          tp_rank=0, tp_size=1, engine_key=f"t-{uuid.uuid4().hex[:8]}", authkey=b"k")
    caches = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=8, block_size=4,
                                num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    try:
        w.register_kv_caches({f"model.layers.{i}.self_attn": t for i, t in enumerate(caches)})
        assert w.layout is not None and warmed == [w.layout]
    finally:
        w.shutdown()


def test_a_failed_warm_up_is_logged_and_left_to_the_first_copy(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from dynamo_tiered_kv.blocks import device_codec
    from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv

    caches = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=2, num_blocks=8, block_size=16,
                                num_kv_heads=2, head_size=64)
    lay = EngineLayout(EngineLayoutKind.FLASH_ATTN, caches, 16, 2, 64)
    monkeypatch.setattr(gs, "warm_up", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("no compiler")))
    device_codec.warm_up_device_kernels(lay)  # a CPU layout: nothing to compile, nothing called
    monkeypatch.setattr(lay, "is_cuda", True)
    with caplog.at_level(logging.WARNING, logger=device_codec.log.name):
        device_codec.warm_up_device_kernels(lay)  # never raises
    assert "no compiler" in caplog.text
