"""DynamoTieredKVTier loads from the SSD straight into vLLM's CPU rows (no staging slab and scatter
copy), verified in the row: a corrupt chunk fails and is recomputed, never reported loaded."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from infra.s3util import count_slab_takes
from tiering_engine import Engine, keys, payload
from vllm.v1.kv_offload.base import LookupResult

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def ssd(tmp_path: Path) -> dict[str, object]:
    return {"ssd_dir": str(tmp_path / "ssd"), "ssd_segment_bytes": 1 << 20, "ssd_capacity_bytes": 64 << 20,
            "staging_slab_bytes": 256 << 10, "staging_slabs": 4}


def count_staging_slabs(eng: Engine) -> list[int]:
    """Counts every staging slab our store takes from now on (element 0)."""
    return count_slab_takes(eng.tier.store.staging)


def _stored(tmp_path: Path, n: int) -> list:
    ks = keys(n)
    first = Engine.start(ssd(tmp_path), chunks=max(8, n))
    first.store(ks)
    first.settle()
    assert first.tier.store.drain(30)
    first.stop()
    return ks


def _flip_a_payload_byte(root: Path, chunk: np.ndarray) -> None:
    needle = chunk[4000:4064].tobytes()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        data = bytearray(f.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at + 9] ^= 0x02
            f.write_bytes(bytes(data))
            return
    raise AssertionError("record payload not found in the SSD files")


def test_a_load_reads_its_chunks_straight_into_vllms_rows(tmp_path: Path) -> None:
    ks = _stored(tmp_path, 12)
    eng = Engine.start(ssd(tmp_path), chunks=16)
    try:
        taken = count_staging_slabs(eng)
        assert eng.lookup(ks) == [HIT] * 12
        assert taken[0] == 0  # no slab: no copy through staging on the way into the rows
        assert all(np.array_equal(eng.read(k), payload(k)) for k in ks)
        assert eng.tier.store.metrics.value("tier_hits", tier="ssd") == 12
    finally:
        eng.stop()


def test_a_corrupt_chunk_read_into_its_row_fails_and_is_recomputed(tmp_path: Path) -> None:
    """The middle chunk of one promotion job is corrupt on the SSD: it is verified in its row, the
    job reports only the first chunk loaded, vLLM recomputes the others, and the recomputed chunk
    is stored and served again with the right bytes."""
    ks = _stored(tmp_path, 3)
    _flip_a_payload_byte(tmp_path / "ssd", payload(ks[1]))
    eng = Engine.start(ssd(tmp_path))
    try:
        taken = count_staging_slabs(eng)
        results = []
        tier_poll = eng.tier.get_finished_jobs
        eng.tier.get_finished_jobs = lambda: results.extend(r := list(tier_poll())) or r  # type: ignore[method-assign]
        with eng.manager.lock:
            assert [eng.manager.lookup(k, eng.ctx) for k in ks] == [LookupResult.HIT_PENDING] * 3
        eng.settle()
        (res,) = results
        assert not res.success and list(res.successful_keys or ()) == ks[:1]
        assert taken[0] == 0  # verified where it landed, in vLLM's row
        assert eng.lookup(ks) == [HIT, MISS, MISS]
        assert eng.tier.store.metrics.value("checksum_failures", tier="ssd") == 1
        assert np.array_equal(eng.read(ks[0]), payload(ks[0]))
        # vLLM recomputes the failed chunks and saves them again: served with the right bytes
        eng.store(ks[1:])
        eng.settle()
        assert eng.tier.store.drain(30)
        eng.evict_primary()
        assert eng.lookup(ks) == [HIT] * 3
        assert all(np.array_equal(eng.read(k), payload(k)) for k in ks)
    finally:
        eng.stop()


def test_after_a_load_waits_past_its_deadline_on_a_read_loads_go_through_staging(tmp_path: Path) -> None:
    """A stalled SSD read into vLLM's rows is waited for (the row must not be handed back while the
    read can still land in it); the job fails and later loads use staging slabs, which a load can
    abandon at its deadline."""
    ks = _stored(tmp_path, 4)
    eng = Engine.start({**ssd(tmp_path), "load_timeout_s": 0.2})
    try:
        (ours,) = eng.tier.store.tiers
        real, gate = ours.read_split_now, threading.Event()

        def stalled(keys, parts, rb):  # type: ignore[no-untyped-def]
            gate.wait(10)
            return real(keys, parts, rb)

        ours.read_split_now = stalled  # type: ignore[method-assign]
        threading.Timer(0.6, gate.set).start()
        results = []
        tier_poll = eng.tier.get_finished_jobs
        eng.tier.get_finished_jobs = lambda: results.extend(r := list(tier_poll())) or r  # type: ignore[method-assign]
        with eng.manager.lock:
            assert [eng.manager.lookup(k, eng.ctx) for k in ks[:2]] == [LookupResult.HIT_PENDING] * 2
        eng.settle()
        (res,) = results
        assert not res.success and not res.successful_keys
        assert eng.tier.store.metrics.value("restores_abandoned", reason="deadline") == 1
        taken = count_staging_slabs(eng)
        assert eng.lookup(ks[2:]) == [HIT, HIT]
        assert taken[0] > 0  # staged this time
        assert all(np.array_equal(eng.read(k), payload(k)) for k in ks[2:])
    finally:
        eng.stop()
