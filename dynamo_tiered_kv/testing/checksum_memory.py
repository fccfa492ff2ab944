"""Peak transient memory of the device codec's per-layer checksums, relative to one batch.

``device_codec`` hashes a batch of records (``kernels.xxh3_64_rows``) with torch ops whose
temporaries scale with the batch; on a GPU they come out of the memory vLLM leaves free. The same
ops run on the CPU, where each measurement is the growth of a fresh process's peak RSS (reset to
the current RSS first) across one ``_layer_sums`` call over records already in memory (so the
figure is what the torch ops allocate, whatever the device):

    python -m dynamo_tiered_kv.testing.checksum_memory
"""

from __future__ import annotations

import json
import subprocess
import sys

#: (layers, layer bytes, records per batch): an 8B-class model (32 x 64 KiB) at a 32 MiB slab and
#: at 4 slabs' worth, and a 70B-class one (80 x 32 KiB)
SHAPES = ((32, 64 << 10, 15), (32, 64 << 10, 60), (80, 32 << 10, 12))

_PROBE = """
import json, resource, sys, torch
from dynamo_tiered_kv.blocks import device_codec
from dynamo_tiered_kv.blocks.codec import header_bytes, record_bytes
from dynamo_tiered_kv.blocks.layout import BlockShape, CanonicalFormat, DType
nl, lb, n = map(int, sys.argv[1:4])
shape = BlockShape(CanonicalFormat.KV_SPLIT, DType.UINT8, nl, 1, 1, lb // 2)  # K and V: lb bytes a layer
hb, rb = header_bytes(nl), record_bytes(shape)
recs = torch.randint(0, 256, (n * rb,), dtype=torch.uint8).view(n, rb)
device_codec._layer_sums(recs[:1], hb, nl, lb)  # one-time allocations (tables, thread pools) first

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

try:  # reset the peak to the current RSS, so earlier, freed peaks (imports, randint) do not hide the pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    device_codec._layer_sums(recs, hb, nl, lb)
    peak = (status("VmHWM") - before) * 1024
except OSError:  # no /proc/self/clear_refs: the process's lifetime peak
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    device_codec._layer_sums(recs, hb, nl, lb)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(json.dumps({"batch_bytes": n * rb, "peak_bytes": peak}))
"""


def measure(layers: int, layer_bytes: int, records: int) -> tuple[int, int]:
    """(batch bytes, peak transient bytes) of one checksum pass, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _PROBE, str(layers), str(layer_bytes), str(records)],
                         check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return int(r["batch_bytes"]), int(r["peak_bytes"])


def main() -> None:
    print("layers  layer_KiB  records  batch_MiB  peak_MiB  peak/batch")
    for nl, lb, n in SHAPES:
        batch, peak = measure(nl, lb, n)
        print(f"{nl:6d}  {lb >> 10:9d}  {n:7d}  {batch / 2**20:9.1f}  {peak / 2**20:8.1f}  {peak / batch:10.2f}")


if __name__ == "__main__":
    main()
