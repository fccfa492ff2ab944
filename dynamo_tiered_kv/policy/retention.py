"""Retention classes: a per-block (priority, expiry) a tier's eviction honours.

A block retained at priority ``p`` (1-100) until ``expiry`` (clock seconds; None: no expiry)
is *protected*: a tier evicts every unprotected block before it, and among protected blocks
the lowest priority first (then the earliest expiry; least recently used among equals, which
is the tier's own order). Once its expiry passes the block is *expired*: it goes before every
other block, and a GC pass (``TieredStore.expire``) deletes it from every tier.

Claims are held per *holder* (the hint layer passes ``(tenant_id, scope)``; callers without
one use ``ANONYMOUS``). A block's effective class is the strongest claim still running: the
highest priority, then the latest expiry (None: never), among the claims whose expiry has not
passed; it is expired only once every claim's expiry passed. So another holder can only raise
a block's retention: a holder's priority 0 or its lapsed expiry releases that holder's claim
alone, and ``forget`` (the tier dropped the block) drops every claim. A block keeps at most
``MAX_HOLDERS_PER_KEY`` claims: past that the weakest one is dropped (never lowering the
block's current class) and counted (``dtkv_retention_dropped_claims_total``).

Protection is bounded so hints can never wedge a tier: at most ``max_share`` of the tier's
capacity may be protected, and per tenant (the first element of a ``(tenant, scope)`` holder;
other holders share the tenant ``""``) at most ``max_share`` of that tenant's own limit on the
tier (``tenant_limit``; without one, of the capacity). A protection beyond its tenant's bound
makes that tenant's lowest protections yield (lowest priority, then earliest expiry, by the
strongest claim; the newcomer too if it is the lowest); beyond the tier's bound, the tenant
holding the most protected bytes yields its lowest first, so one tenant's hints can neither
exceed its share nor push another tenant's protections out while it holds more than they do.
A yielded block loses every claim and stays cached as an ordinary one. Each yield is counted
(``dtkv_retention_yielded_blocks_total``). A block counts toward the tenant of its first claim
(blocks are keyed per tenant, so its holders are of one tenant or anonymous).

The clock is injected (``clock``), so tests and the session benchmark run hours of retention
on a compressed clock; production uses ``time.time`` so expiries mean the same in every
process (the object tier persists them in its manifests, docs/FORMAT.md).

Memory stays proportional to the retained blocks: one small record per block (one claim
inline, the others in a tuple only when two or more holders claim it), and the two lazy heaps
(the share bound's order, the expiries) are rebuilt from the live records whenever their stale
entries outnumber twice the live ones (plus 1024), on every path that changes a claim.

One consumer may follow changes (``take_changes``): the keys whose claims changed since its
last call, so the SSD tier keeps per-segment ranks without rescanning every retained block.

Threads: every change takes the one lock; tiers call ``rank``/``protected``/``standing`` and
``take_changes`` under their own lock (this lock is innermost and never calls out). Records are
immutable and replaced whole, so the lock-free questions read a consistent record.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Final

from prometheus_client import Counter, Gauge

from ..blocks.keys import BlockKey

DEFAULT_MAX_SHARE = 0.5
MAX_PRIORITY = 100

Holder = Hashable
#: the holder of callers without hints or tenants (tests, benches, TTL paths, persisted classes)
ANONYMOUS: Final = ("", None)
#: claims kept per block; past this the weakest is dropped (it never lowers the current class)
MAX_HOLDERS_PER_KEY: Final = 8
#: stale heap entries (and unread change-log keys) tolerated beyond twice the live records
_SLACK = 1024

YIELDED = Counter("dtkv_retention_yielded_blocks", "Protected blocks that lost their protection to the "
                  "protected-share bound (retain_max_share)", ["tier"])
EXPIRED = Counter("dtkv_retention_expired_blocks", "Retained blocks whose expiry passed", ["tier"])
DROPPED = Counter("dtkv_retention_dropped_claims", "Claims dropped because a block had more than "
                  "MAX_HOLDERS_PER_KEY holders (the weakest goes)", ["tier"])
PROTECTED_BYTES = Gauge("dtkv_retention_protected_bytes", "Bytes of protected blocks", ["tier"])

Claim = tuple[Holder, int, float | None]  # (holder, priority, expiry)


def _tenant_of(holder: Holder) -> str:
    """The tenant of a ``(tenant, scope)`` holder; ``""`` for any other holder."""
    if isinstance(holder, tuple) and len(holder) == 2 and isinstance(holder[0], str):
        return holder[0]
    return ""


def _order(priority: int, expiry: float | None) -> tuple[int, float]:
    return priority, math.inf if expiry is None else expiry


def _running(expiry: float | None, now: float) -> bool:
    return expiry is None or expiry > now


@dataclass(frozen=True, slots=True)
class Retained:
    """``priority`` 1-100 until ``expiry`` (None: none); ``nbytes`` counts toward the share bound."""

    priority: int
    expiry: float | None
    nbytes: int

    def rank(self) -> tuple[int, float]:
        return _order(self.priority, self.expiry)


@dataclass(frozen=True, slots=True)
class _Claims:
    """Every claim on one block: the first inline, any others in ``others`` (never mutated:
    a change builds a new record, so lock-free readers see one whole record or the other)."""

    nbytes: int
    holder: Holder
    priority: int
    expiry: float | None
    others: tuple[Claim, ...] = ()

    @staticmethod
    def of(nbytes: int, claims: list[Claim]) -> _Claims:
        (h, p, e), *rest = claims
        return _Claims(nbytes, h, p, e, tuple(rest))

    def all(self) -> list[Claim]:
        return [(self.holder, self.priority, self.expiry), *self.others]

    def top(self) -> tuple[int, float]:
        """The strongest claim's order, lapsed or not (the share bound's order)."""
        best = _order(self.priority, self.expiry)
        for _, p, e in self.others:
            best = max(best, _order(p, e))
        return best

    def end(self) -> float | None:
        """When the last claim lapses (None: one never does)."""
        if self.expiry is None:
            return None
        end = self.expiry
        for _, _, e in self.others:
            if e is None:
                return None
            end = max(end, e)
        return end

    def effective(self, now: float) -> tuple[int, float | None] | None:
        """The strongest running claim as ``(priority, expiry)``; None when every claim lapsed."""
        best: tuple[int, float | None] | None = None
        if _running(self.expiry, now):
            best = (self.priority, self.expiry)
        for _, p, e in self.others:
            if _running(e, now) and (best is None or _order(p, e) > _order(*best)):
                best = (p, e)
        return best


class RetentionClasses:
    """The retained blocks of one tier (module docstring)."""

    def __init__(self, capacity_bytes: int, *, max_share: float = DEFAULT_MAX_SHARE,
                 clock: Callable[[], float] = time.time, tier: str = "tier",
                 tenant_limit: Callable[[str], int] | None = None) -> None:
        if not 0.0 <= max_share <= 1.0:
            raise ValueError("max_share must be in [0, 1]")
        self.capacity_bytes = capacity_bytes
        self.max_share = max_share
        self.clock = clock
        self.tier = tier
        self._tenant_limit = tenant_limit
        self._map: dict[BlockKey, _Claims] = {}
        self._bytes = 0
        self._tenant_bytes: dict[str, int] = {}
        # lazy heaps: an entry is current while its key's record still has the entry's order
        # (``top()`` for the bound, ``end()`` for expiry); duplicates of a current entry are harmless
        self._by_rank: dict[str, list[tuple[int, float, int, BlockKey]]] = {}  # per tenant
        self._by_expiry: list[tuple[float, int, BlockKey]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._changed: dict[BlockKey, None] | None = None  # None: nobody follows changes
        self._changes_lost = False
        self.yielded = 0  # lifetime counts, also exported as metrics
        self.dropped_claims = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    @property
    def protected_bytes(self) -> int:
        """Bytes of every retained block (present in the tier or not, lapsed or not)."""
        return self._bytes

    @property
    def bound_bytes(self) -> int:
        return int(self.capacity_bytes * self.max_share)

    def tenant_bound_bytes(self, tenant: str) -> int:
        """The protected bytes ``tenant`` may hold (module docstring)."""
        if self._tenant_limit is None:
            return self.bound_bytes
        return min(self.bound_bytes, int(self._tenant_limit(tenant) * self.max_share))

    def tenant_protected_bytes(self) -> dict[str, int]:
        """Protected bytes by tenant, a copy."""
        with self._lock:
            return dict(self._tenant_bytes)

    @property
    def heap_entries(self) -> tuple[int, int]:
        """Entries in the (share-bound, expiry) heaps, stale ones included."""
        return sum(map(len, self._by_rank.values())), len(self._by_expiry)

    def get(self, key: BlockKey, now: float | None = None) -> Retained | None:
        """The effective claim: the strongest running one; once all lapsed, the strongest (its
        expiry passed). None: not retained."""
        c = self._map.get(key)
        if c is None:
            return None
        eff = c.effective(self.clock() if now is None else now)
        if eff is None:
            p, e = max(((p, e) for _, p, e in c.all()), key=lambda pe: _order(*pe))
            return Retained(p, e, c.nbytes)
        return Retained(eff[0], eff[1], c.nbytes)

    def holders(self, key: BlockKey) -> dict[Holder, tuple[int, float | None]]:
        """Each holder's claim on ``key`` as ``(priority, expiry)`` (lapsed ones included)."""
        c = self._map.get(key)
        return {} if c is None else {h: (p, e) for h, p, e in c.all()}

    def retained_keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._map)

    def items(self) -> list[tuple[BlockKey, Retained]]:
        """Every retained key with its effective claim (``get``)."""
        now = self.clock()
        with self._lock:
            keys = list(self._map)
        return [(k, r) for k in keys if (r := self.get(k, now)) is not None]

    # --- changes ----------------------------------------------------------------------------
    def set(self, key: BlockKey, priority: int, expiry: float | None, nbytes: int,
            holder: Holder = ANONYMOUS) -> bool:
        """``holder`` claims ``key`` at ``priority`` until ``expiry`` (replacing its own earlier
        claim); priority 0 or an expiry already past releases this holder's claim only. Returns
        whether the block is protected afterwards (False: no running claim is left, or it yielded
        to the share bound)."""
        now = self.clock()
        if priority <= 0 or not _running(expiry, now):
            self.release([key], holder)
            return self.protected(key, now)
        priority = min(priority, MAX_PRIORITY)
        nbytes = max(0, nbytes)
        with self._lock:
            old = self._map.get(key)
            claims = [] if old is None else old.all()
            if old is not None and old.nbytes == nbytes and (holder, priority, expiry) in claims:
                return True  # the same claim again: nothing changes, nothing is pushed
            claims = [c for c in claims if c[0] != holder and _running(c[2], now)]
            claims.append((holder, priority, expiry))
            if len(claims) > MAX_HOLDERS_PER_KEY:  # the weakest goes; it is below the strongest
                claims.remove(min(claims, key=lambda c: _order(c[1], c[2])))
                self.dropped_claims += 1
                DROPPED.labels(self.tier).inc()
            new = _Claims.of(nbytes, claims)
            self._put_locked(key, new, old)
            self._bound_locked(_tenant_of(new.holder))
            kept = key in self._map
        PROTECTED_BYTES.labels(self.tier).set(self._bytes)
        return kept

    def release(self, keys: Iterable[BlockKey], holder: Holder = ANONYMOUS) -> None:
        """Drop ``holder``'s claims on ``keys`` (the others' stay)."""
        now = self.clock()
        with self._lock:
            for key in keys:
                old = self._map.get(key)
                if old is None:
                    continue
                claims = old.all()
                rest = [c for c in claims if c[0] != holder and _running(c[2], now)]
                if len(rest) == len(claims):
                    continue  # not this holder's: nothing changes
                if rest:
                    self._put_locked(key, _Claims.of(old.nbytes, rest), old)
                else:
                    self._drop_locked(key)
            self._compact_locked()
        PROTECTED_BYTES.labels(self.tier).set(self._bytes)

    def forget(self, keys: Iterable[BlockKey]) -> None:
        """The tier dropped these blocks: every holder's claim goes."""
        with self._lock:
            for key in keys:
                self._drop_locked(key)
            self._compact_locked()
        PROTECTED_BYTES.labels(self.tier).set(self._bytes)

    def _put_locked(self, key: BlockKey, new: _Claims, old: _Claims | None) -> None:
        self._map[key] = new
        self._bytes += new.nbytes - (0 if old is None else old.nbytes)
        tenant = _tenant_of(new.holder)
        moved = old is None or _tenant_of(old.holder) != tenant
        if old is not None:
            self._count_locked(_tenant_of(old.holder), -old.nbytes)
        self._count_locked(tenant, new.nbytes)
        top, end = new.top(), new.end()
        seq = next(self._seq)
        if moved or old.top() != top:
            heapq.heappush(self._by_rank.setdefault(tenant, []), (*top, seq, key))
        if end is not None and (old is None or old.end() != end):
            heapq.heappush(self._by_expiry, (end, seq, key))
        self._note_locked(key)
        self._compact_locked()

    def _count_locked(self, tenant: str, nbytes: int) -> None:
        n = self._tenant_bytes.get(tenant, 0) + nbytes
        if n > 0:
            self._tenant_bytes[tenant] = n
        else:
            self._tenant_bytes.pop(tenant, None)

    def _drop_locked(self, key: BlockKey) -> _Claims | None:
        c = self._map.pop(key, None)
        if c is not None:
            self._bytes -= c.nbytes
            self._count_locked(_tenant_of(c.holder), -c.nbytes)
            self._note_locked(key)
        return c

    def _compact_locked(self) -> None:
        """Rebuild a heap from the live records once its stale entries outnumber them."""
        limit = 2 * len(self._map) + _SLACK
        if sum(map(len, self._by_rank.values())) > limit:
            heaps: dict[str, list[tuple[int, float, int, BlockKey]]] = {}
            for k, c in self._map.items():
                heaps.setdefault(_tenant_of(c.holder), []).append((*c.top(), next(self._seq), k))
            for h in heaps.values():
                heapq.heapify(h)
            self._by_rank = heaps
        if len(self._by_expiry) > limit:
            self._by_expiry = [(end, next(self._seq), k) for k, c in self._map.items() if (end := c.end()) is not None]
            heapq.heapify(self._by_expiry)

    def _bound_locked(self, tenant: str) -> None:
        bound = self.tenant_bound_bytes(tenant)
        while self._tenant_bytes.get(tenant, 0) > bound and self._yield_locked(tenant):
            pass
        bound = self.bound_bytes
        while self._bytes > bound and self._tenant_bytes:
            largest = max(self._tenant_bytes, key=self._tenant_bytes.__getitem__)
            if not self._yield_locked(largest):
                break
        self._compact_locked()

    def _yield_locked(self, tenant: str) -> bool:
        """Drop ``tenant``'s lowest protection; False if it has none left in its heap."""
        heap = self._by_rank.get(tenant)
        while heap:
            p, e, _, key = heapq.heappop(heap)
            c = self._map.get(key)
            if c is not None and c.top() == (p, e) and _tenant_of(c.holder) == tenant:
                self._drop_locked(key)
                self.yielded += 1
                YIELDED.labels(self.tier).inc()
                return True
        self._by_rank.pop(tenant, None)
        return False

    # --- following changes ----------------------------------------------------------------------
    def _note_locked(self, key: BlockKey) -> None:
        log = self._changed
        if log is None:
            return
        log[key] = None
        if len(log) > 2 * len(self._map) + _SLACK:  # nobody read it for long: a rebuild is cheaper
            log.clear()
            self._changes_lost = True

    def take_changes(self) -> list[BlockKey] | None:
        """Keys whose claims changed since the previous call (their class may differ now).

        None when the consumer must rebuild from ``retained_keys()``: on the first call (which
        starts the log) and when the log overflowed. One consumer per table (the tier's eviction).
        """
        with self._lock:
            if self._changed is None or self._changes_lost:
                self._changed = {}
                self._changes_lost = False
                return None
            out = list(self._changed)
            self._changed.clear()
            return out

    # --- questions eviction asks ------------------------------------------------------------
    def priority(self, key: BlockKey, now: float | None = None) -> int:
        """The block's class: -1 expired, 0 ordinary, 1-100 protected."""
        c = self._map.get(key)
        if c is None:
            return 0
        eff = c.effective(self.clock() if now is None else now)
        return -1 if eff is None else eff[0]

    def protected(self, key: BlockKey, now: float | None = None) -> bool:
        return self.priority(key, now) > 0

    def standing(self, key: BlockKey, now: float) -> tuple[int, float]:
        """``(class, until)``: the block's class (``priority``) and the clock time before which
        it cannot change by time alone (math.inf: only a change of claims can change it)."""
        c = self._map.get(key)
        if c is None:
            return 0, math.inf
        eff = c.effective(now)
        if eff is None:
            return -1, math.inf
        until = min((e for _, _, e in c.all() if e is not None and e > now), default=math.inf)
        return eff[0], until

    def rank(self, key: BlockKey, now: float) -> tuple[int, float]:
        """Eviction order key: smaller goes first (expired, ordinary, then by priority/expiry)."""
        c = self._map.get(key)
        if c is None:
            return 0, 0.0
        eff = c.effective(now)
        if eff is None:
            return -1, c.end() or 0.0
        return _order(*eff)

    def expired(self, now: float | None = None, limit: int | None = None) -> list[tuple[BlockKey, int]]:
        """Pop up to ``limit`` retained blocks whose every claim lapsed: ``(key, nbytes)``,
        earliest first."""
        now = self.clock() if now is None else now
        out: list[tuple[BlockKey, int]] = []
        with self._lock:
            while self._by_expiry and self._by_expiry[0][0] <= now and (limit is None or len(out) < limit):
                end, _, key = heapq.heappop(self._by_expiry)
                c = self._map.get(key)
                if c is not None and c.end() == end:
                    self._drop_locked(key)
                    out.append((key, c.nbytes))
            self._compact_locked()
        if out:
            EXPIRED.labels(self.tier).inc(len(out))
            PROTECTED_BYTES.labels(self.tier).set(self._bytes)
        return out

    def peek_expired(self, now: float) -> list[BlockKey]:
        """Keys whose every claim lapsed, left in place (eviction takes them first)."""
        with self._lock:
            found = {k: None for e, _, k in self._by_expiry
                     if e <= now and (c := self._map.get(k)) is not None and c.end() == e}
        return list(found)
