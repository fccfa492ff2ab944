"""KV cache events: tell vLLM's event publisher (and Dynamo's KV router) which prefixes the store
now holds, as ``BlockStored`` events with ``medium="dtkv"``.

Workers emit one event per accepted offload; the scheduler role merges the workers' events and
keeps only those every TP rank reported (a prefix is restorable only if all shards are stored),
the same aggregation vLLM's LMCache connector uses. Block hashes are the connector's token
hashes (first 8 bytes as an int), chained through ``parent_block_hash``. Emitted only when the
engine runs with ``--kv-events-config '{"enable_kv_cache_events": true, ...}'``.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.distributed.kv_events import BlockStored, KVCacheEvent, KVConnectorKVEvents, KVEventAggregator

MEDIUM = "dtkv"


def external_hash(token_hash: bytes) -> int:
    return int.from_bytes(token_hash[:8], "little")


class TieredKVEvents(KVConnectorKVEvents):
    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> TieredKVEvents:
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._agg.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._agg.get_number_of_workers()

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()


def block_stored(token_hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int],
                 block_size: int, *, lora_id: int | None = None, lora_name: str | None = None) -> BlockStored:
    """One event for a run of consecutive stored blocks (of one LoRA adapter, or the base model)."""
    return BlockStored(block_hashes=[external_hash(h) for h in token_hashes],
                       parent_block_hash=external_hash(parent) if parent else None,
                       token_ids=list(token_ids), block_size=block_size, lora_id=lora_id, medium=MEDIUM,
                       lora_name=lora_name)
