"""One engine session of ``dtkv bench restore``, run in its own process.

``python -m dynamo_tiered_kv.bench.restore.engine SPEC.json OUT.json``. SPEC: the keys of
``engine.session.Session`` plus

* ``long``, ``short``: prompts (token ids); ``store_first``: compute both once first (with the
  connector: they are stored), recorded under ``store``;
* ``rounds``: measured rounds, after one unmeasured round (``warm``, unless false); each round measures
  ``long`` and ``short`` (order alternating), the engine's prefix cache emptied before each, and
  ``evict`` directories dropped from the page cache before each request (cold files); right after
  ``long``, the same prompt again from the engine's own prefix cache (``resident``: the same
  computed tail over the same context, with no restore; its first token is what a restore must give);
* ``raw``: ceiling measured once per round, between the requests: ``"memcpy"`` (the bytes the long
  restore read), ``"odirect"`` (O_DIRECT ``preadv`` of the long prompt's records in tier
  ``raw_tier``), ``"s3"`` (ranged GETs of them from ``s3_endpoint`` / ``s3_bucket``), or null;
  ``raw_chunk_bytes``, ``raw_depth``: request size and requests in flight;
* ``persist``: at the end, seal the SSD segment and write it back to the object tier;
* ``sweep``: more prompts by size (``{"2048": tokens}``), stored with ``store_first`` and each
  measured every round like ``long`` (restored, then from the prefix cache), under
  ``sweep:SIZE`` / ``sweep_resident:SIZE``, with their own raw read in ``sweep_raw[SIZE]``.

Per dtkv request the store's ``LoadResult.stages`` (when the store reports them) are recorded.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from ..engine.session import Session, finish, progress, start
from . import raw


class LoadTap:
    """Wraps ``store.load`` of one store instance: the keys and stage timings of each call; and the
    worker's restore reports: how long each request waited in the engine for its restore."""

    def __init__(self, store: Any, worker: Any = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.waits: list[float] = []
        self.reports: list[dict[str, Any]] = []  # per restore: sync or async, steps it was pending
        orig = store.load
        if worker is not None and hasattr(worker, "_note_restored"):
            note = worker._note_restored

            def noted(r: Any) -> None:
                self.waits.append(r.engine_wait_s)  # submission -> reported to vLLM (runnable)
                self.reports.append({"sync": getattr(r, "sync", False), "steps": getattr(r, "steps", None),
                                     "queued_ms": r.queued_s * 1000, "load_ms": r.load_s * 1000})
                note(r)

            worker._note_restored = noted

        def load(layout: Any, block_ids: Any, keys: Any, *a: Any, **kw: Any) -> Any:
            res = orig(layout, block_ids, keys, *a, **kw)
            st = getattr(res, "stages", None)
            self.calls.append({"keys": list(keys), "tiers": list(getattr(res, "tier_per_block", [])),
                               "stages": dataclasses.asdict(st) if dataclasses.is_dataclass(st) else None})
            return res

        store.load = load

    def take(self) -> list[dict[str, Any]]:
        out, self.calls = self.calls, []
        return out

    def take_waits(self) -> list[float]:
        out, self.waits = self.waits, []
        return out

    def take_reports(self) -> list[dict[str, Any]]:
        out, self.reports = self.reports, []
        return out


def evict(dirs: list[str]) -> None:
    from ..tiers import _evict_page_cache

    for d in dirs:
        if Path(d).exists():
            _evict_page_cache(Path(d))


def stage_sums(calls: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One request's stages summed over its load calls (None when the store reports none)."""
    st = [c["stages"] for c in calls if c["stages"]]
    if not st:
        return None
    out: dict[str, Any] = {"wait_s": 0.0, "decode_s": 0.0, "total_s": 0.0, "chunks": 0, "read_s": {}, "read_bytes": {}}
    for s in st:
        for k in ("wait_s", "decode_s", "total_s", "chunks"):
            out[k] += s.get(k, 0)
        for k in ("read_s", "read_bytes"):
            for t, v in s.get(k, {}).items():
                out[k][t] = out[k].get(t, 0) + v
    return out


def _measure(s: Session, tap: LoadTap | None, prompt: list[int], spec: dict[str, Any]) -> dict[str, Any]:
    evict(spec.get("evict", []))
    rec = s.measure(prompt, reset=True)
    if tap is not None:
        calls = tap.take()
        rec["stages"] = stage_sums(calls)
        rec["_keys"] = [k for c in calls for k in c["keys"]]
        waits = tap.take_waits()
        rec["engine_wait_ms"] = sum(waits) * 1000 if waits else None
        rec["restore_reports"] = tap.take_reports()
    return rec


def _drop_taps(tap: LoadTap | None) -> None:
    if tap is not None:
        tap.take()
        tap.take_waits()
        tap.take_reports()


def _raw_for(kind: str | None, spec: dict[str, Any], rec: dict[str, Any], extents: Any, s3r: Any,
             buf: Any) -> float | None:
    """The raw ceiling of one restore: memcpy of the bytes it read, or the same records read raw."""
    if kind == "memcpy":
        nbytes = int(sum(rec.get("read_bytes", {}).values()))
        return raw.memcpy(nbytes) if nbytes else None
    if kind == "odirect" and extents:
        evict(spec.get("evict", []))
        return raw.odirect_read(extents, spec["raw_chunk_bytes"], spec["raw_depth"], buf)
    if kind == "s3" and extents and s3r is not None:
        return s3r.read(extents, spec["raw_chunk_bytes"], spec["raw_depth"])
    return None


def main(spec_path: str, out_path: str) -> None:
    spec, s, res = start(spec_path)
    res.update(rounds=[], raw=[], sweep_raw={})
    tap = LoadTap(s.store, s.worker) if s.store is not None else None
    prompts = {"long": spec["long"], "short": spec["short"]}
    sweep: dict[str, list[int]] = spec.get("sweep") or {}
    done = 0
    if spec.get("store_first"):
        res["store"] = {k: s.measure(p, reset=True) for k, p in {**prompts, **sweep}.items()}
        _drop_taps(tap)
        if s.store is not None:
            s.store.drain(120)
        done += 1
        progress(done)
    kind, s3r, buf = spec.get("raw"), None, None
    extents: dict[str, Any] = {}  # prompt name -> the raw ranges of what its restore read
    res["raw_kind"] = kind
    for r in range(0 if spec.get("warm", True) else 1, spec["rounds"] + 1):  # round 0: warm, unmeasured
        order = ["long", "short"] if r % 2 else ["short", "long"]
        recs: dict[str, Any] = {}
        keys: dict[str, Any] = {}
        for k in order + [f"sweep:{n}" for n in sweep]:
            prompt = prompts[k] if k in prompts else sweep[k.split(":")[1]]
            recs[k] = _measure(s, tap, prompt, spec)
            keys[k] = recs[k].pop("_keys", None)
            if k != "short":  # vLLM's prefix cache holds what was just restored or computed
                recs["resident" if k == "long" else f"sweep_resident:{k.split(':')[1]}"] = \
                    s.measure(prompt, reset=False)
                _drop_taps(tap)
        if r == 0:  # warm round: resolve the raw ranges of what each restore read
            res["warm"] = recs
            if kind in ("odirect", "s3") and s.store is not None:
                for k, ks in keys.items():
                    if k != "short" and ks:
                        extents[k] = raw.locate(s.store, ks, spec["raw_tier"])
                if "long" in extents:
                    res["raw_extents"] = len(extents["long"])
                    res["raw_bytes"] = sum(e[2] for e in extents["long"])
                if kind == "s3":
                    s3r = raw.S3Raw(spec["s3_endpoint"], spec["s3_bucket"])
                elif extents:
                    most = max(sum(e[2] for e in raw.merge(x)) for x in extents.values())
                    buf = raw.aligned_buffer(most)
            continue
        res["rounds"].append(recs)
        if kind == "memcpy":
            res["raw_bytes"] = int(sum(recs["long"].get("read_bytes", {}).values()))
        res["raw"].append(_raw_for(kind, spec, recs["long"], extents.get("long"), s3r, buf))
        for n in sweep:
            k = f"sweep:{n}"
            res["sweep_raw"].setdefault(n, []).append(_raw_for(kind, spec, recs[k], extents.get(k), s3r, buf))
        done += 1
        progress(done)
    if s3r is not None:
        s3r.close()
    finish(s, spec, res, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
