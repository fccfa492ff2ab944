"""[A] the save path: the engine thread's part of a host-slab and of a GPU-direct save, with a forward
queued; later engine kernels never reach the records; the kernel warm-up."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from probe_common import (
    CPU,
    DEV,
    FA,
    OPS,
    SAVE,
    SLAB,
    engine,
    forward_ms,
    geometry,
    ms,
    ns_of,
    on_cpu,
    section,
    sync,
    views,
)

from dynamo_tiered_kv.blocks.codec import encode_blocks
from dynamo_tiered_kv.blocks.device_codec import (
    begin_encode_on_device,
    encode_blocks_on_device,
    warm_up_device_kernels,
)
from dynamo_tiered_kv.blocks.keys import chain_keys, parents_of
from dynamo_tiered_kv.blocks.layout import EngineLayout
from dynamo_tiered_kv.kernels import gather_records, triton_available
from dynamo_tiered_kv.staging.device_copy import ids_on
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.store.deferred_encode import begin_encode


def payloads_differ(got: torch.Tensor, want: torch.Tensor, n: int, lay: EngineLayout) -> int:
    """(record, layer) pairs whose payload bytes differ between two record buffers."""
    rb, hb, lb = geometry(lay)
    nl = lay.shape.num_layers
    a = got[: n * rb].view(n, rb)[:, hb : hb + nl * lb].reshape(n, nl, lb)
    b = want[: n * rb].view(n, rb)[:, hb : hb + nl * lb].reshape(n, nl, lb)
    return int((a != b).any(dim=2).sum())


def on_writer_thread(second: Callable[[], int]) -> int:
    """Run the second half of a GPU-direct save on a thread of its own, as the store's writer does."""
    wrote: list[int] = []
    writer = threading.Thread(target=lambda: wrote.append(second()))
    writer.start()
    writer.join()
    if not wrote:
        raise RuntimeError("the writer half of the GPU-direct save raised (traceback above)")
    return wrote[0]


