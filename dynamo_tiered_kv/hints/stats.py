"""Counters of hint reading, and the rate-limited log line a bad hint costs.

Hints come from clients: a flood of malformed ones must cost neither the request nor the log.
Every outcome is a counter; log lines are at most one per ``interval_s`` per kind, the next
line saying how many were suppressed.

Prometheus names (``HintStats.register(registry)``, e.g. a store's ``StoreMetrics.registry``):

    hint_envelopes_total{outcome}        envelopes read: ok, malformed, unparsable (read, then an
                                         action's payload raised)
    hint_actions_total{action,outcome}   actions by kind (kv.retain, dtkv.prefetch, kv.fetch,
                                         unknown): accepted, rejected, dropped (past a cap)
    hint_rejections_total{action,reason} rejected actions by reason code (a fixed set, never
                                         client text)
    hint_truncated_directives_total      kv.retain directives dropped past the per-envelope cap
    hint_applied_total{action,result}    what an adapter did with an accepted action (prefetch:
                                         queued, unknown_scope, empty_range, no_target;
                                         kv.fetch: left_to_peer)

Where the counting happens in another process than the registry (our vLLM connector: the
scheduler reads hints, the workers own the stores), ``counts().since(earlier)`` is what changed,
small and picklable, and ``HintStats.add`` adds it on the other side.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as _Tally
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class RateLimitedLog:
    """At most one warning per ``interval_s`` per ``kind``; the next one counts what it skipped."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval_s
        self._clock = clock
        self._next: dict[str, float] = {}
        self._skipped: _Tally[str] = _Tally()
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``kind`` logged within the interval. Returns whether it logged."""
        now = self._clock()
        with self._lock:
            if now < self._next.get(kind, float("-inf")):
                self._skipped[kind] += 1
                return False
            self._next[kind] = now + self._interval
            skipped = self._skipped.pop(kind, 0)
        suffix = f" ({skipped} similar suppressed)" if skipped else ""
        log.warning(msg + suffix, *args)
        return True


#: a family of ``HintCounts`` entries -> how many labels its entries carry
_ARITY = {"envelopes": 1, "actions": 2, "rejections": 2, "truncated": 0, "applied": 2}

Entry = tuple[str, tuple[str, ...], int]


@dataclass(frozen=True)
class HintCounts:
    """The tallies of a ``HintStats``, or what they gained since an earlier copy (``since``).

    ``entries``: ``(family, labels, count)`` with ``family`` one of ``envelopes``, ``actions``,
    ``rejections``, ``truncated``, ``applied`` and ``labels`` the metric's label values. The label
    values come from fixed sets, so a copy stays a few dozen entries whatever the traffic.
    """

    entries: tuple[Entry, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    def since(self, earlier: HintCounts) -> HintCounts:
        """What grew from ``earlier`` to this copy (counters only grow: nothing else is kept)."""
        before = {(f, labels): n for f, labels, n in earlier.entries}
        return HintCounts(tuple((f, labels, n - before.get((f, labels), 0)) for f, labels, n in self.entries
                                if n > before.get((f, labels), 0)))


def _valid(counts: object) -> tuple[Entry, ...] | None:
    """``counts``' entries if every one is well formed, else None (it may come from another process)."""
    entries = counts.entries if isinstance(counts, HintCounts) else None
    if not isinstance(entries, tuple):
        return None
    for e in entries:
        if not (isinstance(e, tuple) and len(e) == 3):
            return None
        family, labels, n = e
        if (not isinstance(labels, tuple) or _ARITY.get(family) != len(labels)
                or not all(isinstance(v, str) for v in labels)
                or type(n) is not int or n < 0):
            return None
    return entries


