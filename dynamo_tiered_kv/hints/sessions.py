"""Session rules both vLLM adapters share: who holds a retention, what a session remembers, when
a request ends its session, and a request's retention plan computed a bounded number of times.

* ``holder(tenant, claim)``: the identity under which a request's retention is held, ``(tenant,
  scope)``. ``tenant`` is what the adapter knows of the request's tenant as an opaque digest
  (never a salt: salts are secrets); ``scope`` is the ``kv.retain`` scope (None: the tenant's
  unscoped requests). ``retention.RetentionClasses`` ranks a block by the strongest claim of all
  its holders and lets each holder lower or release only its own claim: a request can raise the
  retention others gave a block, never lower it.
* ``SessionScopes``: the blocks each retained session (tenant, scope) has, by block index, so a
  ``dtkv.prefetch`` can promote them and the session's end can release them. Bounded: at most
  ``MAX_SCOPES`` sessions (least recently used forgotten) of at most ``MAX_SCOPE_BLOCKS`` blocks.
  Keyed by tenant, so one tenant's request never names another tenant's session.
* ``ends_session(final, hints)``: a request ends its session when it carries the session-final
  flag, or when its ``kv.retain`` releases everything it names (every directive priority 0).
  An empty directive list names nothing and releases nothing.
* ``RetentionCursor``: a request's per-block retention, planned once over its prompt and again
  only when a block past the plan's horizon shows up (the horizon doubles each time), so a
  request costs a few plans (each O(directives)) however many blocks it has, and each block
  costs a table lookup (``hints.limits``).

Threads: every class here belongs to one adapter object and runs on the engine's scheduler
thread (vLLM calls both adapters' hint hooks there); none takes a lock or does I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from .limits import MAX_SCOPE_BLOCKS, MAX_SCOPES
from .plan import BlockRetention, RetentionPlan, plan_retention
from .reader import RequestHints
from .retain import RetainClaim

K = TypeVar("K", bound=Hashable)

#: the tenant of requests an adapter cannot attribute (no salt, or no way to see it)
DEFAULT_TENANT = ""

Holder = tuple[str, "str | None"]


def holder(tenant: str, claim: RetainClaim | None) -> Holder:
    """The holder of the retention ``claim`` of a request of ``tenant`` (module docstring)."""
    return tenant, None if claim is None else claim.scope


def ends_session(final: bool, hints: RequestHints | None) -> bool:
    """Whether a finished request ends its session (module docstring)."""
    claim = hints.retain if hints is not None else None
    releases = claim is not None and bool(claim.directives) and all(d.priority == 0 for d in claim.directives)
    return final or releases


class SessionScopes(Generic[K]):
    """The blocks of each retained session, by (tenant, scope) and block index (module docstring)."""

    def __init__(self, max_scopes: int = MAX_SCOPES, max_blocks: int = MAX_SCOPE_BLOCKS) -> None:
        self.max_scopes = max_scopes
        self.max_blocks = max_blocks
        # block index -> key; a list indexed by block (None: not seen), so a range is a slice
        self._blocks: OrderedDict[Holder, list[K | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks_of(self, owner: Holder) -> int:
        """How many block slots ``owner``'s session tracks (its highest index seen plus one)."""
        return len(self._blocks.get(owner, ()))

    def remember(self, owner: Holder, blocks: Iterable[tuple[int, K]], *, replace: bool = False) -> None:
        """Note ``(index, key)`` blocks of session ``owner`` (``replace``: forget its earlier ones).

        Indices at or past ``max_blocks`` are not remembered: the cap is exact."""
        if owner[1] is None:
            return  # an unscoped request names no session
        table = self._blocks.pop(owner, None)
        if table is None or replace:
            table = []
        for index, key in blocks:
            if not 0 <= index < self.max_blocks:
                continue
            if index >= len(table):
                table.extend([None] * (index + 1 - len(table)))
            table[index] = key
        self._blocks[owner] = table
        while len(self._blocks) > self.max_scopes:
            self._blocks.popitem(last=False)

    def span(self, owner: Holder, first: int, stop: int | None) -> list[K] | None:
        """Keys of session ``owner``'s blocks ``[first, stop)`` in order (None: session unknown)."""
        table = self._blocks.get(owner)
        if table is None:
            return None
        self._blocks.move_to_end(owner)
        return [k for k in table[max(0, first):stop] if k is not None]

    def latest(self, scope: str) -> Holder | None:
        """The most recently used session named ``scope``, of any tenant (for an adapter that
        cannot see the tenant yet; at most ``max_scopes`` looked at)."""
        return next((h for h in reversed(self._blocks) if h[1] == scope), None)

    def forget(self, owner: Holder) -> list[K]:
        """Forget session ``owner``; its remembered keys."""
        table = self._blocks.pop(owner, None) or []
        return [k for k in table if k is not None]


class RetentionCursor:
    """One request's retention per block, planned a bounded number of times (module docstring).

    ``prompt_tokens``: where generated tokens start (``covers_output``; None: unknown, every block
    is planned as prompt, so ``covers_output`` protects nothing). A block's level depends
    only on the tokens it holds and on the blocks before it, so a plan over a longer sequence
    gives every block it shares with a shorter one the same level: planning ahead to a horizon
    is exact for every block inside it.
    """

    def __init__(self, claim: RetainClaim, *, block_size: int, prompt_tokens: int | None, now: float) -> None:
        self.claim = claim
        self.block_size = block_size
        self.prompt_tokens = prompt_tokens
        self.now = now  # expiries count from the request's first plan
        self.plans = 0  # plans computed (a bound the tests hold the adapters to)
        self._plan = RetentionPlan(0, ())

    def _extend(self, blocks: int) -> None:
        bs = self.block_size
        prompt = self.prompt_tokens
        horizon = max(blocks, 2 * self._plan.num_blocks, 1 if prompt is None else -(-prompt // bs), 1)
        if prompt is None:
            prompt = horizon * bs
        self._plan = plan_retention(self.claim.directives, block_size=bs, num_prompt_tokens=prompt,
                                    num_output_tokens=max(0, horizon * bs - prompt), now=self.now,
                                    num_blocks=horizon)
        self.plans += 1

    def at(self, index: int) -> BlockRetention | None:
        """The retention of block ``index`` (None: the request leaves it untouched)."""
        if index < 0:
            return None
        if index >= self._plan.num_blocks:
            self._extend(index + 1)
        return self._plan.at(index)

    def span(self, first: int, stop: int) -> list[tuple[int, BlockRetention]]:
        """``(index, retention)`` of blocks ``[first, stop)`` it touches, in order."""
        if stop > self._plan.num_blocks:
            self._extend(stop)
        out: list[tuple[int, BlockRetention]] = []
        for lo, hi, level in self._plan.ranges:
            if level is not None and hi > first and lo < stop:
                out.extend((i, level) for i in range(max(lo, first), min(hi, stop)))
        return out
