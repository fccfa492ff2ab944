"""A small ``SegmentSource`` over real segment-like files, standing in for the SSD tier.

Each segment file is real records (``make_record``) back to back, then a 4 KiB footer. Which
segments are flushed is kept durably in ``flushed.json`` (temp + rename), so a second instance
over the same directory sees the same progress, as after a restart.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from dynamo_tiered_kv.blocks.keys import ROOT_KEY
from dynamo_tiered_kv.testing import make_record, random_key, small_shape
from dynamo_tiered_kv.tiers.segments import SealedSegment, SegmentEntry

FOOTER = 4096


class FakeSegmentSource:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._state = self.root / "flushed.json"
        self._segments: dict[str, SealedSegment] = {}
        self._flushed: set[str] = set(json.loads(self._state.read_text())) if self._state.exists() else set()
        self.pins: dict[str, int] = {}
        self.max_pins_seen = 0
        self._lock = threading.Lock()
        for meta in sorted(self.root.glob("*.meta.json")):
            seg = _load(meta)
            self._segments[seg.segment_id] = seg

    def add_segment(self, n_records: int, seed: int, *, num_layers: int = 2, sealed_at: float | None = None,
                    chain: bool = True) -> tuple[SealedSegment, list[bytes]]:
        """Write a sealed segment of ``n_records`` records (a prefix chain when ``chain``)."""
        sid = f"seg-{seed:06d}"
        path = self.root / f"{sid}.seg"
        shape = small_shape(num_layers=num_layers)
        entries, recs, parent, off = [], [], ROOT_KEY, 0
        with open(path, "wb") as f:
            for i in range(n_records):
                key = random_key(seed * 100_000 + i, b"seg")
                rec = make_record(key, seed * 100_000 + i, shape=shape, parent=parent if chain else ROOT_KEY)
                f.write(rec)
                entries.append(SegmentEntry(key, off, len(rec)))
                recs.append(rec)
                off += len(rec)
                parent = key
            f.write(b"\xfe" * FOOTER)
            f.flush()
            os.fsync(f.fileno())
        seg = SealedSegment(sid, path, off + FOOTER, tuple(entries), sealed_at or time.time())
        meta = {"id": sid, "path": str(path), "size": seg.size, "sealed_at": seg.sealed_at,
                "entries": [[e.key.hex(), e.offset, e.length] for e in entries]}
        (self.root / f"{sid}.meta.json").write_text(json.dumps(meta))
        self._segments[sid] = seg
        return seg, recs

    # --- SegmentSource ----------------------------------------------------------------------
    def unflushed_segments(self) -> list[SealedSegment]:
        with self._lock:
            segs = [s for s in self._segments.values() if s.segment_id not in self._flushed]
        return sorted(segs, key=lambda s: s.sealed_at)

    def mark_flushed(self, segment_id: str) -> None:
        with self._lock:
            self._flushed.add(segment_id)
            tmp = self._state.with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(self._flushed)))
            os.replace(tmp, self._state)

    def pin_segment(self, segment_id: str) -> bool:
        seg = self._segments.get(segment_id)
        if seg is None or not seg.path.exists():
            return False
        self.pins[segment_id] = self.pins.get(segment_id, 0) + 1
        self.max_pins_seen = max(self.max_pins_seen, sum(self.pins.values()))
        return True

    def unpin_segment(self, segment_id: str) -> None:
        self.pins[segment_id] -= 1
        if not self.pins[segment_id]:
            del self.pins[segment_id]

    def is_flushed(self, segment_id: str) -> bool:
        return segment_id in self._flushed


def _load(meta: Path) -> SealedSegment:
    m = json.loads(meta.read_text())
    entries = tuple(SegmentEntry(bytes.fromhex(k), o, n) for k, o, n in m["entries"])
    return SealedSegment(m["id"], Path(m["path"]), m["size"], entries, m["sealed_at"])
