"""tiering: our vLLM secondary tier next to vLLM 0.33's own ``fs`` and ``obj`` tiers, under the same manager.

Every tier runs below the same vLLM ``TieringOffloadingManager`` and CPU primary, on the same
chunks (``--tokens``-token prefixes, 256-token chunks, one model shape per ``--kib-per-token``):

* ``dtkv``: ours with an SSD directory (segment log, checksummed records);
* ``fs``: vLLM's file-per-chunk tier in a sibling directory of the same filesystem;
* ``dtkv-s3``: ours with the object store alone; ``obj``: vLLM's NIXL OBJ tier; both against the
  same S3 server (``--s3-endpoint``/``DTKV_S3_ENDPOINT``; without one they are left out).

Per tier and shape: store GB/s (``complete_store`` to every tier job done and, for ours, every
accepted write on the medium), load GB/s in ANOTHER process (a restart: lookups, promotions,
bytes checked against what was stored; page cache dropped before each run when root),
requests and objects per prefix (S3: the RGW's own counters with ``--rgw-admin-socket``; local:
the process's read/write syscalls), lookup time for ``--lookup-keys`` keys, bytes on disk after
writing ``--churn`` times a capacity, and what one flipped byte per chunk does to a load. S3
tiers also: restore time per run and requests per restored GB (the RGW's counters with
``--rgw-admin-socket``; else, for ours, its object backend's own counters).

HDD mode (``--osd-op-delay-ms 8``, bucket on a local Ceph RGW): every OSD op waits that long
while the runs (stores and loads) are measured, as on one spindle that seeks once per op
(``osd_delay``); the RGW's admin socket is then found too, so requests are counted for every tier.

Each phase is its own process (``phases``), with vLLM 0.33 first on ``sys.path``
(``--vllm-path``, default ``.deps/vllm-0.33``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .. import osd_delay, report
from . import raw_s3

GiB = 1 << 30
MiB = 1 << 20
CHUNK_TOKENS = 256  # phases: 16 blocks of 16 tokens
SEGMENT_SUFFIX = ".dtkv"
HEADER = 4096  # one-layer record header (docs/FORMAT.md)
RAW = "s3-raw"  # the S3 server's own ceiling (raw_s3), run beside the S3 tiers


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", type=Path, default=Path("dtkv-bench-tiering"),
                   help="parent of each local tier's directory (one filesystem for all; O_DIRECT-capable)")
    p.add_argument("--tiers", default="dtkv,fs,dtkv-s3,obj", help="tiers to run, comma-separated")
    p.add_argument("--kib-per-token", default="8,128", help="model shapes: KV bytes per token in KiB (fractions "
                                                           "allowed: 16.875 is 27 layers x 2 KV heads of 80, fp16)")
    p.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS, help="tokens per offload chunk (16-token blocks)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per prefix (multiple of 256)")
    p.add_argument("--gib-per-run", type=float, default=1.0, help="bytes stored per run (at least one prefix)")
    p.add_argument("--runs", type=int, default=3, help="runs (each on its own prefixes)")
    p.add_argument("--lookup-keys", type=int, default=10_000, help="keys in the lookup test")
    p.add_argument("--churn-capacity-mib", type=int, default=512, help="SSD capacity for the churn test")
    p.add_argument("--churn", type=float, default=4.0, help="bytes written in the churn test / capacity")
    p.add_argument("--skip", default="", help="parts to leave out: churn,flip,lookup,raw (the S3 server's "
                                              "ceiling: plain parallel ranged GETs of the same bytes)")
    p.add_argument("--s3-endpoint", default=os.environ.get("DTKV_S3_ENDPOINT"), help="S3 server for dtkv-s3 and obj")
    p.add_argument("--rgw-admin-socket", default=None, help="Ceph RGW admin socket: count its S3 requests")
    p.add_argument("--bucket", default="dtkv-bench-tiering", help="bucket (created if missing)")
    p.add_argument("--vllm-path", type=Path, default=Path(".deps/vllm-0.33"), help="vLLM 0.33 sources")
    p.add_argument("--quick", action="store_true", help="small sizes, one run (CI smoke run)")
    osd_delay.add_arguments(p)


def _worker(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.vllm_path.resolve()),
                                                        *filter(None, [os.environ.get("PYTHONPATH")])]),
           # vLLM's obj tier (AWS C++ SDK): no aws-chunked checksum trailers, which older S3 servers
           # (Ceph RGW 16) refuse with 411; our tier's aiobotocore is configured the same way
           "AWS_REQUEST_CHECKSUM_CALCULATION": "WHEN_REQUIRED", "AWS_RESPONSE_CHECKSUM_VALIDATION": "WHEN_REQUIRED"}
    p = subprocess.run([sys.executable, "-m", "dynamo_tiered_kv.bench.tiering.phases", json.dumps(spec)],
                       capture_output=True, text=True, env=env, timeout=3600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{spec['tier']} {spec['phase']} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def _s3(args: argparse.Namespace) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=args.s3_endpoint, region_name=os.environ.get("AWS_REGION", "us-east-1"),
                        aws_access_key_id=os.environ.get("DTKV_S3_ACCESS_KEY", "testing"),
                        aws_secret_access_key=os.environ.get("DTKV_S3_SECRET_KEY", "testing"))


def _settings(args: argparse.Namespace, tier: str, where: Path, prefix: str, row: int,
              capacity: int | None = None) -> dict[str, Any]:
    if tier == "fs":
        return {"root_dir": str(where)}
    ak, sk = os.environ.get("DTKV_S3_ACCESS_KEY", "testing"), os.environ.get("DTKV_S3_SECRET_KEY", "testing")
    if tier == "obj":
        host = args.s3_endpoint.split("://", 1)[-1].rstrip("/")
        return {"store_config": {"bucket": args.bucket, "endpoint_override": host, "access_key": ak,
                                 "secret_key": sk, "region": "us-east-1",
                                 "scheme": args.s3_endpoint.split("://", 1)[0]}, "prefix": prefix}
    ours: dict[str, Any] = {"model_id": "bench", "staging_slab_bytes": max(32 * MiB, 2 * row),
                            "ssd_segment_bytes": max(256 * MiB, 4 * row) if capacity is None else 4 * row}
    if capacity is not None:
        ours.update(ssd_capacity_bytes=capacity, ssd_allow_evict_unflushed=True)
    if tier == "dtkv":
        return {**ours, "ssd_dir": str(where)}
    return {**ours, "object_url": f"s3://{args.bucket}/{prefix}", "s3_endpoint_url": args.s3_endpoint,
            "s3_access_key": ak, "s3_secret_key": sk}


def _disk(tier: str, where: Path, args: argparse.Namespace, prefix: str) -> tuple[int, int]:
    """(bytes, objects) a tier holds: files under its directory, or objects under its S3 prefix."""
    if tier in ("dtkv", "fs"):
        files = [f for f in where.rglob("*") if f.is_file() and f.suffix in (SEGMENT_SUFFIX, ".bin")]
        return sum(f.stat().st_blocks * 512 for f in files), len(files)
    total = n = 0
    for page in _s3(args).get_paginator("list_objects_v2").paginate(Bucket=args.bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            if tier == "obj" or _is_segment(o["Key"]):
                total, n = total + o["Size"], n + 1
    return total, n


def _is_segment(key: str) -> bool:
    """Ours: segment objects (records back to back, as on the SSD); not manifests."""
    return key.endswith((".seg", SEGMENT_SUFFIX))


def _flip_offsets(tier: str, size: int, row: int) -> list[int]:
    """One byte in the payload of every chunk a file/object holds."""
    if tier in ("fs", "obj"):
        return [size // 2]
    rec = HEADER + -(-row // HEADER) * HEADER  # the payload is padded to 4 KiB
    return [k * rec + HEADER + row // 2 for k in range(size // rec)]


def _flip(tier: str, where: Path, args: argparse.Namespace, prefix: str, row: int, tag: str) -> int:
    """Flip one byte per stored chunk of run 0 (ours: of every record in the segments); returns flips."""
    flips = 0
    if tier in ("dtkv", "fs"):
        for f in where.rglob("*"):
            if not f.is_file() or f.suffix not in (SEGMENT_SUFFIX, ".bin"):
                continue
            with open(f, "r+b") as fh:
                for off in _flip_offsets(tier, f.stat().st_size, row):
                    fh.seek(off)
                    b = fh.read(1)
                    fh.seek(off)
                    fh.write(bytes([b[0] ^ 0x01]))
                    flips += 1
        return flips
    s3 = _s3(args)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=args.bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            offs = _flip_offsets(tier, o["Size"], row)
            if not offs or (tier != "obj" and not _is_segment(o["Key"])):
                continue
            body = bytearray(s3.get_object(Bucket=args.bucket, Key=o["Key"])["Body"].read())
            for off in offs:
                body[off] ^= 0x01
            s3.put_object(Bucket=args.bucket, Key=o["Key"], Body=bytes(body))
            flips += len(offs)
    return flips


def _clear(tier: str, where: Path, args: argparse.Namespace, prefix: str) -> None:
    shutil.rmtree(where, ignore_errors=True)
    if tier not in ("dtkv-s3", "obj", RAW):
        return
    s3 = _s3(args)
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=args.bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=args.bucket, Delete={"Objects": keys})
    except Exception as e:  # a slow server's delete timing out must not lose the measurements
        report.progress("tiering", f"could not delete s3://{args.bucket}/{prefix}: {type(e).__name__}: {e}")


def _range(xs: list[float]) -> dict[str, float] | None:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else None


def _shape(args: argparse.Namespace, tiers: list[str], kib: int, plan: dict[str, Any], skip: set[str],
           failed: list[dict[str, Any]], ceph: osd_delay.LocalCeph | None = None) -> list[dict[str, Any]]:
    """Every tier on one model shape, run by run: run ``i`` of each tier (a store process, then a
    load process) before run ``i + 1`` of any, the tiers' order reversed every other run, so a
    shared disk's or server's drift over minutes falls on all tiers alike. Ratios pair run ``i``
    of ours with run ``i`` of the peer (``targets``). With ``ceph``, its OSDs are delayed for
    the runs (not for the uploads before them nor the flip test after)."""
    row = int(kib * 1024 * args.chunk_tokens)
    chunks = plan["tokens"] // args.chunk_tokens
    prefixes = max(1, int(plan["bytes_per_run"] // (row * chunks)))
    lookup_keys = 0 if "lookup" in skip else plan["lookup_keys"]
    state: dict[str, dict[str, Any]] = {}
    for tier in tiers:
        name = f"{tier}-{kib}k"
        where, prefix = args.dir.resolve() / name, f"bench-{name}-{os.getpid()}"
        _clear(tier, where, args, prefix)
        base = {"tier": tier, "settings": _settings(args, tier, where, prefix, row), "row_bytes": row,
                "chunks_per_prefix": chunks, "prefixes": prefixes, "primary_chunks": prefixes * chunks + 8,
                "model": f"bench/kv-{kib}k", "tag": name, "runs": 1, "rgw_admin_socket": args.rgw_admin_socket,
                "blocks_per_chunk": args.chunk_tokens // 16}
        state[tier] = {"name": name, "where": where, "prefix": prefix, "base": base, "stored": [], "loaded": []}
    order = list(tiers)
    if "raw" not in skip and args.s3_endpoint and {"dtkv-s3", "obj"} & set(tiers) and raw_s3.available():
        prefix = f"bench-{RAW}-{kib}k-{os.getpid()}"
        report.progress("tiering", f"{RAW} {kib}k: upload {prefixes} objects of {row * chunks // MiB} MiB")
        keys = raw_s3.upload(_s3(args), args.bucket, prefix, prefixes, row * chunks)
        state[RAW] = {"name": f"{RAW}-{kib}k", "where": args.dir.resolve() / RAW, "prefix": prefix, "keys": keys,
                      "base": {"prefixes": prefixes}, "loaded": []}
        order.append(RAW)
    with osd_delay.measured(ceph, args.osd_op_delay_ms):
        _runs(args, plan, order, state, failed, kib, prefixes, chunks, row, lookup_keys)
    rows = [_summarize(args, tier, kib, plan, skip, st) for tier, st in state.items() if tier != RAW]
    if RAW in state:
        rows.append(_summarize_raw(args, kib, state[RAW]))
    return rows


def _runs(args: argparse.Namespace, plan: dict[str, Any], order: list[str], state: dict[str, dict[str, Any]],
          failed: list[dict[str, Any]], kib: int, prefixes: int, chunks: int, row: int, lookup_keys: int) -> None:
    """``plan["runs"]`` runs of every tier in ``order``, alternating the order; a tier that fails
    is dropped from ``state`` and recorded in ``failed``."""
    for i in range(plan["runs"]):
        for tier in order if i % 2 == 0 else order[::-1]:
            st = state.get(tier)
            if st is None:  # failed in an earlier run
                continue
            try:
                if tier == RAW:
                    st["loaded"].append(raw_s3.read_run(_s3(args), args.bucket, st["keys"], row * chunks))
                    continue
                report.progress("tiering", f"{st['name']} run {i + 1}/{plan['runs']}: store {prefixes} prefixes "
                                           f"of {chunks} chunks, then load them in a new process")
                st["stored"].append(_worker(args, {**st["base"], "phase": "store", "first_run": i}))
                st["loaded"].append(_worker(args, {**st["base"], "phase": "load", "first_run": i,
                                                   "lookup_keys": lookup_keys if i == 0 else 0}))
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:  # this tier's failure: the rest run on
                failed.append({"tier": tier, "kib_per_token": kib, "error": str(e)[-2000:]})
                report.progress("tiering", f"{tier} {kib} KiB/token failed: {str(e)[-500:]}")
                _clear(tier, st["where"], args, st["prefix"])
                del state[tier]


def _summarize_raw(args: argparse.Namespace, kib: int, st: dict[str, Any]) -> dict[str, Any]:
    """The S3 server's ceiling row (``raw_s3``): load GB/s and GETs per prefix of its best shape."""
    runs, prefixes = st["loaded"], st["base"]["prefixes"]
    _clear(RAW, st["where"], args, st["prefix"])
    return {"tier": RAW, "kib_per_token": kib, "prefixes_per_run": prefixes,
            "load_gbps": _range([r["gbps"] for r in runs]), "load_gbps_runs": [r["gbps"] for r in runs],
            "load_cpu_s_per_gb": _range([r["cpu_s"] / (r["bytes"] / 1e9) for r in runs]),
            "load_requests_per_prefix": {"s3_get": statistics.median(r["gets"] for r in runs) / prefixes},
            "shapes": [[{k: t[k] for k in ("piece_bytes", "parallel", "gbps")} for t in r["tries"]] for r in runs]}