class HintStats:
    """Thread-safe tallies of hint outcomes; ``register`` exports them to a Prometheus registry."""

    def __init__(self, log_interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.log = RateLimitedLog(log_interval_s, clock)
        self._lock = threading.Lock()
        self._envelopes: _Tally[str] = _Tally()
        self._actions: _Tally[tuple[str, str]] = _Tally()
        self._rejections: _Tally[tuple[str, str]] = _Tally()
        self._truncated = 0
        self._applied: _Tally[tuple[str, str]] = _Tally()
        self._changes = 0  # bumped under the lock with every tally change: see ``changes``

    @property
    def changes(self) -> int:
        """How many times the tallies changed; equal readings mean equal ``counts()`` in between.

        Read without the lock: an int attribute is one atomic load, and it is bumped under the
        lock together with its tally, so a change made before this read is in any ``counts()``
        taken after it. A change racing with the read either shows now or in the next reading.
        """
        return self._changes

    def envelope(self, outcome: str) -> None:
        with self._lock:
            self._envelopes[outcome] += 1
            self._changes += 1

    def action(self, kind: str, outcome: str, n: int = 1) -> None:
        with self._lock:
            self._actions[(kind, outcome)] += n
            self._changes += 1

    def rejected(self, kind: str, reason: str) -> None:
        with self._lock:
            self._actions[(kind, "rejected")] += 1
            self._rejections[(kind, reason)] += 1
            self._changes += 1

    def truncated_directives(self, n: int) -> None:
        with self._lock:
            self._truncated += n
            self._changes += 1

    def applied(self, kind: str, result: str) -> None:
        """An adapter acted on (or deliberately left) an accepted action; ``result`` is a fixed word."""
        with self._lock:
            self._applied[(kind, result)] += 1
            self._changes += 1

    def envelopes(self, outcome: str) -> int:
        with self._lock:
            return self._envelopes[outcome]

    def actions(self, kind: str, outcome: str) -> int:
        with self._lock:
            return self._actions[(kind, outcome)]

    def rejections(self, kind: str, reason: str) -> int:
        with self._lock:
            return self._rejections[(kind, reason)]

    def truncated(self) -> int:
        with self._lock:
            return self._truncated

    def applications(self, kind: str, result: str) -> int:
        with self._lock:
            return self._applied[(kind, result)]

    def counts(self) -> HintCounts:
        """A copy of every tally, for ``HintCounts.since`` and another process's ``add``."""
        envelopes, actions, rejections, truncated, applied = self._snapshot()
        entries: list[Entry] = [("envelopes", (o,), n) for o, n in envelopes.items()]
        entries += [("actions", k, n) for k, n in actions.items()]
        entries += [("rejections", k, n) for k, n in rejections.items()]
        entries += [("applied", k, n) for k, n in applied.items()]
        if truncated:
            entries.append(("truncated", (), truncated))
        return HintCounts(tuple(entries))

    def add(self, counts: object) -> bool:
        """Add ``counts`` (a ``HintCounts``) to these tallies. Never raises: anything malformed is
        ignored whole, with a rate-limited warning, and the result is False."""
        entries = _valid(counts)
        if entries is None:
            self.log.warning("hint_counts", "hint counters not added: malformed %s", type(counts).__name__)
            return False
        with self._lock:
            for family, labels, n in entries:
                if family == "envelopes":
                    self._envelopes[labels[0]] += n
                elif family == "actions":
                    self._actions[(labels[0], labels[1])] += n
                elif family == "rejections":
                    self._rejections[(labels[0], labels[1])] += n
                elif family == "applied":
                    self._applied[(labels[0], labels[1])] += n
                else:
                    self._truncated += n
            self._changes += 1
        return True

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(_HintCollector(self))

    def _snapshot(self) -> tuple[dict[str, int], dict[tuple[str, str], int], dict[tuple[str, str], int], int,
                                 dict[tuple[str, str], int]]:
        with self._lock:
            return (dict(self._envelopes), dict(self._actions), dict(self._rejections), self._truncated,
                    dict(self._applied))


class _HintCollector(Collector):
    def __init__(self, stats: HintStats) -> None:
        self._stats = stats

    def collect(self) -> Iterable[CounterMetricFamily]:
        envelopes, actions, rejections, truncated, applied = self._stats._snapshot()
        env = CounterMetricFamily("dtkv_hint_envelopes", "KV hint envelopes read", labels=["outcome"])
        for outcome, n in envelopes.items():
            env.add_metric([outcome], n)
        act = CounterMetricFamily("dtkv_hint_actions", "KV hint actions by kind and outcome",
                                  labels=["action", "outcome"])
        for (kind, outcome), n in actions.items():
            act.add_metric([kind, outcome], n)
        rej = CounterMetricFamily("dtkv_hint_rejections", "rejected KV hint actions by reason",
                                  labels=["action", "reason"])
        for (kind, reason), n in rejections.items():
            rej.add_metric([kind, reason], n)
        trunc = CounterMetricFamily("dtkv_hint_truncated_directives",
                                    "kv.retain directives dropped past the per-envelope cap")
        trunc.add_metric([], truncated)
        app = CounterMetricFamily("dtkv_hint_applied", "what an adapter did with accepted KV hint actions",
                                  labels=["action", "result"])
        for (kind, result), n in applied.items():
            app.add_metric([kind, result], n)
        yield from (env, act, rej, trunc, app)
