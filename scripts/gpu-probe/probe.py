"""GPU probe: measures, on one CUDA GPU, what the code of the GPU path is built to do.

Run from the repository root (``scripts/gpu-probe/run.sh`` or ``scripts/gpu-check`` set up the
path; PYTHONPATH must reach ``dynamo_tiered_kv`` and NIXL)::

    python3 scripts/gpu-probe/probe.py WORK_DIR         # WORK_DIR on a real disk (O_DIRECT), not tmpfs
    python3 scripts/gpu-probe/probe.py WORK_DIR --cpu   # dry run of every API call on a CPU

Every line starts with its measurement's tag and says what the code predicts ("expect ..."), so
one run confirms or refutes each prediction. The sections are independent: one that raises prints
its traceback and the next one runs. The probe measures; it does not judge. Exit status: 0 when
every section ran, 1 when one raised or cannot import (the traceback says where), 2 with no CUDA
device and no ``--cpu``.

  [A] save: the engine thread's part of a host-slab save (``begin_encode``) and of a GPU-direct
      save (``begin_encode_on_device``) with a forward queued; later engine kernels never reach
      the records (with a negative control that drops the engine's wait); the kernel warm-up.
  [B] restore: GB/s of the restore paths against a plain pinned host-to-device copy; one load's
      chunks with the engine idle and busy (one engine mark per load), with the per-chunk-mark
      behaviour as a control; a load does not wait for a forward queued after its mark.
  [C] the Triton mover, 16-byte and byte accesses, against the torch path and a plain copy_.
  [D] cuFile: GDS_MT with cuFile's default config (compat allowed) against the project's verdict
      (compat forbidden, a staging slab round trip, nvidia-fs counters), in fresh processes.
  [M] device memory the save and restore temporaries leave cached.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch
from probe_common import (
    CPU,
    DEV,
    RATE,
    SLAB,
    W,
    engine,
    failed,
    geometry,
    section,
    sync,
    views,
)
from probe_restore import B
from probe_save import A

from dynamo_tiered_kv.kernels import gather_records, scatter_records
from dynamo_tiered_kv.kernels import gather_scatter as gs
from dynamo_tiered_kv.staging.device_copy import ids_on


# --------------------------------------------------------------------------------------------
@section
def C() -> None:
    lay = engine(RATE, seed=5)
    rb, hb, lb = geometry(lay)
    n = RATE[4]
    ids = ids_on(range(n), DEV)
    vs = views(lay)
    payload = n * lay.shape.payload_bytes
    aligned = torch.zeros(n * rb, dtype=torch.uint8, device=DEV)
    odd = torch.zeros(n * rb + 16, dtype=torch.uint8, device=DEV)[1 : 1 + n * rb]  # byte accesses only
    torch_path = torch.zeros_like(aligned)

    def timed(fn: Callable[[], None], reps: int = 5) -> float:
        fn()  # compiles this variant
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t0) / reps

    def gather(out: torch.Tensor) -> None:
        gather_records(vs, ids, out, record_bytes=rb, header_bytes=hb, layer_bytes=lb)

    def scatter(recs: torch.Tensor) -> None:
        scatter_records(recs, vs, ids, record_bytes=rb, header_bytes=hb, layer_bytes=lb)

    t_g16, t_g1 = timed(lambda: gather(aligned)), timed(lambda: gather(odd))
    t_s16, t_s1 = timed(lambda: scatter(aligned)), timed(lambda: scatter(odd))
    have = gs._HAVE_TRITON
    gs._HAVE_TRITON = False
    try:
        t_gt, t_st = timed(lambda: gather(torch_path)), timed(lambda: scatter(torch_path))
    finally:
        gs._HAVE_TRITON = have
    x = torch.empty(payload, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    t_copy = timed(lambda: y.copy_(x))
    same = bool(torch.equal(aligned, torch_path) and torch.equal(odd, torch_path))
    widths = (gs.vector_bytes(vs, aligned, rb, hb, lb), gs.vector_bytes(vs, odd, rb, hb, lb))
    g = lambda t: f"{2 * payload / t / 1e9:7.1f} GB/s"  # noqa: E731
    print(f"[C] {n} blocks, {payload / 2**20:.0f} MiB payload (read+write GB/s); Triton used: "
          f"{gs._use_triton(lay.device, aligned.device, vs)} (expect True on a GPU); access bytes aligned/odd "
          f"{widths} (expect (16, 1)); Triton == torch bytes: {same} (expect True)")
    print(f"[C] gather  Triton 16-byte {g(t_g16)} | byte {g(t_g1)} | torch path {g(t_gt)} "
          f"(expect 16-byte >= 0.5x the plain copy and above the byte variant)")
    print(f"[C] scatter Triton 16-byte {g(t_s16)} | byte {g(t_s1)} | torch path {g(t_st)} (same)")
    print(f"[C] plain device copy_ of the same bytes {g(t_copy)}")


# --------------------------------------------------------------------------------------------
_GDS_DEFAULT = r"""
import os, sys, time
os.environ.pop("CUFILE_ENV_PATH_JSON", None)   # cuFile's own default: /etc/cufile.json or built-ins (compat allowed)
from pathlib import Path
import torch
from dynamo_tiered_kv.staging.device_slabs import DeviceSpan, DeviceStagingPool
from dynamo_tiered_kv.tiers.ssd.gds import DeviceIO
from dynamo_tiered_kv.tiers.ssd.gds_probe import nvfs_counters, nvfs_delta
if "--cpu" in sys.argv:
    print("[D1] default cuFile config: imports ok (dry run)")
    sys.exit(0)