def _summarize(args: argparse.Namespace, tier: str, kib: int, plan: dict[str, Any], skip: set[str],
               st: dict[str, Any]) -> dict[str, Any]:
    """One tier's row: its runs, what it holds, and (first shape only) what a flipped byte does."""
    base, where, prefix, name = st["base"], st["where"], st["prefix"], st["name"]
    row, chunks, prefixes = base["row_bytes"], base["chunks_per_prefix"], base["prefixes"]
    stored = [r for w in st["stored"] for r in w["runs"]]
    loaded = [r for w in st["loaded"] for r in w["runs"]]
    disk_bytes, objects = _disk(tier, where, args, prefix)
    per_run_bytes = prefixes * chunks * row
    store_runs = [per_run_bytes / r["written_s"] / 1e9 for r in stored]
    load_runs = [r["bytes"] / r["load_s"] / 1e9 if r["load_s"] > 0 else 0.0 for r in loaded]
    out: dict[str, Any] = {
        "tier": tier, "kib_per_token": kib, "row_bytes": row, "prefixes_per_run": prefixes,
        "chunks_per_prefix": chunks, "bytes_per_run": per_run_bytes,
        "store_gbps": _range(store_runs), "store_gbps_runs": store_runs,
        "store_jobs_gbps": _range([per_run_bytes / r["jobs_done_s"] / 1e9 for r in stored]),
        "load_gbps": _range([x for x in load_runs if x > 0]), "load_gbps_runs": load_runs,
        # the client's CPU (every thread of the load process) per GB loaded
        "load_cpu_s_per_gb": _range([r.get("load_cpu_s", r["cpu_s"]) / (r["bytes"] / 1e9) for r in loaded
                                     if r.get("cpu_s") and r["bytes"]]),
        # of what the tier held when its writer exited (a store job may fail: vLLM keeps it uncached)
        "stored_share": sum(r["stored"] for r in stored) / (len(stored) * prefixes * chunks),
        "found_after_restart": sum(r["hits"] for r in loaded) / max(1, sum(r["stored"] for r in stored)),
        "wrong_bytes_loaded": sum(r["wrong_bytes"] for r in loaded),
        "page_cache_dropped": all(r["page_cache_dropped"] for r in loaded),
        "objects_per_prefix": objects / (len(stored) * prefixes),
        "bytes_on_medium_per_stored_byte": disk_bytes / (len(stored) * per_run_bytes),
        "store_requests_per_prefix": _per_prefix(stored, prefixes, tier, "put", "syscw"),
        "load_requests_per_prefix": _per_prefix(loaded, prefixes, tier, "get", "syscr"),
        "load_storage_bytes_per_prefix": statistics.median(r["io"].get("read_bytes", 0) for r in loaded)
        / prefixes,
        "backpressure": st["loaded"][0].get("backpressure"),
        # ours on S3 alone: its index of the bucket is built in the background at start (lookups miss
        # until then); the loads are timed once it is ready
        "index_wait_s": _range([w["index_wait_s"] for w in st["loaded"] if w.get("index_wait_s") is not None]),
        # the load phase of each run: every prefix restored at once
        "restore_s": _range([r["load_s"] for r in loaded]),
        "restore_bytes_per_run": statistics.median(r["bytes"] for r in loaded) if loaded else 0,
        **_requests_per_gb(tier, loaded),
    }
    if "lookup" in st["loaded"][0]:
        lk = st["loaded"][0]["lookup"]
        out["lookup"] = {"keys": lk["keys"], "hits": lk["hits"], "total_s": lk["lookup_s"],
                         "us_per_key": lk["lookup_s"] / lk["keys"] * 1e6, "rounds": lk["rounds"]}
    if "flip" not in skip and plan["flip"]:
        flips = _flip(tier, where, args, prefix, row, name)
        report.progress("tiering", f"{name}: {flips} bytes flipped, load again")
        again = _worker(args, {**base, "phase": "load", "lookup_keys": 0})["runs"][0]
        out["flip"] = {"flipped": flips, "chunks": again["chunks"], "returned_ok": again["verified"],
                       "returned_wrong": again["wrong_bytes"], "missed": again["chunks"] - again["hits"],
                       "load_failed": again["hits"] - again["verified"] - again["wrong_bytes"]}
    _clear(tier, where, args, prefix)
    return out


