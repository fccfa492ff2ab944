"""``scripts/gpu-probe/probe.py --cpu`` runs every API call the GPU probe makes, on CPU tensors: a module
move or a changed signature in the package breaks this test, not the first run on a GPU machine.
The timings of a dry run mean nothing; the bytes it checks do (CPU paths are exact)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "scripts" / "gpu-probe" / "probe.py"

#: every measurement's line: (tag, a phrase of the line)
LINES = [
    ("[env]", "dry run"),
    ("[A0]", "warm_up_device_kernels"),
    ("[A0]", "records equal to the CPU encoder's: True"),
    ("[A1]", "host-slab save: begin_encode (engine thread) returned in"),
    ("[A2]", "control without the engine's wait for the gather"),
    ("[A3]", "GPU-direct save: begin_encode_on_device (engine thread) returned in"),
    ("[A3]", "GPU-direct records equal to the CPU encoder's: True"),
    ("[A4]", "GPU-direct save, corrupted (record, layer) pairs per trial"),
    ("[B1]", "plain pinned H2D copy_ of the same bytes"),
    ("[B1]", "restore_records, one batch"),
    ("[B1]", "restore_records, one session of chunks"),
    ("[B1]", "decode_blocks, one session of chunks"),
    ("[B1]", "decode_blocks_on_device, device records"),
    ("[B1]", "host verify only"),
    ("[B2]", "one load of"),
    ("[B2]", "per chunk: median"),
    ("[B2]", "control, each chunk marked on the engine's stream"),
    ("[B3]", "host slab: a load ordered after its mark"),
    ("[B3]", "host slab, control marked after the forward"),
    ("[B3]", "device records: a load ordered after its mark"),
    ("[B3]", "device records, control marked after the forward"),
    ("[C]", "gather  Triton 16-byte"),
    ("[C]", "scatter Triton 16-byte"),
    ("[C]", "plain device copy_"),
    ("[D1]", "imports ok"),
    ("[D2]", "imports ok"),
    ("[M]", "device memory"),
    ("[probe]", "5 sections, 0 raised"),
]


def test_the_probe_dry_run_makes_every_call_and_prints_every_measurement(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, str(PROBE), str(tmp_path / "work"), "--cpu"], capture_output=True,
                         text=True, timeout=600, cwd=ROOT, env=env)
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-4000:]
    assert "EXCEPTION" not in out, out
    lines = out.splitlines()
    missing = [f"{tag} ... {phrase}" for tag, phrase in LINES
               if not any(ln.startswith(tag) and phrase in ln for ln in lines)]
    assert not missing, f"lines missing from the dry run: {missing}\n{out}"
    # CPU paths are exact: every restore path put the records' bytes back, no save was corrupted
    assert sum("bytes equal True" in ln for ln in lines if ln.startswith("[B1]")) == 4, out
    assert "ours [0, 0] (expect all 0)" in out and "trial: [0, 0] (expect all 0)" in out, out
