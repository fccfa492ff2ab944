"""Every field of vLLM's engine configs, classified: does it change the bytes of stored KV?

``VLLM_FIELDS[class][field]`` is ``"identity: <where it enters the keys>"`` or ``"ignored: <why it
cannot change KV>"``. The audit test enumerates the installed vLLM's fields and fails on one
missing here, so a new engine field is classified before it can silently alias KV; it also
checks that every ``identity`` field changes the keys. Where the keys go:

* ``model_id``: ``identity.model_identity`` (name, revision, commit or weights fingerprint, settings);
* ``Namespace.<field>``: the worker's namespace (``connector`` passes the value to ``WorkerRole``);
* ``scope``: a request scope (``identity.lora_scopes`` through ``keys.scope_salt``).

Only text requests are stored (requests with multimodal inputs or prompt embeddings are not), so
multimodal settings are ignored; token ids, not text, are hashed, so tokenizer settings are too.
Derived fields are ignored where the input they are derived from is classified.
"""

from __future__ import annotations

_MM = "ignored: multimodal setting; requests with multimodal inputs are never stored"
_SAMPLING = "ignored: acts after the final hidden states (sampling, logprobs, output)"
_TOKENIZER = "ignored: keys hash token ids, so how text became ids does not matter"
_RUNTIME = "ignored: process, memory or scheduling setting; same math on the same weights"
_DERIVED = "ignored: derived by vLLM from fields classified here"
_CP = ("ignored: context parallelism; the connector refuses to start with decode or prefill "
       "context parallel size > 1, so stored blocks are never sharded by it")
_MAMBA = "ignored: Mamba state; only paged attention KV is stored"
_DP = "ignored: data parallel ranks are replicas with the same KV; their placement changes nothing"
_EP = "ignored: MoE expert placement or communication; every placement computes the same KV"

_MODEL_CONFIG: dict[str, str] = {
    "model": "identity: model_id name (or the model_id override, which replaces only the name), hub commit or "
             "local weights fingerprint",
    "model_weights": "ignored: original URI of weights copied to the local path in `model`, which is fingerprinted",
    "runner": "identity: model_id runner= when not auto",
    "convert": "identity: model_id convert= when not auto",
    "tokenizer": _TOKENIZER,
    "tokenizer_mode": _TOKENIZER,
    "trust_remote_code": "ignored: permission only; which code runs is pinned by model and code_revision",
    "dtype": "identity: Namespace.kv_dtype when cache_dtype is auto; model_id dtype= when the KV is quantized",
    "seed": _SAMPLING,
    "hf_config": "ignored: read from the model's files (pinned by revision, commit or fingerprint) plus "
                 "hf_overrides; its text part is hf_text_config",
    "hf_text_config": "identity: model_id rope= (rope_scaling or rope_parameters); its other values are read "
                      "from the model's files (pinned) plus hf_overrides, its shape is in the Namespace",
    "is_submodel_config": _DERIVED,
    "word_embeddings_untied_by_checkpoint": _DERIVED + " (the checkpoint)",
    "hf_config_path": "identity: model_id hf_config_path= when set",
    "allowed_local_media_path": _MM,
    "allowed_media_domains": _MM,
    "revision": "identity: model_id @revision (kept under a model_id override)",
    "code_revision": "identity: model_id code_revision= when set",
    "tokenizer_revision": _TOKENIZER,
    "max_model_len": "ignored: caps sequence length; a prefix's KV does not depend on it (rope is hf_text_config)",
    "spec_target_max_model_len": "ignored: length cap for a speculative draft model, whose KV is not stored",
    "quantization": "identity: model_id quantization= when set",
    "quantization_config": "identity: model_id quantization_config= when set",
    "allow_deprecated_quantization": "ignored: permission only; the method is `quantization`",
    "enforce_eager": "ignored: eager or graph execution of the same kernels",
    "return_sampling_mask": _SAMPLING,
    "max_logprobs": _SAMPLING,
    "logprobs_mode": _SAMPLING,
    "use_fp64_gumbel": _SAMPLING,
    "enable_trace_replay": _SAMPLING,
    "disable_sliding_window": "identity: model_id disable_sliding_window= when true",
    "disable_cascade_attn": "ignored: has no effect (cascade attention was removed)",
    "skip_tokenizer_init": _TOKENIZER,
    "enable_prompt_embeds": "ignored: requests with prompt embeddings are never stored",
    "served_model_name": "ignored: API alias; the model itself is `model`",
    "config_format": "identity: model_id config_format= when not auto",
    "hf_token": "ignored: credential",
    "hf_overrides": "identity: model_id hf_overrides= when set",
    "model_class_overrides": "identity: model_id model_class_overrides= when set",
    "generation_config": _SAMPLING,
    "override_generation_config": _SAMPLING,
    "enable_sleep_mode": _RUNTIME,
    "sleep_preserve_parameter_names": _RUNTIME,
    "sleep_mode_backend": _RUNTIME,
    "sleep_mode_offload_cudagraph": _RUNTIME,
    "enable_nccl_comm_suspend": _RUNTIME,
    "enable_cumem_allocator": _RUNTIME,
    "model_impl": "identity: model_id model_impl= when not auto",
    "logits_processors": _SAMPLING,
    "io_processor_plugin": _SAMPLING,
    "renderer_num_workers": _RUNTIME,
    "pooler_config": _SAMPLING,
    "multimodal_config": _MM,
    **{name: _MM for name in (
        "language_model_only", "limit_mm_per_prompt", "enable_mm_embeds", "media_io_kwargs", "mm_processor_kwargs",
        "mm_processor_cache_gb", "mm_processor_cache_type", "mm_hasher_algorithm", "mm_shm_cache_max_object_size_mb",
        "mm_encoder_only", "mm_encoder_tp_mode", "mm_encoder_attn_backend", "mm_encoder_attn_dtype",
        "mm_encoder_fp8_scale_path", "mm_encoder_fp8_scale_save_path", "mm_encoder_fp8_scale_save_margin",
        "interleave_mm_strings", "skip_mm_profiling", "video_pruning_rate", "video_pruning_method",
        "mm_tensor_ipc", "mm_ipc_gpu_memory_gb", "mm_device_do_normalize", "mm_processor_device")},
}

