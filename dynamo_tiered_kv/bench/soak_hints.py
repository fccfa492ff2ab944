"""Hinted sessions for ``dtkv bench soak``: every turn carries a KV hints envelope, some hostile.

Each turn's envelope is parsed (``read_hints``), planned (``RetentionCursor``) and applied the way
both vLLM adapters apply it: ``TieredStore.retain`` under the request's holder (tenant, scope),
the session remembered in ``SessionScopes``, a ``dtkv.prefetch`` of an earlier conversation
queued, and a session's end releasing and demoting what its holder kept. Sessions belong to three
tenants. One turn in ten is hostile: hundreds of directives, a scope of 100k characters, a flood
of prefetch actions, and a priority-0 "session end" naming another tenant's conversation.

What the soak samples from here: the retention tables (retained keys and heap entries per tier),
the session tables, and the time the hint handling plus the lookup of a turn costs the caller's
thread (the scheduler's share of a turn in an engine), p50 and p99 per interval in ms.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..blocks.keys import BlockKey
from ..hints import HintStats, read_hints
from ..hints.sessions import RetentionCursor, SessionScopes, ends_session, holder
from ..store import TieredStore

TENANTS = 3


def conversation_scope(conv: np.ndarray, block_size: int) -> str:
    """A conversation's session name: its first blocks (shared system prompt and own opening)."""
    return f"conv-{hash(conv[:3 * block_size].tobytes()) & 0xFFFFFFFF:08x}"


def _action(kind: str, payload: dict[str, Any], i: int) -> dict[str, Any]:
    return {"action_id": f"a{i}", "action_type": kind, "action_version": "1.0", "payload": payload}


def envelope(rng: random.Random, scope: str, others: Sequence[str], hostile: bool) -> dict[str, Any]:
    """A turn's hints: retain its context (and its output) under ``scope``, maybe prefetch another
    conversation; hostile: every bound pushed and other sessions named."""
    if hostile:
        n = 500
        prios = sorted((rng.randint(0, 100) for _ in range(n)), reverse=True)
        actions = [_action("kv.retain", {"scope": rng.choice([scope, "z" * 100_000]), "directives": [
            {"start": 16 * i, "priority": p, "duration": rng.choice([0, 1, None])} for i, p in enumerate(prios)]}, 0)]
        actions += [_action("dtkv.prefetch", {"scope": rng.choice(list(others) or [scope])}, i + 1)
                    for i in range(300)]
        return {"protocol_version": "1.0", "message_id": "h", "actions": actions}
    actions = [_action("kv.retain", {"scope": scope, "directives": [
        {"start": 0, "end": 48, "priority": 90, "duration": 3600},
        {"start": 48, "priority": rng.choice([40, 60]), "duration": rng.choice([60, 600])},
        {"covers_output": True, "priority": 30, "duration": 60}]}, 0)]
    if others and rng.random() < 0.2:
        actions.append(_action("dtkv.prefetch", {"scope": rng.choice(list(others))}, 1))
    return {"protocol_version": "1.0", "message_id": "m", "actions": actions}


class HintedTurns:
    """The hint layer of every soak session (one per store; sessions call it from their threads)."""

    def __init__(self, store: TieredStore, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self.stats = HintStats()
        self.scopes: SessionScopes[BlockKey] = SessionScopes()
        self._lock = threading.Lock()  # the scopes table is the scheduler's: one thread at a time
        self._times: deque[float] = deque(maxlen=1 << 14)  # seconds per turn, since the last sample
        self.turns = self.hostile = self.ended = 0

    def turn(self, sid: int, rng: random.Random, conv: np.ndarray, keys: Sequence[BlockKey],
             others: Sequence[str]) -> tuple[int, float]:
        """Hints and lookup of one turn: ``(blocks found, seconds the caller spent)``."""
        hostile = rng.random() < 0.1
        tenant = f"tenant-{sid % TENANTS}" if not hostile else "tenant-hostile"
        scope = conversation_scope(conv, self.block_size)
        t0 = time.perf_counter()
        hints = read_hints(kv_transfer_params={"kv_hints": envelope(rng, scope, others, hostile)}, stats=self.stats)
        claim = hints.retain if hints is not None else None
        owner = holder(tenant, claim)
        with self._lock:
            for p in hints.prefetch if hints is not None else ():
                wanted = self.scopes.span((tenant, p.scope), 0, None)
                if wanted:
                    self.store.prefetch(wanted)
            if claim is not None:
                cursor = RetentionCursor(claim, block_size=self.block_size, prompt_tokens=len(conv), now=time.time())
                levels = cursor.span(0, len(keys))
                if levels:
                    self.store.retain([keys[i] for i, _ in levels], [r for _, r in levels], holder=owner)
                    self.scopes.remember(owner, ((i, keys[i]) for i, _ in levels))
            final = (hostile and rng.random() < 0.5) or rng.random() < 0.02
            if ends_session(final, hints):
                done = dict.fromkeys(self.scopes.forget(owner))
                done.update(dict.fromkeys(keys))
                self.store.demote(list(done), holder=owner, wait=False)
                self.ended += 1
        found = self.store.lookup(keys).num_blocks
        spent = time.perf_counter() - t0
        with self._lock:
            self._times.append(spent)
            self.turns += 1
            self.hostile += hostile
        return found, spent

    def sample(self) -> dict[str, float]:
        """Sizes of the hint and retention structures, and the turn times since the last sample."""
        with self._lock:
            times, self._times = list(self._times), deque(maxlen=self._times.maxlen)
            out: dict[str, float] = {"hint_scopes": len(self.scopes)}
        for ti, tier in enumerate(self.store.tiers):
            cls = self.store.retention.retention_of(ti)
            out[f"retained_{tier.name}"] = len(cls)
            out[f"retention_heap_{tier.name}"] = sum(cls.heap_entries)
        out["hint_turn_ms_p50"] = 1000 * float(np.median(times)) if times else 0.0
        out["hint_turn_ms_p99"] = 1000 * float(np.percentile(times, 99)) if times else 0.0
        return out
