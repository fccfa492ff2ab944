"""Store in one process, restore in another: the nearest to SGLang's engine this machine allows.

SGLang's engine does not run here (no CPU build of ``sgl_kernel`` on PyPI, its import needs
torchvision, and it pins torch 2.14.1; see the README). Each process below is what one SGLang
worker's HiCache does at the storage boundary: SGLang's factory builds the backend, SGLang's
host pool holds the KV, SGLang's page hashes name it. The writer exits; a restarted worker (same
SSD, another host layout) and a new node (empty SSD, shared objects) restore the same pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang 0.5.23 not installed (bash .ci/install-sglang.sh)")

WORKER = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from dynamo_tiered_kv.testing import sglang_host as sh

role, layout, ssd, obj = sys.argv[1:5]
PAGE, N = 16, 12
sgl = sh.load_sglang()
pool = sh.mha_host_pool(sgl, layout, layers=4, heads=2, head_dim=32, page_size=PAGE, pages=2 * N + 2)
cfg = sh.backend_extra(host_capacity_bytes=8 << 20, ssd_dir=ssd, ssd_io="buffered", object_url=obj,
                       object_refresh_s=None, staging_slab_bytes=1 << 20, tenant_salt="t")
backend = sh.attach(sgl, sh.storage_config(sgl, cfg, model_name="tiny"), pool)
hashes = sh.page_hashes(sgl, list(range(1000, 1000 + N * PAGE)), PAGE)
g = torch.Generator().manual_seed(42)
want = [torch.randint(-2**15, 2**15, (2, 4, PAGE, 2, 32), generator=g, dtype=torch.int16) for _ in range(N)]
out = {}
if role == "store":
    idx = pool.alloc(N * PAGE)
    for i in range(N):  # SGLang's own page setter, from the canonical-order test data
        page = want[i].view(torch.bfloat16)
        flat = page.permute(0, 2, 1, 3, 4).flatten() if layout == "page_first" else page.flatten()
        pool.set_from_flat_data_page(int(idx[i * PAGE]), flat)
    out["set"] = backend.batch_set_v1(hashes, idx)
    backend.store.persist(30)
else:
    end = time.monotonic() + 20
    while backend.batch_exists(hashes) < N and time.monotonic() < end:
        time.sleep(0.05)  # a new node's object index builds in the background
    out["exists"] = backend.batch_exists(hashes)
    idx = pool.alloc(N * PAGE)
    out["get"] = backend.batch_get_v1(hashes, idx)
    got = [pool.get_data_page(int(idx[i * PAGE]), flat=False).view(torch.int16) for i in range(N)]
    if layout == "page_first_direct":  # [2, 1, L, ps, H, D] -> [2, L, ps, H, D]
        got = [p[:, 0] for p in got]
    elif layout == "page_first":  # [2, ps, L, H, D] -> [2, L, ps, H, D]
        got = [p.permute(0, 2, 1, 3, 4) for p in got]
    out["equal"] = [bool(torch.equal(a, b)) for a, b in zip(want, got)]
    out["tiers"] = list(backend.store.lookup(backend.keys_of(hashes)).tier_per_block)
backend.close()
print("RESULT " + json.dumps(out))
"""


def _run(*args: str) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-c", WORKER, *args], capture_output=True, text=True, timeout=240, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_restore_in_another_process_and_on_a_new_node(tmp_path: Path) -> None:
    obj = f"file://{tmp_path / 'objects'}"
    stored = _run("store", "page_first", str(tmp_path / "ssd-a"), obj)
    assert stored["set"] == [True] * 12

    restart = _run("load", "page_first_direct", str(tmp_path / "ssd-a"), obj)  # same SSD, other host layout
    assert restart["exists"] == 12 and restart["get"] == [True] * 12
    assert restart["equal"] == [True] * 12

    new_node = _run("load", "page_first", str(tmp_path / "ssd-b"), obj)  # empty SSD: the objects serve
    assert new_node["exists"] == 12 and new_node["get"] == [True] * 12
    assert new_node["equal"] == [True] * 12
    assert set(new_node["tiers"]) <= {"host", "ssd", "object"}