_CACHE_CONFIG: dict[str, str] = {
    "block_size": "identity: Namespace.block_size (and the scheduler's token namespace)",
    "user_specified_block_size": _DERIVED,
    "kv_cache_layout": "ignored: the worker detects the layout from the registered tensors (Namespace.layout)",
    "prefix_match_unit": "ignored: granularity of the engine's own prefix-cache keys; stored keys are per block",
    "gpu_memory_utilization": _RUNTIME,
    "cache_dtype": "identity: Namespace.kv_dtype; when not auto, model_id dtype= names the compute dtype too",
    "is_attention_free": "ignored: an attention-free model has no paged KV to store",
    "num_gpu_blocks_override": _RUNTIME,
    "sliding_window": _DERIVED + " (the model's config; disable_sliding_window)",
    "enable_prefix_caching": _RUNTIME,
    "prefix_caching_hash_algo": "ignored: the engine's own hashes; stored keys hash token ids with BLAKE2b",
    "prefix_cache_retention_interval": _RUNTIME,
    "kv_cache_dtype_skip_layers": "identity: model_id kv_skip_layers= when the KV is quantized",
    "mamba_page_size_padded": _MAMBA,
    "skip_page_size_padded": "ignored: padding of the skipped layers' pages; the bytes are kv_cache_dtype_skip_layers",
    "mamba_block_size": _MAMBA,
    "mamba_cache_dtype": _MAMBA,
    "mamba_ssm_cache_dtype": _MAMBA,
    "mamba_cache_mode": _MAMBA,
    "enable_mamba_shared_prefix_checkpoint": _MAMBA,
    "replayssm_buffer_len": _MAMBA,
    "use_replayssm": _MAMBA,
    "use_kda_recoverssm": _MAMBA,
    "num_gpu_blocks": _RUNTIME,
    "num_cpu_blocks": _RUNTIME,
    "effective_attention_block_size": _DERIVED,
    "kv_cache_size_tokens": _RUNTIME,
    "kv_cache_max_concurrency": _RUNTIME,
    "hash_block_size": _DERIVED,
    "cache_hit_alignment_tokens": _DERIVED,
    "kv_sharing_fast_prefill": "ignored: skips computing prompt tokens in KV-sharing layers; stored KV is written "
                               "by the layers that own it, the same either way",
    "swa_bounded_replay": "ignored: which sliding-window blocks the engine's own prefix cache keeps; the values "
                          "computed are the same",
    "kv_cache_memory_bytes": _RUNTIME,
    "kv_offloading_size": _RUNTIME,
    "kv_offloading_backend": _RUNTIME,
    "simple_cpu_offload_num_blocks": _RUNTIME,
    "_block_size_resolved": _DERIVED,
}