# --------------------------------------------------------------------------------------------
@section
def A() -> None:
    print(f"[A] cuda={torch.cuda.is_available()} triton_available={triton_available()}")
    lay = engine(SAVE)
    ns = ns_of(lay)
    rb, hb, lb = geometry(lay)
    n = min(SLAB // rb, (lay.num_blocks - 7) // 2)  # one staging slab's worth
    ids = list(range(7, 7 + 2 * n, 2))
    keys = chain_keys(ns, np.arange(16 * n))
    par = parents_of(keys)
    nss = [ns.digest] * n
    pool = StagingPool(n * rb, 1)
    slab = pool.acquire()
    print(f"[A] record {rb} B, {n} records per {SLAB >> 20} MiB slab, staging pinned={pool.pinned}")
    try:
        t0 = time.perf_counter()
        warm_up_device_kernels(lay)
        t1 = time.perf_counter()
        seal = begin_encode(lay, ids, nss, keys, par, slab.array)
        t2 = time.perf_counter()
        seal()
        t3 = time.perf_counter()
        print(f"[A0] warm_up_device_kernels (KV cache registration: Triton JIT, checksum tables) {ms(t1 - t0)} "
              f"(expect seconds with a fresh Triton cache); then the first save's begin_encode {ms(t2 - t1)} "
              f"(expect < 50: nothing left to compile), seal {ms(t3 - t2)}")
        ref = np.zeros(n * rb, np.uint8)
        encode_blocks(on_cpu(lay), ids, nss, keys, par, ref)
        print(f"[A0] records equal to the CPU encoder's: {np.array_equal(ref, slab.array[: n * rb])} (expect True)")

        for _ in range(3):  # A1: the engine thread returns while a forward is queued
            forward_ms(100)
            t0 = time.perf_counter()
            seal = begin_encode(lay, ids, nss, keys, par, slab.array)
            t1 = time.perf_counter()
            seal()
            t2 = time.perf_counter()
            print(f"[A1] host-slab save: begin_encode (engine thread) returned in {ms(t1 - t0)} with a 100 ms "
                  f"forward queued (expect < 2); seal (writer thread) waited {ms(t2 - t1)} (expect ~100)")

        # A2: later engine kernels that overwrite the saved blocks must wait for the gather
        idx = torch.tensor(ids, device=DEV)
        dev_out = torch.empty(n * rb, dtype=torch.uint8, device=DEV)

        def corrupted(save: Callable[[], Callable[[], Any]], records: Callable[[], torch.Tensor]) -> int:
            for t in lay.tensors:
                t.normal_()
            want = EngineLayout(FA, [t[:, ids].clone() for t in lay.tensors], 16, lay.shape.num_kv_heads,
                                lay.shape.head_size)
            forward_ms(30)
            done = save()
            for t in lay.tensors:  # "the next request" overwrites the saved blocks, queued with no host wait
                t.index_fill_(1, idx, 0)
            done()
            ref_d = torch.zeros(n * rb, dtype=torch.uint8, device=DEV)
            gather_records(views(want), ids_on(range(n), DEV), ref_d, record_bytes=rb, header_bytes=hb,
                           layer_bytes=lb)
            sync()
            return payloads_differ(records().to(DEV), ref_d, n, lay)

        def ours() -> Callable[[], Any]:
            return begin_encode(lay, ids, nss, keys, par, slab.array)

        def host_records() -> torch.Tensor:
            return torch.from_numpy(slab.array[: n * rb].copy())

        def unsafe() -> Callable[[], Any]:  # device_order.order_save without engine.wait_event(gathered)
            eng = OPS.current_stream(DEV)
            side = eng if CPU else torch.cuda.Stream(DEV)
            fwd = OPS.event()
            fwd.record(eng)
            with OPS.use(side):
                d_ids = ids_on(ids, DEV)
                side.wait_event(fwd)
                buf = torch.empty(n * rb, dtype=torch.uint8, device=DEV)
                gather_records(views(lay), d_ids, buf, record_bytes=rb, header_bytes=hb, layer_bytes=lb)
                slab.tensor[: n * rb].copy_(buf, non_blocking=True)
                ev = OPS.event()
                ev.record(side)
            return lambda: (ev.synchronize(), buf)

        trials = 2 if CPU else 5
        bad_ours = [corrupted(ours, host_records) for _ in range(trials)]
        bad_ctrl = [corrupted(unsafe, host_records) for _ in range(trials)]
        print(f"[A2] host-slab save, corrupted (record, layer) pairs per trial of {n * lay.shape.num_layers}: "
              f"ours {bad_ours} (expect all 0); control without the engine's wait for the gather {bad_ctrl} "
              f"(expect some > 0, else this check has no teeth here)")

        # A3: a GPU-direct save: the engine thread queues the gather only; the writer does the rest
        encode_blocks_on_device(lay, ids, nss, keys, par, dev_out)  # writer stream, checksum tables
        for _ in range(3):
            forward_ms(100)
            t0 = time.perf_counter()
            second = begin_encode_on_device(lay, ids, nss, keys, par, dev_out)
            t1 = time.perf_counter()
            wrote = on_writer_thread(second)
            t2 = time.perf_counter()
            print(f"[A3] GPU-direct save: begin_encode_on_device (engine thread) returned in {ms(t1 - t0)} with a "
                  f"100 ms forward queued (expect < 2); the writer thread's half {ms(t2 - t1)} (expect ~100), "
                  f"{wrote} bytes")
        for t in lay.tensors:
            t.normal_()
        encode_blocks_on_device(lay, ids, nss, keys, par, dev_out)
        encode_blocks(on_cpu(lay), ids, nss, keys, par, ref)
        same = bool(torch.equal(dev_out[: n * rb].cpu(), torch.from_numpy(ref)))
        forward_ms(100)
        t0 = time.perf_counter()
        encode_blocks_on_device(lay, ids, nss, keys, par, dev_out)
        print(f"[A3] GPU-direct records equal to the CPU encoder's: {same} (expect True); encode_blocks_on_device "
              f"(both halves on one thread, never the engine's) {ms(time.perf_counter() - t0)} with a 100 ms "
              f"forward queued (expect ~100)")

        def ours_direct() -> Callable[[], Any]:
            second = begin_encode_on_device(lay, ids, nss, keys, par, dev_out)
            return lambda: on_writer_thread(second)

        bad_direct = [corrupted(ours_direct, lambda: dev_out[: n * rb].clone()) for _ in range(trials)]
        print(f"[A4] GPU-direct save, corrupted (record, layer) pairs per trial: {bad_direct} (expect all 0)")
    finally:
        pool.release(slab)
        pool.close()


