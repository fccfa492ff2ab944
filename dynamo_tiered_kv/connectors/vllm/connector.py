"""``TieredKVConnector``: vLLM's ``KVConnectorBase_V1`` over a ``TieredStore``.

Enable it with::

    --kv-transfer-config '{"kv_connector": "TieredKVConnector",
                           "kv_connector_module_path": "dynamo_tiered_kv.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"ssd_dir": "/nvme/kv", "object_url": "s3://kv/llama"}}'

The class is a thin facade: the scheduler role (``scheduler.SchedulerRole``) decides what moves,
the worker role (``worker.WorkerRole``) owns the store and moves bytes. Written against the
0.32 API and only uses hooks that 0.31 (ai-dynamo 1.6.1) has with the same signatures.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...config import TieredKVConfig
from ...errors import ConfigError
from ..common.identity import engine_identity
from .metadata import StepEcho, TieredKVMetadata
from .rendezvous import LookupClient, engine_key
from .scheduler import SchedulerRole, with_recompute_policy
from .worker import WorkerRole

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _kv_dtype(vllm_config: Any) -> str:
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


class TieredKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        _refuse_context_parallel(vllm_config.parallel_config)
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.config = TieredKVConfig.from_mapping(dict(ktc.kv_connector_extra_config or {}))
        model_id = engine_identity(vllm_config, override=self.config.model_id or "")
        block_size = int(vllm_config.cache_config.block_size)
        pc = vllm_config.parallel_config
        key = engine_key(str(ktc.engine_id), int(getattr(pc, "data_parallel_rank", 0) or 0))
        authkey = str(ktc.engine_id).encode()
        self._scheduler: SchedulerRole | None = None
        self._worker: WorkerRole | None = None
        if role == KVConnectorRole.SCHEDULER:
            with_recompute_policy(ktc)
            kec = getattr(vllm_config, "kv_events_config", None)
            self._scheduler = SchedulerRole(self.config, model_id=model_id, block_size=block_size,
                                            lookup=LookupClient(key, authkey),
                                            kv_events=bool(kec is not None and kec.enable_kv_cache_events))
        else:
            mc = vllm_config.model_config
            tp_size = int(pc.tensor_parallel_size)
            pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
            tp_rank = _rank("tensor", tp_size)
            self._worker = WorkerRole(
                self.config, model_id=model_id, kv_dtype=_kv_dtype(vllm_config), block_size=block_size,
                num_kv_heads=int(mc.get_num_kv_heads(pc)), head_size=int(mc.get_head_size()), tp_rank=tp_rank,
                tp_size=tp_size, engine_key=key, authkey=authkey,
                is_mla=bool(getattr(mc, "use_mla", False)), pp_rank=_rank("pipeline", pp_size), pp_size=pp_size,
                dp_rank=int(getattr(pc, "data_parallel_rank", 0) or 0),
            )

    # --- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33: yes. Sleep quiesces restores and offloads and deregisters GPU-direct
        memory (``unregister_kv_caches``); wake-up registers it again (``restore_kv_caches``).
        Stored KV stays valid across sleep: it is named by content and model identity."""
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-prefix: in the background (onboard) or synchronous in start_load_kv

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending: none, saves never hold blocks; finished receiving: async restores over)."""
        if self._worker is None:
            return None, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, TieredKVMetadata) and meta.idle
        return None, self._worker.get_finished(finished_req_ids, idle=idle) or None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved once per step in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self._worker.take_kv_events() if self._worker is not None else None

    def build_connector_worker_meta(self) -> StepEcho | None:
        """Every step, with or without a forward: the number of the step this worker ran, which
        the scheduler role pairs the step's load outcome with (``load_outcomes``)."""
        if self._worker is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return StepEcho(meta.step) if isinstance(meta, TieredKVMetadata) and meta.step > 0 else None

    def _meta(self) -> TieredKVMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredKVMetadata)
        return meta

    # --- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def take_events(self) -> Any:
        return self._scheduler.take_events() if self._scheduler is not None else []

    def reset_cache(self) -> bool | None:
        if self._scheduler is None:
            return None
        return self._scheduler.reset_cache()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, block_ids)

    # --- both -------------------------------------------------------------------------------
    @property
    def worker(self) -> WorkerRole | None:
        """The worker role (its ``store`` and ``served`` map), for tools and tests."""
        return self._worker

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()


def _refuse_context_parallel(parallel_config: Any) -> None:
    """Context parallelism shards every block's tokens across ranks; stored records cannot name them.

    With ``decode_context_parallel_size`` (dcp) > 1 vLLM's scheduler block spans
    ``block_size * dcp`` tokens and each rank's KV block holds an interleaved 1/dcp of them, while
    the connector names and stores ``block_size``-token blocks: loads and saves would pair wrong
    tokens with wrong blocks. Prefill context parallelism (pcp) shards the same way.
    """
    dcp = int(getattr(parallel_config, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1)
    if dcp > 1 or pcp > 1:
        raise ConfigError(
            f"TieredKVConnector does not support context parallelism (decode_context_parallel_size={dcp}, "
            f"prefill_context_parallel_size={pcp}): each rank holds an interleaved share of every block's "
            "tokens and a scheduler block spans block_size x dcp tokens, which stored block-size records "
            "cannot name; run with both at 1 or without the connector")


def _rank(kind: str, size: int) -> int:
    """This worker's tensor- or pipeline-parallel rank, from vLLM's distributed state.

    With more than one rank of ``kind``, an unknown rank is refused rather than taken as 0: every
    rank would then write its shard under the same keys into the shared object tier."""
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank() if kind == "tensor" else get_pp_group().rank_in_group)
    except Exception as e:
        if size == 1:
            return 0  # one rank: nothing to tell apart (a worker built outside vLLM's distributed init)
        raise ConfigError(f"TieredKVConnector: this worker's {kind}-parallel rank is unknown ({type(e).__name__}: "
                          f"{e}) with {kind}-parallel size {size}; every rank would write the same keys") from e
