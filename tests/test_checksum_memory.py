"""The device codec's checksum temporaries stay within the bound deploy/README.md tells operators to leave free."""

from __future__ import annotations

from dynamo_tiered_kv.testing.checksum_memory import measure


def test_checksum_temporaries_stay_under_three_and_a_half_batches() -> None:
    # one default 32 MiB slab's worth of an 8B-class model's records: 15 x (32 layers x 64 KiB)
    batch, peak = measure(32, 64 << 10, 15)
    assert peak > 0  # the probe saw the pass allocate at all
    assert peak < 3.5 * batch, f"checksum pass took {peak / batch:.2f}x its batch"
