"""How many HDD spindles a restore from HDD-backed S3 needs to finish within a target time.

An HDD pays a seek per operation and then streams, so a restore's cost on the pool is its disk
operations times the seek plus its bytes over the spindles' streaming bandwidth. Our request
shape decides the operation count: the object tier reads a prefix with ranged GETs of about
``get_bytes`` each (``dtkv bench tiering`` measures requests per restored GB), the gateway cuts
each GET into stripes (Ceph RGW: 4 MiB RADOS objects), and an erasure-coded pool reads every
stripe from ``data_shards`` disks (one operation each; a replicated pool reads one copy).

    n          = ceil(P / G)                         requests per restore (P prefix bytes, G GET size)
    ops(g)     = ceil(g / stripe) * k                disk ops of one request of g bytes (stripe 0: k)
    O          = sum of ops(g) over the n requests   disk ops per restore
    seek_term  = O * seek                            disk-seconds spent seeking
    xfer_term  = P / spindle_bw                      disk-seconds spent streaming (data shards only)
    busy       = seek_term + xfer_term               disk-seconds per restore
    request_s  = seek + g / ops(g) / spindle_bw      one request of g = min(G, P) bytes (its ops at once)
    floor      = ceil(n / gets_in_flight) * request_s   the restore on unlimited spindles
    restore(N) = max(sessions * busy / N, floor)     N spindles shared by ``sessions`` restores at once
    spindles   = ceil(sessions * busy / target)      when target >= floor

The bound is ``latency`` when seeks dominate the disk time, ``bandwidth`` when streaming does; a
target below ``floor`` is out of reach on any number of spindles (``concurrency``: more GETs in
flight would reach it; ``request``: one GET alone takes longer, smaller GETs are needed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

MIB = 2**20
#: the object tier's ranged GET: 4 GETs per 64 MiB prefix measured by ``dtkv bench tiering``
DEFAULT_GET_BYTES = 16 * MIB
#: Ceph RGW's ``rgw_obj_stripe_size``: the RADOS object a large S3 object is cut into
DEFAULT_STRIPE_BYTES = 4 * MIB


@dataclass(frozen=True)
class SpindleModel:
    """The HDD pool, our request shape and the restore workload.

    Attributes:
        seek_s: time one disk operation waits before it streams (seek plus rotation).
        spindle_gbps: one spindle's streaming read bandwidth, GB/s.
        get_bytes: bytes per ranged GET (1e9 / requests per restored GB).
        stripe_bytes: the gateway's stripe: a GET costs one op per stripe it touches (0: one op).
        data_shards: disks one stripe is read from (k of an erasure code k+m; 1 replicated).
        gets_in_flight: ranged GETs one restore keeps in flight (``s3_read_concurrency``).
        sessions: restores running at once on the same pool.
        target_s: the restore time to meet; None: the prompt's recompute time.
    """

    seek_s: float = 8e-3
    spindle_gbps: float = 0.2
    get_bytes: float = DEFAULT_GET_BYTES
    stripe_bytes: float = DEFAULT_STRIPE_BYTES
    data_shards: int = 8
    gets_in_flight: int = 8
    sessions: int = 1
    target_s: float | None = None

    def __post_init__(self) -> None:
        if self.seek_s < 0 or not self.spindle_gbps > 0:
            raise ConfigError("HDD seek must be >= 0 ms and spindle bandwidth > 0 MB/s")
        if not self.get_bytes > 0 or self.stripe_bytes < 0:
            raise ConfigError("the GET size must be > 0 and the stripe size >= 0")
        if self.data_shards < 1 or self.gets_in_flight < 1 or self.sessions < 1:
            raise ConfigError("data shards, GETs in flight and sessions must be >= 1")
        if self.target_s is not None and not self.target_s > 0:
            raise ConfigError(f"--restore-target-ms must be > 0, got {self.target_s * 1e3:g}")

    @property
    def requests_per_gb(self) -> float:
        return 1e9 / self.get_bytes

    def ops(self, nbytes: float) -> int:
        """Disk operations of one request of ``nbytes``."""
        stripes = math.ceil(nbytes / self.stripe_bytes) if self.stripe_bytes else 1
        return max(1, stripes) * self.data_shards

    def request_s(self, nbytes: float) -> float:
        """One request alone: its operations run on distinct spindles at once."""
        return self.seek_s + nbytes / self.ops(nbytes) / (self.spindle_gbps * 1e9)


@dataclass(frozen=True)
class SpindleRow:
    """Spindles for one restore of ``prefix_bytes``; ``spindles`` is None when out of reach."""

    tokens: int
    prefix_bytes: float
    target_s: float
    requests: int
    disk_ops: int
    seek_term_s: float
    transfer_term_s: float
    floor_s: float
    spindles: int | None
    bound: str
    restore_s: float | None
    gets_in_flight_needed: int | None

    @property
    def busy_s(self) -> float:
        return self.seek_term_s + self.transfer_term_s


def disk_ops(m: SpindleModel, prefix_bytes: float) -> tuple[int, int]:
    """(requests, disk operations) of one restore of ``prefix_bytes``."""
    full, rest = divmod(prefix_bytes, m.get_bytes)
    requests = int(full) + (1 if rest > 0 else 0)
    return requests, int(full) * m.ops(m.get_bytes) + (m.ops(rest) if rest > 0 else 0)


def floor_s(m: SpindleModel, prefix_bytes: float) -> float:
    """The restore's time on unlimited spindles: its requests in waves of ``m.gets_in_flight``,
    each wave as long as its largest request."""
    requests, _ = disk_ops(m, prefix_bytes)
    return math.ceil(requests / m.gets_in_flight) * m.request_s(min(m.get_bytes, prefix_bytes))


def spindles_for(m: SpindleModel, tokens: int, prefix_bytes: float, target_s: float) -> SpindleRow:
    """How many spindles restore ``prefix_bytes`` (``m.sessions`` restores at once) within ``target_s``."""
    if not target_s > 0 or prefix_bytes <= 0:
        raise ConfigError("a restore target and a prefix must be > 0")
    requests, ops = disk_ops(m, prefix_bytes)
    seek_term = ops * m.seek_s
    transfer_term = prefix_bytes / (m.spindle_gbps * 1e9)
    floor = floor_s(m, prefix_bytes)
    need: int | None = None
    if floor > target_s:
        waves = math.floor(target_s / m.request_s(min(m.get_bytes, prefix_bytes)))
        need = math.ceil(requests / waves) if waves >= 1 else None
        bound = "concurrency" if need is not None else "request"
        return SpindleRow(tokens, prefix_bytes, target_s, requests, ops, seek_term, transfer_term, floor, None,
                          bound, None, need)
    spindles = max(1, math.ceil(m.sessions * (seek_term + transfer_term) / target_s))
    restore = max(m.sessions * (seek_term + transfer_term) / spindles, floor)
    bound = "latency" if seek_term >= transfer_term else "bandwidth"
    return SpindleRow(tokens, prefix_bytes, target_s, requests, ops, seek_term, transfer_term, floor, spindles,
                      bound, restore, None)