d, nbytes = Path(sys.argv[1]), int(sys.argv[2])
print("[D1] libcufile mapped after importing torch:", "libcufile" in open("/proc/self/maps").read())
pool = DeviceStagingPool(nbytes, 2, "cuda")
print("[D1] device slab addresses % 64 KiB:", [s.address % 65536 for s in pool.slabs])
try:
    dio = DeviceIO("GDS_MT")
    dio.register(pool.slabs)
    dio.self_test(d)
    print("[D1] default cuFile config (compat allowed): GDS_MT backend + self-test PASSED")
    fd = os.open(d / "probe-gds.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    pool.slabs[0].tensor.random_(0, 255)
    torch.cuda.synchronize()
    s0, s1 = DeviceSpan(pool.slabs[0], 0, nbytes), DeviceSpan(pool.slabs[1], 0, nbytes)
    before = nvfs_counters()
    for _ in range(2):
        t = time.perf_counter(); dio.write(fd, [s0], 0); w = time.perf_counter() - t
        t = time.perf_counter(); dio.read(fd, [s1], 0); r = time.perf_counter() - t
    moved = nvfs_delta(before, nvfs_counters())
    print(f"[D1] {nbytes >> 20} MiB write {nbytes / w / 1e9:.2f} GB/s, read {nbytes / r / 1e9:.2f} GB/s, "
          f"bytes equal {torch.equal(pool.slabs[0].tensor, pool.slabs[1].tensor)}; nvidia-fs counters moved: {moved} "
          "(None: no nvidia-fs; expect the Writes/Reads or Mmap counters to move where it is loaded)")
    dio.forget(fd); os.close(fd); (d / "probe-gds.bin").unlink()
    dio.close()
except Exception as e:
    print("[D1] default cuFile config: GDS_MT failed:", type(e).__name__, str(e)[:300])
"""

_GDS_STRICT = r"""
import sys
from pathlib import Path
from dynamo_tiered_kv.tiers.ssd.gds_probe import gds_verdict, nvidia_fs_loaded, operator_config
from dynamo_tiered_kv.tiers.ssd.io import probe_odirect
if "--cpu" in sys.argv:
    print("[D2] project verdict: imports ok (dry run)")
    sys.exit(0)
d, nbytes = Path(sys.argv[1]), int(sys.argv[2])
print("[D2] nvidia_fs loaded:", nvidia_fs_loaded(), "| operator cuFile config:", operator_config() is not None,
      "| O_DIRECT in", d, ":", probe_odirect(d))
v = gds_verdict(d, nbytes)
print(f"[D2] project verdict (compat forbidden, {nbytes >> 20} MiB round trip): available={v.available} mode={v.mode} "
      f"nvidia-fs counters moved: {v.nvfs_delta} (expect gpudirect where nvidia_fs is loaded, compat where not)")
print(f"[D2]   reason: {v.reason[:500]}")
"""


@section
def D() -> None:
    gds = W / "gds"
    gds.mkdir(parents=True, exist_ok=True)
    for name, code in (("default", _GDS_DEFAULT), ("strict", _GDS_STRICT)):
        args = [sys.executable, "-c", code, str(gds), str(SLAB)] + (["--cpu"] if CPU else [])
        try:
            r = subprocess.run(args, capture_output=True, text=True, timeout=90, env=dict(os.environ))
        except subprocess.TimeoutExpired:
            print(f"[D] {name}: TIMEOUT after 90 s")
            continue
        errs = [ln for ln in r.stderr.splitlines() if any(w in ln for w in ("GDS", "cuFile", "Error", "error"))]
        print(r.stdout.rstrip())
        if errs:
            print("\n".join(errs)[-1500:])
        if r.returncode == 0:
            continue
        print(f"[D] {name}: exited {r.returncode}: {r.stderr[-1500:]}")
        if CPU or "ImportError" in r.stderr or "ModuleNotFoundError" in r.stderr:
            # the dry run, or a module the code above names is gone: the probe itself is broken
            raise RuntimeError(f"the {name} cuFile subprocess could not run (exit {r.returncode})")


@section
def M() -> None:
    if CPU:
        print("[M] device memory: nothing to report on a CPU")
        return
    print(f"[M] after the probes: allocated {torch.cuda.memory_allocated() / 2**20:.0f} MiB, "
          f"reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB, peak allocated "
          f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB (engines + records + temporaries)")


SECTIONS: Sequence[Callable[[], None]] = (A, B, C, D, M)


def main() -> int:
    if not CPU and not torch.cuda.is_available():
        print("no CUDA device (use --cpu for a dry run)", file=sys.stderr)
        return 2
    W.mkdir(parents=True, exist_ok=True)
    print(f"[env] torch {torch.__version__} cuda {torch.version.cuda} device "
          f"{torch.cuda.get_device_name() if not CPU else 'cpu (dry run: no timing means anything)'}; work dir {W}")
    for run in SECTIONS:
        run()
    print(f"[probe] {len(SECTIONS)} sections, {len(failed)} raised{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