def _per_prefix(runs: list[dict[str, Any]], prefixes: int, tier: str, s3_key: str, io_key: str) -> dict[str, Any]:
    if tier in ("dtkv-s3", "obj"):
        vals = [r["s3_requests"].get(s3_key) for r in runs]
        alls = [r["s3_requests"].get("all") for r in runs]
        if None in vals or not vals:
            return {"s3": None}
        return {"s3_" + s3_key: statistics.median(vals) / prefixes, "s3_all": statistics.median(alls) / prefixes}
    return {io_key: statistics.median(r["io"].get(io_key, 0) for r in runs) / prefixes}


def _requests_per_gb(tier: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An S3 tier's requests per restored GB over its load runs: the RGW's count of every request
    when known, else ours by its own backend counters; None for local tiers or when uncounted."""
    if tier not in ("dtkv-s3", "obj"):
        return {"requests_per_restored_gb": None, "requests_counted_by": None}
    for source, count in (("rgw", lambda r: r["s3_requests"].get("all")), ("tier", lambda r: r.get("tier_requests"))):
        per = [c / (r["bytes"] / 1e9) for r in runs if r["bytes"] and (c := count(r)) is not None]
        if per and len(per) == len(runs):
            return {"requests_per_restored_gb": _range(per), "requests_counted_by": source}
    return {"requests_per_restored_gb": None, "requests_counted_by": None}


def _churn(args: argparse.Namespace, tier: str, kib: int, plan: dict[str, Any]) -> dict[str, Any]:
    """Write ``churn`` x the capacity in prefixes, then count what the tier keeps on disk."""
    row = int(kib * 1024 * args.chunk_tokens)
    chunks = plan["tokens"] // args.chunk_tokens
    cap = plan["churn_capacity"]
    prefixes = max(1, int(args.churn * cap // (row * chunks)))
    name = f"{tier}-churn"
    where = args.dir.resolve() / name
    _clear(tier, where, args, "")
    spec = {"tier": tier, "settings": _settings(args, tier, where, name, row, capacity=cap), "row_bytes": row,
            "chunks_per_prefix": chunks, "prefixes": prefixes, "primary_chunks": prefixes * chunks + 8,
            "model": f"bench/kv-{kib}k", "tag": name, "runs": 1, "phase": "store",
            "blocks_per_chunk": args.chunk_tokens // 16}
    report.progress("tiering", f"{name}: {prefixes} prefixes into a {cap // MiB} MiB capacity")
    _worker(args, spec)
    disk_bytes, files = _disk(tier, where, args, "")
    _clear(tier, where, args, "")
    return {"tier": tier, "capacity_bytes": cap, "written_bytes": prefixes * chunks * row, "disk_bytes": disk_bytes,
            "files": files, "disk_over_capacity": disk_bytes / cap,
            "capacity_setting": tier == "dtkv"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    skip = {s for s in args.skip.split(",") if s}
    tiers = [t for t in args.tiers.split(",") if t]
    if not args.s3_endpoint:
        tiers = [t for t in tiers if t not in ("dtkv-s3", "obj")]
    kibs = [float(k) if "." in k else int(k) for k in args.kib_per_token.split(",") if k]
    plan = {"tokens": args.tokens, "bytes_per_run": args.gib_per_run * GiB, "runs": args.runs,
            "lookup_keys": args.lookup_keys, "churn_capacity": args.churn_capacity_mib * MiB, "flip": True}
    if args.quick:
        plan.update(tokens=1024, bytes_per_run=32 * MiB, runs=1, lookup_keys=min(args.lookup_keys, 500),
                    churn_capacity=16 * MiB)
        kibs = kibs[:1]
    if args.chunk_tokens <= 0 or args.chunk_tokens % 16:
        raise SystemExit("--chunk-tokens must be a positive multiple of 16")
    if plan["tokens"] % args.chunk_tokens:
        raise SystemExit(f"--tokens must be a multiple of {args.chunk_tokens}")
    ceph = osd_delay.hdd_mode("tiering", args.s3_endpoint, args.osd_op_delay_ms, args.ceph_dir)
    if ceph is not None and not {"dtkv-s3", "obj"} & set(tiers):
        raise SystemExit("bench tiering: --osd-op-delay-ms delays the S3 tiers' Ceph: add dtkv-s3 or obj to --tiers")
    if ceph is not None and args.rgw_admin_socket is None and ceph.rgw_socket is not None:
        args.rgw_admin_socket = str(ceph.rgw_socket)  # count every tier's requests at the server
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.s3_endpoint and any(t in tiers for t in ("dtkv-s3", "obj")):
        s3 = _s3(args)
        try:
            s3.head_bucket(Bucket=args.bucket)
        except Exception:  # absent (or not visible yet): create it
            s3.create_bucket(Bucket=args.bucket)
    t0 = time.monotonic()
    rows, failed = [], []
    for kib in kibs:
        rows += _shape(args, tiers, kib, {**plan, "flip": kib == kibs[0]}, skip, failed, ceph)
        (args.dir / "partial.json").write_text(json.dumps(rows, indent=1))  # a long run's results so far
    churn = []
    for t in ([] if "churn" in skip else [t for t in tiers if t in ("dtkv", "fs")]):
        try:
            churn.append(_churn(args, t, kibs[0], plan))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            failed.append({"tier": t, "churn": True, "error": str(e)[-2000:]})
    machine = {"host": platform.node(), "cpus": os.cpu_count(), "dir": str(args.dir.resolve()),
               "fs": _fstype(args.dir), "s3_endpoint": args.s3_endpoint}
    delay = None if ceph is None else {"ms_per_op": args.osd_op_delay_ms, "ceph_dir": str(ceph.dir),
                                       "osd_sockets": [str(x) for x in ceph.osd_sockets]}
    return {"failed": failed, "machine": machine, "osd_op_delay": delay,
            "plan": {**plan, "kib_per_token": kibs, "tiers": tiers, "chunk_tokens": args.chunk_tokens},
            "tiers": rows, "churn": churn, "targets": targets(rows), "elapsed_s": time.monotonic() - t0}


def _fstype(d: Path) -> str | None:
    try:
        out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", str(d)], capture_output=True, text=True)
        return out.stdout.strip() or None
    except OSError:
        return None


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours against vLLM's tier of the same medium, per shape: the median (and range) of the
    ratios of the runs paired by number."""
    out = []
    by = {(r["tier"], r["kib_per_token"]): r for r in rows}
    for (tier, kib), r in by.items():
        peer = {"dtkv": "fs", "dtkv-s3": "obj"}.get(tier)
        p = by.get((peer, kib)) if peer else None
        if p is None:
            continue
        t: dict[str, Any] = {"ours": tier, "vllm": peer, "kib_per_token": kib}
        for what in ("load_gbps", "store_gbps"):  # run i of ours over run i of the peer
            pairs = _paired(r, p, what)
            t[what.replace("_gbps", "_ratio")] = statistics.median(pairs) if pairs else None
            t[what.replace("_gbps", "_ratio_range")] = _range(pairs)
        if peer == "obj":
            g_ours = r["load_requests_per_prefix"].get("s3_get")
            g_vllm = p["load_requests_per_prefix"].get("s3_get")
            t["get_requests_fewer_x"] = g_vllm / g_ours if g_ours and g_vllm else None
            raw = by.get((RAW, kib))
            if raw is not None:  # how much of the server each uses; raw/obj bounds any client's ratio
                for who, row in (("ours", r), ("vllm", p)):
                    t[f"{who}_load_over_raw_range"] = _range(_paired(row, raw, "load_gbps"))
                t["raw_over_vllm_load_range"] = _range(_paired(raw, p, "load_gbps"))
        t["goal"] = {"load_ratio": 2.0 if peer == "obj" else 1.0, "store_ratio": None if peer == "obj" else 0.9,
                     "get_requests_fewer_x": 10.0 if peer == "obj" else None}
        out.append(t)
    return out


def _paired(a: dict[str, Any], b: dict[str, Any], what: str) -> list[float]:
    """Run i of ``a`` over run i of ``b``."""
    return [x / y for x, y in zip(a.get(what + "_runs", ()), b.get(what + "_runs", ())) if x and y]


def format_result(res: dict[str, Any]) -> str:
    rows = []
    for r in res["tiers"]:
        if r["tier"] == RAW:
            rows.append([RAW, r["kib_per_token"], "-", _span(r["load_gbps"]), "-", "-", "-",
                         r["load_requests_per_prefix"]["s3_get"], "-", "-"])
            continue
        lk = r.get("lookup") or {}
        fl = r.get("flip") or {}
        req = r["load_requests_per_prefix"]
        rows.append([r["tier"], r["kib_per_token"], _span(r["store_gbps"]), _span(r["load_gbps"]),
                     r["stored_share"], r["found_after_restart"], r["objects_per_prefix"],
                     req.get("s3_get", req.get("syscr")), lk.get("us_per_key"),
                     f"{fl.get('returned_wrong', '-')}/{fl.get('missed', '-')}/{fl.get('flipped', '-')}"])
    out = [report.table(["tier", "KiB/tok", "store GB/s", "load GB/s", "stored", "found after restart",
                         "objects/prefix", "load reqs/prefix", "lookup us/key", "flip wrong/missed/flipped"], rows,
                        title=f"vLLM tiers side by side ({res['machine']['host']}, {res['machine']['fs']})")]
    lines = [osd_delay.summary_line(f"{r['tier']} {r['kib_per_token']}k (median of runs, requests counted by "
                                    f"{r['requests_counted_by'] or 'nothing'})",
                                    (r["requests_per_restored_gb"] or {}).get("median"), r["restore_s"]["median"],
                                    r["restore_bytes_per_run"], res.get("osd_op_delay"))
             for r in res["tiers"] if r.get("restore_s") and r["tier"] in ("dtkv-s3", "obj")]
    if lines:
        out.append("\n".join(lines))
    if res["churn"]:
        out.append(report.table(["tier", "capacity MiB", "written MiB", "on disk MiB", "disk/capacity"],
                                [[c["tier"], c["capacity_bytes"] / MiB, c["written_bytes"] / MiB,
                                  c["disk_bytes"] / MiB, c["disk_over_capacity"]] for c in res["churn"]],
                                title="churn"))
    if res["targets"]:
        out.append(report.table(
            ["ours", "vLLM", "KiB/tok", "load x", "store x", "GETs fewer x", "ours/raw", "vLLM/raw", "raw/vLLM"],
            [[t["ours"], t["vllm"], t["kib_per_token"], _span(t["load_ratio_range"]), _span(t["store_ratio_range"]),
              t.get("get_requests_fewer_x"), _span(t.get("ours_load_over_raw_range")),
              _span(t.get("vllm_load_over_raw_range")), _span(t.get("raw_over_vllm_load_range"))]
             for t in res["targets"]],
            title="ratios: run i of ours over run i of vLLM's, median (range)"))
    return "\n\n".join(out)


def _span(r: dict[str, float] | None) -> str:
    return "-" if r is None else f"{r['median']:.3g} ({r['min']:.3g}-{r['max']:.3g})"
