"""Worker role: owns the store next to the KV tensors; restores in the background (``onboard``) or
before the forward (``load_async=False``), saves after the forward."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...blocks.device_codec import warm_up_device_kernels
from ...blocks.keys import ROOT_KEY, Namespace, engine_block_key
from ...blocks.layout import EngineLayout
from ...config import TieredKVConfig
from ...errors import LayoutMismatch
from ...factory import build_store, check_record_fits, worker_rank
from ...hints import HintStats
from ...policy.pacing import StepShare
from ...policy.residency import medium_of
from ...store import TieredStore
from .cpu_amx import request_amx_tiles
from .cpu_threads import engine_sync_decode_threads
from .metadata import LoadSpec, TieredKVMetadata
from .onboard import Onboarder, Restored
from .rendezvous import LookupServer, register_local, unregister_local
from .session_retain import apply_specs

if TYPE_CHECKING:
    from .events import BlockResidency

log = logging.getLogger(__name__)
_SERVED_HISTORY = 1024
#: longest an idle engine step waits in ``get_finished`` for a restore to end: a request arriving
#: meanwhile is scheduled at most this much later (vLLM's own engine loop sleeps 1 ms there)
IDLE_STEP_WAIT_S = 0.005
#: store keys remembered for KV events (LRU; about 100 bytes + 4 per token each)
_TRACKED_BLOCKS = 1 << 18


class WorkerRole:
    """Args mirror what vLLM knows at worker start; the store is built in ``register_kv_caches``."""

    def __init__(self, config: TieredKVConfig, *, model_id: str, kv_dtype: str, block_size: int,
                 num_kv_heads: int, head_size: int, tp_rank: int, tp_size: int, engine_key: str,
                 authkey: bytes, is_mla: bool = False, pp_rank: int = 0, pp_size: int = 1,
                 dp_rank: int = 0) -> None:
        self.config = config
        self.model_id = model_id
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.dp_rank = dp_rank
        self.is_mla = is_mla
        self.engine_key = engine_key
        self._authkey = authkey
        self.layout: EngineLayout | None = None
        self.store: TieredStore | None = None
        self.namespace: Namespace | None = None
        self._server: LookupServer | None = None
        self._load_errors: set[int] = set()
        #: store keys -> token hashes for KV events (created at the first save with events on)
        self._residency: BlockResidency | None = None
        self.tracked_blocks = _TRACKED_BLOCKS
        self._failed_this_step: set[int] = set()
        #: per request id: tier name of each block restored for it (recent requests only; the demo
        #: and the e2e tests report it)
        self.served: OrderedDict[str, list[str]] = OrderedDict()
        #: wall seconds spent in loads and in save submissions (the demo reports these)
        self.load_seconds = 0.0
        self.save_seconds = 0.0
        self._asleep = False  # between unregister_kv_caches and restore_kv_caches (vLLM sleep mode)
        self._onboard = Onboarder(self._restore, config.load_timeout_s)
        #: paces async restores' CPU verify+scatter against the forward (CPU layouts; set at registration)
        self._pacer: StepShare | None = None
        #: threads a synchronous restore verifies+scatters with (CPU layouts; set at registration)
        self._sync_decode_threads: int | None = None
        #: the scheduler's hint counters (``TieredKVMetadata.hint_counts``), on this store's /metrics.
        #: Every TP and PP rank gets the same metadata: only the first exports them, so a sum over
        #: ranks counts each hint once (each DP rank has its own scheduler and its own first worker).
        self.hint_stats = HintStats()
        self._exports_hints = tp_rank == 0 and pp_rank == 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        try:
            layout = _detect_layout(kv_caches, self.block_size, self.num_kv_heads, self.head_size, self.is_mla)
        except LayoutMismatch as e:  # the engine runs on without tiering: no store, loads fail-safe, no saves
            log.error("TieredKVConnector disabled on this worker: KV cache layout not supported (%s); "
                      "every prefix is recomputed", e)
            return
        if not layout.is_cuda:
            request_amx_tiles()  # before the engine's first forward (see cpu_amx.py)
            self._sync_decode_threads = engine_sync_decode_threads()
            share = self.config.restore_cpu_share
            self._pacer = StepShare(share) if share > 0 else None
        self.layout = layout
        warm_up_device_kernels(layout)  # a CUDA engine's copy kernels compile now, not on its first save or restore
        self.namespace = Namespace(self.model_id, self.kv_dtype, layout.kind.name,
                                   layout.shape.block_size, layout.shape.num_layers, layout.shape.num_kv_heads,
                                   layout.shape.head_size, self.tp_rank, self.tp_size,
                                   tenant_salt=self.config.tenant_salt.get_secret_value(),
                                   pp_rank=self.pp_rank, pp_size=self.pp_size)
        check_record_fits(self.config, layout.shape, "block")
        # Unique per worker process on the host: names its SSD directory and offsets its metrics port.
        rank = worker_rank(tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size,
                           dp_rank=self.dp_rank)
        self.store = build_store(self.config, self.namespace, rank=rank)
        log.info("TieredKVConnector worker: layout %s %s, %d blocks, tiers %s%s", layout.kind.name, layout.shape,
                 layout.num_blocks, [t.name for t in self.store.tiers],
                 "" if self._sync_decode_threads is None else
                 f", synchronous restores verify on {self._sync_decode_threads} thread(s) (see cpu_threads)")
        if self._exports_hints:
            self._export_hint_stats(self.store)
        if self.tp_rank == 0 and self.pp_rank == 0:  # one lookup server per engine
            register_local(self.engine_key, self.lookup)
            try:
                self._server = LookupServer(self.engine_key, self.lookup, self._authkey)
            except OSError as e:  # same-process schedulers still work through register_local
                log.warning("lookup socket unavailable (%s); only an in-process scheduler can query", e)

    def _export_hint_stats(self, store: TieredStore) -> None:
        try:  # a failure costs the metrics, never the store
            self.hint_stats.register(store.metrics.registry)
        except Exception as e:
            store.metrics.observability_failures.labels("collector").inc()
            log.warning("hint counters not exported (%s); the store runs without them", e)

    def keys_of(self, token_hashes: Sequence[bytes]) -> list[bytes]:
        ns = self.namespace
        assert ns is not None
        return [engine_block_key(ns, ROOT_KEY, h) for h in token_hashes]

    def lookup(self, token_hashes: Sequence[bytes]) -> tuple[int, tuple[str, ...]]:
        if self.store is None:
            return 0, ()
        r = self.store.lookup(self.keys_of(token_hashes))
        return r.num_blocks, r.tier_per_block

    def start_load_kv(self, meta: TieredKVMetadata) -> None:
        """Submit this step's async restores; run its synchronous loads within one ``load_timeout_s``."""
        self._failed_this_step = set()
        counts = getattr(meta, "hint_counts", None)
        if counts is not None and self._exports_hints:
            self.hint_stats.add(counts)  # never raises; malformed counts are dropped
        if self._pacer is not None:
            self._pacer.step(busy=not meta.idle)
        if meta.reset_cache:
            self._onboard.reset()  # restores in flight bring KV of the old weights: recompute them
            if self._residency is not None:
                self._residency.reset()  # every announced block is unusable now, shared tier's too
            if self.store is not None:
                self.store.drop_local()  # the weights changed: this node's blocks can never be used again
        if meta.retains and self.store is not None:
            apply_specs(self.store, meta.retains, self.keys_of)  # KV hints: retention tables only, no I/O
        sync: list[LoadSpec] = []
        for spec in meta.loads:
            if not spec.is_async:
                sync.append(spec)
            elif self.store is None or self.layout is None:
                self._onboard.submit_failed(spec.req_id, spec.block_ids)
            else:  # keys and the engine's device point now: both are the engine thread's
                self._onboard.submit(spec.req_id, spec.block_ids, self.keys_of(spec.token_hashes),
                                     mark=self._engine_mark())
        if sync:
            self._load_sync(sync)

    def _engine_mark(self) -> Any:
        """For an async restore of a CUDA layout, on the engine thread: an event after the kernels
        the engine queued so far, which may still read the request's new blocks. The restore's
        scatters wait for it alone, not for the forwards queued while it runs. None on CPU."""
        layout = self.layout
        if layout is None or not getattr(layout, "is_cuda", False):
            return None
        from ...staging.device_copy import engine_mark

        return engine_mark(layout.device)

    def _restore(self, block_ids: list[int], keys: list[Any], timeout: float, mark: Any = None) -> Any:
        """One async restore, on an onboarding thread (``TieredStore.load`` allows any thread),
        ordered after ``mark`` (``_engine_mark``) on the device."""
        store, layout = self.store, self.layout
        if store is None or layout is None:
            raise RuntimeError("store closed")
        if mark is None:
            return store.load(layout, block_ids, keys, timeout=timeout, pacer=self._pacer)
        from ...staging.device_copy import restore_after

        with restore_after(mark):
            return store.load(layout, block_ids, keys, timeout=timeout, pacer=self._pacer)

    def get_finished(self, finished_req_ids: set[str], idle: bool = False) -> set[str]:
        """Requests whose async restore is over; their failed blocks go into this step's load errors.

        ``idle``: nothing ran this step; wait up to ``IDLE_STEP_WAIT_S`` for a restore to end
        (returns as soon as one does) so the engine loop does not spin against the restore threads.
        """
        if idle and not finished_req_ids and len(self._onboard):
            self._onboard.wait_for_any(IDLE_STEP_WAIT_S)
        done = self._onboard.poll(finished_req_ids)
        for r in done:
            self._note_restored(r)
        return {r.req_id for r in done}

    def _note_restored(self, r: Restored) -> None:
        """Account one finished restore (asynchronous, or synchronous in this step)."""
        if r.failed_block_ids:
            log.info("request %s: %d blocks failed to %s; vLLM recomputes them", r.req_id,
                     len(r.failed_block_ids), "load" if r.sync else "restore")
            self._load_errors.update(r.failed_block_ids)
        self.served[r.req_id] = r.tier_per_block
        if len(self.served) > _SERVED_HISTORY:
            self.served.popitem(last=False)
        self.load_seconds += r.load_s
        m = getattr(self.store, "metrics", None)
        if m is not None:  # the engine-facing stages of a restore (the store observes the rest)
            h = m.restore_stage_seconds
            h.labels("queue", "all").observe(r.queued_s)
            h.labels("engine_wait", "all").observe(r.engine_wait_s)

    def _load_sync(self, loads: list[LoadSpec]) -> None:
        """Synchronous loads (the whole batch waits on them), all within one ``load_timeout_s``."""
        if self.store is None or self.layout is None:
            for spec in loads:
                self._failed_this_step.update(spec.block_ids)
            self._load_errors |= self._failed_this_step
            return
        deadline = time.monotonic() + self.config.load_timeout_s
        for i, spec in enumerate(loads):
            left = deadline - time.monotonic()
            if left <= 0:  # past the step's deadline: the rest are recomputed, not waited on
                late = [b for s in loads[i:] for b in s.block_ids]
                log.warning("step load deadline (%.1fs) passed: %d blocks of %d requests will be recomputed",
                            self.config.load_timeout_s, len(late), len(loads) - i)
                self._failed_this_step.update(late)
                break
            t0 = time.perf_counter()
            res = self.store.load(self.layout, spec.block_ids, self.keys_of(spec.token_hashes), timeout=left,
                                  decode_threads=self._sync_decode_threads)
            dt = time.perf_counter() - t0
            self._failed_this_step.update(res.failed_block_ids)
            # the request runs in this very step: its wait is the load itself, no step in between
            self._note_restored(Restored(spec.req_id, list(res.failed_block_ids), list(res.tier_per_block),
                                         0.0, dt, dt, steps=0, sync=True))
        self._load_errors |= self._failed_this_step

    def wait_for_save(self, meta: TieredKVMetadata) -> None:
        if self.store is None or self.layout is None:
            return
        t0 = time.perf_counter()
        for spec in meta.saves:
            hashes = spec.token_hashes
            keys = self.keys_of(hashes)
            if spec.first_index > 0:
                parents, keys = keys[:-1], keys[1:]
            else:
                parents = [ROOT_KEY, *keys[:-1]]
            ids, ks, ps = [], [], []
            for b, k, p in zip(spec.block_ids, keys, parents, strict=True):
                if b in self._failed_this_step:
                    break  # its content is not what the key names: never store it
                ids.append(b)
                ks.append(k)
                ps.append(p)
            if ids and spec.token_ids is not None:
                self._track_for_events(spec, ks)  # before the submit: a write may finish before it returns
            if ids:
                self.store.submit_offload(self.layout, ids, ks, ps, first_index=spec.first_index, tenant=spec.tenant)
        self.save_seconds += time.perf_counter() - t0

    def _track_for_events(self, spec: Any, keys: list[bytes]) -> None:
        """KV events are on (the scheduler sent the tokens): remember what these keys are, so the
        store's residency reports (which tier stored or dropped which key) become vLLM events."""
        store = self.store
        assert store is not None
        if self._residency is None:
            from .events import BlockResidency

            self._residency = BlockResidency(self.block_size, self.tracked_blocks)
            store.set_residency(self._residency)
        n = len(keys)
        own = spec.token_hashes[1:] if spec.first_index > 0 else spec.token_hashes
        parent = spec.token_hashes[0] if spec.first_index > 0 else None
        tiers = [(t, medium_of(t)) for t in store.tiers]
        self._residency.track(keys, own[:n], parent, spec.token_ids[:n * self.block_size], lora_id=spec.lora_id,
                              lora_name=spec.lora_name, tenant=spec.tenant,
                              holders=lambda k: [m for t, m in tiers if m is not None and t.contains(k)])

    def take_kv_events(self) -> Any:
        """The tiers' stored/removed events since the last call, as vLLM's ``KVConnectorKVEvents``."""
        events = self._residency.take() if self._residency is not None else []
        if not events:
            return None
        from .events import TieredKVEvents

        out = TieredKVEvents(num_workers=1, world=self.tp_size * self.pp_size)
        out.add_events(events)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def unregister_kv_caches(self) -> None:
        """vLLM sleep mode: the engine's KV memory is about to be released. Every restore that may
        still write into it ends first (by its deadline at the latest), accepted offloads finish,
        and GPU-direct memory registrations are dropped. Idempotent."""
        if self._asleep:
            return
        self._asleep = True
        if not self._onboard.quiesce(self.config.load_timeout_s + 1.0):
            log.warning("sleep: a restore is still running after its deadline; its blocks are reported failed")
        if self.store is not None and not self.store.suspend_device(self.config.load_timeout_s):
            log.warning("sleep: offloads still queued after %.0fs", self.config.load_timeout_s)

    def restore_kv_caches(self) -> None:
        """vLLM wake-up: the KV memory is back at the same addresses; register it again. Idempotent."""
        if not self._asleep:
            return
        if self.store is not None:
            self.store.resume_device()
        self._asleep = False

    def shutdown(self) -> None:
        # Restores end by their deadline; none may run into a closed store or freed engine memory.
        self._onboard.close(self.config.load_timeout_s + 1.0)
        unregister_local(self.engine_key)
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.store is not None:
            self.store.close()
            self.store = None


def _detect_layout(kv_caches: dict[str, Any], block_size: int, num_kv_heads: int, head_size: int,
                   is_mla: bool) -> EngineLayout:
    """GPU (FlashAttention, FlashInfer, MLA) and CPU layouts; raises ``LayoutMismatch`` otherwise.

    The scheduler's block ids index these tensors directly, so the tensors' block size must be
    the scheduler's (a kernel block size that splits logical blocks is refused, not guessed).
    """
    return EngineLayout.from_vllm(kv_caches, block_size, num_kv_heads, head_size, is_mla=is_mla)
