"""Save and restore copy rates of the CUDA paths against a plain ``copy_`` of the same bytes, one run
(``scripts/gpu-check`` prints it; needs a CUDA GPU).

save:    engine blocks -> pinned host records (``device_copy.queue_save``), device-to-host
restore: pinned host records -> engine blocks (``device_copy.restore_records``), host-to-device
plain:   one ``copy_`` of the same number of bytes between a device buffer and a pinned buffer
"""

from __future__ import annotations

import sys
import time

import torch

from dynamo_tiered_kv.blocks.codec import header_bytes, record_bytes
from dynamo_tiered_kv.blocks.layout import EngineLayout, EngineLayoutKind, allocate_engine_kv
from dynamo_tiered_kv.staging.device_copy import queue_save, restore_records


def _rate(nbytes: int, fn) -> float:
    fn()  # warm-up: allocator, pinned pool, kernel compile
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - t) / 1e9


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    ts = allocate_engine_kv(EngineLayoutKind.FLASH_ATTN, num_layers=32, num_blocks=blocks + 8, block_size=16,
                            num_kv_heads=8, head_size=128, dtype=torch.bfloat16, device="cuda")
    lay = EngineLayout(EngineLayoutKind.FLASH_ATTN, ts, 16, 8, 128)
    s = lay.shape
    rb, hb, lb = record_bytes(s), header_bytes(s.num_layers), s.layer_bytes
    ids = list(range(blocks))
    host = torch.empty(blocks * rb, dtype=torch.uint8).pin_memory()
    dev = torch.empty(blocks * rb, dtype=torch.uint8, device="cuda")
    payload = blocks * s.payload_bytes

    def save() -> None:
        queue_save(lay.layer_views, lay.device, ids, host, record_bytes=rb, header_bytes=hb,
                   layer_bytes=lb).synchronize()

    def restore() -> None:
        restore_records([], lay.layer_views, lay.device, ids, record_bytes=rb, header_bytes=hb, layer_bytes=lb,
                        chunk=host.numpy())

    h, d = host[:payload], dev[:payload]
    rows = [("save (device->host)", _rate(payload, save), _rate(payload, lambda: h.copy_(d, non_blocking=True))),
            ("restore (host->device)", _rate(payload, restore), _rate(payload, lambda: d.copy_(h, non_blocking=True)))]
    print(f"{blocks} blocks of {s.payload_bytes} payload bytes ({payload / 1e9:.2f} GB), one run, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'path':<24}{'ours GB/s':>12}{'plain copy_ GB/s':>18}")
    for name, ours, plain in rows:
        print(f"{name:<24}{ours:>12.1f}{plain:>18.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