_PARALLEL_CONFIG: dict[str, str] = {
    "pipeline_parallel_size": "identity: Namespace.pp_size (with the stage as pp_rank)",
    "tensor_parallel_size": "identity: Namespace.tp_size (with the shard as tp_rank)",
    "prefill_context_parallel_size": _CP,
    "data_parallel_size": _DP,
    "data_parallel_size_local": _DP,
    "data_parallel_rank": _DP,
    "data_parallel_rank_local": _DP,
    "data_parallel_master_ip": _DP,
    "data_parallel_rpc_port": _DP,
    "dp_sync_interval": _DP,
    "data_parallel_master_port": _DP,
    "data_parallel_backend": _DP,
    "data_parallel_external_lb": _DP,
    "data_parallel_hybrid_lb": _DP,
    "is_moe_model": _DERIVED + " (the model)",
    "enable_hc_sp": "ignored: splits HyperConnection computation across TP ranks; same math",
    "enable_expert_parallel": _EP,
    "enable_batch_sharded_sampling": _SAMPLING,
    "enable_ep_weight_filter": _EP,
    "enable_eplb": _EP,
    "eplb_config": _EP,
    "expert_placement_strategy": _EP,
    "all2all_backend": _EP,
    "max_parallel_loading_workers": _RUNTIME,
    "disable_custom_all_reduce": "ignored: all-reduce implementation; same sums",
    "enable_shm_tensor_arena": _RUNTIME,
    "enable_elastic_ep": _EP,
    "elastic_ep_max_dp_size": _EP,
    "enable_dbo": "ignored: micro-batching of the same computation",
    "ubatch_size": "ignored: micro-batching of the same computation",
    "dbo_decode_token_threshold": "ignored: micro-batching of the same computation",
    "dbo_prefill_token_threshold": "ignored: micro-batching of the same computation",
    "disable_nccl_for_dp_synchronization": _DP,
    "ray_workers_use_nsight": _RUNTIME,
    "ray_runtime_env": _RUNTIME,
    "placement_group": _RUNTIME,
    "distributed_executor_backend": _RUNTIME,
    "worker_cls": _RUNTIME,
    "worker_extension_cls": _RUNTIME,
    "master_addr": _RUNTIME,
    "master_port": _RUNTIME,
    "node_rank": _RUNTIME,
    "nnodes": _RUNTIME,
    "numa_bind": _RUNTIME,
    "numa_bind_nodes": _RUNTIME,
    "numa_bind_cpus": _RUNTIME,
    "assigned_physical_gpu_ids": _RUNTIME,
    "distributed_timeout_seconds": _RUNTIME,
    "cpu_distributed_timeout_seconds": _RUNTIME,
    "world_size": _DERIVED + " (tensor_parallel_size x pipeline_parallel_size)",
    "rank": _DERIVED + " (the worker reads its TP and PP rank from vLLM's process groups)",
    "_data_parallel_master_port_list": _DP,
    "_coord_store_port": _RUNTIME,
    "decode_context_parallel_size": _CP,
    "dcp_kv_cache_interleave_size": _CP,
    "dcp_comm_backend": _CP,
    "dcp_q_replicate": _CP,
    "cp_kv_cache_interleave_size": _CP,
    "_allow_auto_resolve_cp_interleave_size": _CP,
    "data_parallel_index": _DP,
    "_api_process_count": _RUNTIME,
    "_api_process_rank": _RUNTIME,
    "enable_fault_tolerance": _RUNTIME,
    "fault_tolerance_config": _RUNTIME,
}

_LORA_REQUEST: dict[str, str] = {
    "lora_name": "identity: scope lora",
    "lora_int_id": "ignored: a number local to one engine process (vLLM names adapters by name and path)",
    "lora_path": "identity: scope lora_path, and scope lora_weights (fingerprint or hub commit of what is there)",
    "base_model_name": "ignored: the base model is the served model, already in model_id",
    "load_inplace": "ignored: makes vLLM reread the adapter; lora_scopes then fingerprints it again",
    "is_3d_lora_weight": "identity: scope lora_format when true",
}

#: class name -> field -> "identity: ..." or "ignored: ..."
VLLM_FIELDS: dict[str, dict[str, str]] = {
    "ModelConfig": _MODEL_CONFIG,
    "CacheConfig": _CACHE_CONFIG,
    "ParallelConfig": _PARALLEL_CONFIG,
    "LoRARequest": _LORA_REQUEST,
}
