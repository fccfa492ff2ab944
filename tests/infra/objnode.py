"""A second "node" for cross-process tests: ``python tests/infra/objnode.py CMD ARGS-JSON``.

``restore``: open an ObjectTier on the bucket with no local state, restore the given prefixes
into a staging slab (one ranged GET per contiguous run), verify every record, promote them
into a HostTier and read them back from there; print a JSON report.
``flush``: flush every unflushed segment of a FakeSegmentSource directory (used to be killed
mid-upload with SIGKILL).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynamo_tiered_kv.blocks.codec import verify_record
from dynamo_tiered_kv.staging.slabs import StagingPool
from dynamo_tiered_kv.tiers.base import ReadRequest
from dynamo_tiered_kv.tiers.host import HostTier
from dynamo_tiered_kv.tiers.objectstore import ObjectTier, backend_from_url
from dynamo_tiered_kv.tiers.objectstore.flush import Flusher
from infra.segments_fake import FakeSegmentSource


async def restore(args: dict) -> dict:
    tier = ObjectTier(backend_from_url(args["url"], **args.get("s3", {})))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    host = HostTier(64 << 20, pin=False)
    pool = StagingPool(32 << 20, 1, pin=False)
    out: dict = {"prefixes": [], "blocks_indexed": tier.usage().num_blocks}
    try:
        for keys_hex in args["prefixes"]:
            keys = [bytes.fromhex(k) for k in keys_hex]
            n = tier.contains_prefix(keys)
            sizes = [tier.size_of(k) or 0 for k in keys[:n]]
            gets = tier.stats.gets
            with pool.slab() as slab:
                view, reqs, off = slab.view, [], 0
                for k, s in zip(keys[:n], sizes):
                    reqs.append(ReadRequest(k, view[off:off + s]))
                    off += s
                got = await tier.read_many(reqs)
                ok = all(g == s for g, s in zip(got, sizes))
                for r in reqs:
                    verify_record(r.into, key=r.key)  # raises on any mismatch
                    await host.write(r.key, r.into)  # promotion into the faster tier
            digests = []
            for k, s in zip(keys[:n], sizes):
                buf = bytearray(s)
                assert await host.read_into(k, memoryview(buf)) == s
                digests.append(__import__("hashlib").sha256(buf).hexdigest())
            out["prefixes"].append({"restored": n, "ok": ok, "gets": tier.stats.gets - gets, "sha256": digests})
    finally:
        await tier.close()
        pool.close()
    return out


async def flush(args: dict) -> dict:
    src = FakeSegmentSource(Path(args["ssd"]))
    tier = ObjectTier(backend_from_url(args["url"], **args.get("s3", {})))
    await tier.open()
    await tier.wait_ready()  # open() returns at once; the index builds in the background
    fl = Flusher(src, tier, scan_interval_s=0.05)
    await fl.start()
    print(json.dumps({"started": True}), flush=True)
    done = await fl.drain(timeout=args.get("timeout", 60))
    await fl.stop()
    await tier.close()
    return {"drained": done}


if __name__ == "__main__":
    cmd, raw = sys.argv[1], sys.argv[2]
    result = asyncio.run({"restore": restore, "flush": flush}[cmd](json.loads(raw)))
    print(json.dumps(result), flush=True)
