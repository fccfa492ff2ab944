"""[B] the restore path: GB/s against a plain pinned copy; one load's chunks with the engine idle and
busy; a load does not wait for a forward queued after its mark."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from probe_common import (
    BUSY,
    CHUNK,
    CPU,
    DEV,
    RATE,
    STEP_MS,
    engine,
    engine_point,
    forward_ms,
    geometry,
    load_mark,
    ms,
    ns_of,
    section,
    sync,
    views,
)

from dynamo_tiered_kv.blocks.codec import decode_blocks, encode_blocks, verify_record
from dynamo_tiered_kv.blocks.device_codec import (
    decode_blocks_on_device,
)
from dynamo_tiered_kv.blocks.keys import chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout
from dynamo_tiered_kv.staging.device_copy import RestoreSession, restore_after, restore_records
from dynamo_tiered_kv.staging.slabs import StagingPool


def _records(lay: EngineLayout, n: int) -> tuple[StagingPool, list[bytes], np.ndarray]:
    """Records of blocks 0..n-1 of ``lay`` in a staging slab (pinned on a GPU)."""
    ns = ns_of(lay)
    rb, _, _ = geometry(lay)
    keys = chain_keys(ns, np.arange(16 * n))
    pool = StagingPool(n * rb, 1)
    arr = pool.acquire().array
    for a in range(0, n, 64):
        b = min(n, a + 64)
        encode_blocks(lay, list(range(a, b)), [ns.digest] * (b - a), keys[a:b], parents_of(keys)[a:b],
                      arr[a * rb : b * rb])
    return pool, keys, arr


def _chunks(n: int, rb: int) -> list[tuple[int, int]]:
    per = max(1, CHUNK // rb)
    return [(a, min(n, a + per)) for a in range(0, n, per)]


def _best(fn: Callable[[], None], reps: int = 3) -> float:
    fn()  # warm-up: allocator, pinned pool, streams
    sync()
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


@section
def B() -> None:
    src, dst = engine(RATE, seed=1), engine(RATE, seed=2)
    ns = ns_of(src)
    rb, hb, lb = geometry(src)
    n = RATE[4]
    pool, keys, arr = _records(src, n)
    ids = list(range(n))
    chunks = _chunks(n, rb)
    nbytes = n * rb
    d_arr = torch.from_numpy(arr[:nbytes]).to(DEV)
    try:
        def copies(chunked: bool) -> None:
            with RestoreSession(DEV) as s:
                for a, b in chunks if chunked else [(0, n)]:
                    restore_records([], views(dst), dst.device, ids[a:b], record_bytes=rb, header_bytes=hb,
                                    layer_bytes=lb, chunk=arr[a * rb : b * rb], session=s)

        def decoded() -> None:
            with RestoreSession(DEV) as s:
                for a, b in chunks:
                    errs = decode_blocks(arr[a * rb : b * rb], dst, ids[a:b], namespace=ns.digest, keys=keys[a:b],
                                         session=s)
                    assert not any(errs), errs

        def on_device() -> None:
            with RestoreSession(DEV) as s:
                for a, b in chunks:
                    errs = decode_blocks_on_device(d_arr[a * rb : b * rb], dst, ids[a:b], namespace=ns.digest,
                                                   keys=keys[a:b], session=s)
                    assert not any(errs), errs

        def verify() -> None:
            for i in range(n):
                verify_record(arr[i * rb : (i + 1) * rb], namespace=ns.digest, key=keys[i], shape=src.shape)

        host = torch.from_numpy(arr[:nbytes])
        d = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
        t_h2d = _best(lambda: d.copy_(host, non_blocking=True))

        def measured(fn: Callable[[], None]) -> tuple[float, bool]:
            for t in dst.tensors:
                t.zero_()
            t = _best(fn)
            return t, all(torch.equal(a[:, :n], b[:, :n]) for a, b in zip(src.tensors, dst.tensors))

        g = lambda t: f"{nbytes / t / 1e9:6.2f} GB/s ({t_h2d / t:.2f}x the plain copy)"  # noqa: E731
        print(f"[B1] {n} records x {rb} B ({nbytes / 2**20:.1f} MiB) in {len(chunks)} chunks of "
              f"<= {CHUNK / 2**20:g} MiB, idle engine")
        print(f"[B1] plain pinned H2D copy_ of the same bytes: {nbytes / t_h2d / 1e9:6.2f} GB/s")
        for label, fn, expect in (
                ("restore_records, one batch (1 H2D + 1 scatter, no verify)", lambda: copies(False), ">= 0.8x"),
                ("restore_records, one session of chunks (no verify)", lambda: copies(True), ">= 0.8x"),
                ("decode_blocks, one session of chunks (host verify + copies)", decoded,
                 "~ the host verify rate below: one thread verifies, the copies overlap it"),
                ("decode_blocks_on_device, device records (GDS restore path)", on_device,
                 "above the host verify rate: checksums on the device, one host wait per chunk")):
            t, ok = measured(fn)
            print(f"[B1] {label}: {g(t)}, bytes equal {ok} (expect {expect}; bytes equal True)")
        print(f"[B1] host verify only (python-xxhash, one thread): {nbytes / _best(verify) / 1e9:6.2f} GB/s")
    finally:
        pool.close()
    _busy()


def _busy() -> None:
    """[B2], [B3]: one load's chunks on a restore thread while the engine's stream stays busy."""
    src, dst = engine(BUSY, seed=3), engine(BUSY, seed=4)
    ns = ns_of(src)
    rb, _, _ = geometry(src)
    n = BUSY[4]
    pool, keys, arr = _records(src, n)
    d_arr = torch.from_numpy(arr[: n * rb]).to(DEV)
    chunks = _chunks(n, rb)

    def chunk(s: RestoreSession | None, a: int, b: int, device: bool = False) -> None:
        if device:
            errs = decode_blocks_on_device(d_arr[a * rb : b * rb], dst, list(range(a, b)), namespace=ns.digest,
                                           keys=keys[a:b], session=s)
        else:
            errs = decode_blocks(arr[a * rb : b * rb], dst, list(range(a, b)), namespace=ns.digest, keys=keys[a:b],
                                 session=s)
        assert not any(errs), errs

    def load(mark: Any, lat: list[float], span: list[float], device: bool = False) -> None:
        """One load as the store runs it: one session, every chunk ordered after ``mark``."""
        t_start = time.perf_counter()
        with restore_after(mark), RestoreSession(DEV) as s:
            for a, b in chunks:
                t0 = time.perf_counter()
                chunk(s, a, b, device)
                lat.append(time.perf_counter() - t0)
        span.append(time.perf_counter() - t_start)

    def per_chunk_marks(lat: list[float], span: list[float]) -> None:
        """The control: each chunk its own session, marked on the thread's current stream, the
        engine's (how every chunk waited for the forwards queued before it)."""
        t_start = time.perf_counter()
        for a, b in chunks[:16]:
            t0 = time.perf_counter()
            with RestoreSession(DEV) as s:
                chunk(s, a, b)
            lat.append(time.perf_counter() - t0)
        span.append(time.perf_counter() - t_start)

    def with_engine(busy: bool, target: Callable[..., None], *args: Any) -> int:
        """Run ``target`` on a restore thread; with ``busy``, the engine keeps <= 2 steps queued
        meanwhile and the load's mark is taken behind them. Returns the steps run."""
        steps: list[Any] = []

        def step() -> None:
            if CPU:
                time.sleep(0.002)  # no device to keep busy: only the calls run
            forward_ms(STEP_MS)
            steps.append(engine_point())
            if len(steps) >= 2:
                steps[-2].synchronize()

        if busy:
            step()
            step()
        mark = load_mark()
        th = threading.Thread(target=target, args=(mark, *args) if target is load else args)
        th.start()
        while th.is_alive():
            if busy:
                step()
            else:
                time.sleep(0.001)
        th.join()
        sync()
        return len(steps)

    med = lambda xs: 1e3 * float(np.median(xs)) if xs else float("nan")  # noqa: E731
    p90 = lambda xs: 1e3 * float(np.percentile(xs, 90)) if xs else float("nan")  # noqa: E731
    try:
        warm: list[float] = []
        with_engine(False, load, warm, [])  # warm-up
        idle, idle_span = [], []  # type: ignore[var-annotated]
        with_engine(False, load, idle, idle_span)
        busy, busy_span = [], []  # type: ignore[var-annotated]
        steps = with_engine(True, load, busy, busy_span)
        print(f"[B2] one load of {n} records ({n * rb / 2**20:.0f} MiB) in {len(chunks)} chunks: idle engine "
              f"{ms(idle_span[0])}, busy engine ({STEP_MS:.0f} ms steps, <= 2 queued, mark behind them) "
              f"{ms(busy_span[0])} over {steps} steps (expect <= 1.5x idle + the 2 steps before the mark)")
        ratio = med(busy) / med(idle) if idle and med(idle) > 0 else float("nan")
        print(f"[B2] per chunk: median {med(idle):.2f} ms idle vs {med(busy):.2f} ms busy ({ratio:.2f}x; expect "
              f"<= 1.5x), p90 {p90(idle):.2f} vs {p90(busy):.2f} ms")
        old, old_span = [], []  # type: ignore[var-annotated]
        with_engine(True, per_chunk_marks, old, old_span)
        print(f"[B2] control, each chunk marked on the engine's stream: median chunk {med(old):.2f} ms busy over "
              f"{len(old)} chunks (expect ~ one {STEP_MS:.0f} ms step per chunk, else this check has no teeth here)")

        for device in (False, True):  # B3: the load's mark, then a long forward queued after it
            path = "device records" if device else "host slab"
            lat: list[float] = []
            span: list[float] = []
            load(None, lat, span, device)  # warm-up of this path
            sync()
            mark = load_mark()
            forward_ms(300)
            fwd = engine_point()
            span = []
            load(mark, lat, span, device)
            running = not fwd.query()
            sync()
            print(f"[B3] {path}: a load ordered after its mark took {ms(span[0])} with a 300 ms forward queued "
                  f"after the mark; that forward still running when the load was done: {running} "
                  f"(expect True, the load about as fast as idle)")
            forward_ms(300)
            fwd = engine_point()
            span = []
            load(None, lat, span, device)  # marks on this thread's stream, the engine's: after the forward
            print(f"[B3] {path}, control marked after the forward: {ms(span[0])}, forward done first: "
                  f"{fwd.query()} (expect True and >= 300 ms, else this check has no teeth here)")
            sync()
    finally:
        pool.close()


