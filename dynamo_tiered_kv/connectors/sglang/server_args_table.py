"""Every SGLang ``ServerArgs`` field, classified: does it change the bytes of the KV cache?

``identity:`` fields enter the namespace (``identity.server_identity``), so two servers that differ
in one never read each other's pages. ``ignored:`` fields change how, where or when the same KV is
computed, moved or served, not its bytes. A field SGLang adds fails ``tests/test_sglang_identity.py``
until it is classified here, which is the point: an unread flag must be a decision, not an accident.

Written against sglang 0.5.23's ``ServerArgs`` (546 fields).
"""

from __future__ import annotations

#: fields whose value changes the KV bytes of a page (or which rank holds which share of it)
IDENTITY = {
    "model_path": "the weights (a hub name or local path; its snapshot commit or fingerprint is added)",
    "revision": "the weights' hub revision",
    "load_format": "how weights are read (dummy, gguf, bitsandbytes, ... give other weights)",
    "model_loader_extra_config": "loader options that can change the loaded weights",
    "model_impl": "SGLang's or the transformers implementation of the model",
    "model_config_parser": "which parser reads the model config (another parser, another architecture)",
    "json_model_override_args": "model config overrides (layers, rope, heads)",
    "dtype": "compute dtype that produces the KV",
    "quantization": "weight quantization method",
    "quantization_param_path": "KV cache scaling factors of an fp8 KV cache",
    "kv_cache_dtype": "stored KV dtype",
    "modelopt_quant": "ModelOpt quantization of the weights",
    "modelopt_checkpoint_restore_path": "a ModelOpt quantized checkpoint",
    "quantize_and_serve": "weights quantized at load",
    "rl_quant_profile": "FlashRL quantization profile of the weights",
    "qsa_indexer_dtype": "dtype of the indexer cache stored with the KV",
    "page_size": "tokens per page",
    "c128_page_size": "physical page size of a compressed KV cache",
    "tp_size": "KV heads per rank",
    "pp_size": "layers per rank",
    "dp_size": "with DP attention, the attention TP width",
    "attn_dp_size": "attention TP width (KV heads per rank)",
    "enable_dp_attention": "attention TP width (KV heads per rank)",
    "attn_cp_size": "tokens of a page held per rank",
    "dcp_size": "tokens of a page held per rank",
    "enable_prefill_cp": "tokens of a page held per rank",
    "cp_strategy": "which tokens of a page each rank holds",
    "enable_kv_cache_sharding": "pages sharded across ranks that otherwise replicate them",
    "enable_dsa_cache_layer_split": "cache layers split across ranks",
    "enable_page_major_kv_layout": "per-token-slot KV entries holding every layer",
    "enable_unified_memory": "one byte buffer for all KV pools",
    "lora_paths": "which adapter weights an adapter name (SGLang's extra_key) means",
    "weight_version": "SGLang's name for the weights being served",
}

#: reason -> fields that do not change the KV bytes
_IGNORED = {
    "device choice, GPU ids, seeds, watchdogs and process management": """
    base_gpu_id custom_sigquit_handler device gc_threshold gpu_id_step mlx_enable_sampling numa_node random_seed
    sleep_on_idle soft_watchdog_timeout use_ray watchdog_timeout""",
    "prefill/decode/encoder disaggregation moves KV between servers without changing it": """
    decoupled_spec_bind_endpoint decoupled_spec_connect_endpoints decoupled_spec_rank decoupled_spec_role
    disaggregation_bootstrap_port disaggregation_decode_allocation_policy
    disaggregation_decode_enable_offload_kvcache disaggregation_decode_enable_radix_cache
    disaggregation_decode_extra_slots disaggregation_decode_host_receive_threshold
    disaggregation_decode_polling_interval disaggregation_decode_retraction_backup
    disaggregation_enable_kv_checksum disaggregation_ib_device disaggregation_mode disaggregation_transfer_backend
    enable_adaptive_dispatch_to_encoder enable_pd_role_switch enable_pdmux encoder_bootstrap_port encoder_only
    encoder_register_urls encoder_transfer_backend encoder_urls language_model_only language_only
    num_reserved_decode_tokens optimistic_prefill_attempts pdmux_config_path sm_group_num""",
    "collective-communication implementation": """
    boundary_reduction disable_aiter_allreduce_fusion_in_decode disable_aiter_allreduce_fusion_in_prefill
    disable_custom_all_reduce enable_aiter_allreduce_fusion enable_flashinfer_allreduce_fusion
    enable_layerwise_nvtx_marker enable_mscclpp enable_nccl_nvls enable_quant_communications enable_scattered_sconv
    enable_symm_mem enable_torch_symm_mem enforce_disable_flashinfer_allreduce_fusion
    flashinfer_allreduce_fusion_backend pre_warm_nccl""",
    "batch-invariant kernels: numerics within the same weights, not other weights": """
    enable_deterministic_inference rl_on_policy_target""",
    "diffusion-LLM decoding algorithm": """
    dllm_algorithm dllm_algorithm_config dllm_fdfo""",
    "output features (hidden states, logits, watermarking, memory saver) after the KV is written": """
    aux_hidden_state_capture disable_outlines_disk_cache enable_custom_logit_processor
    enable_decoder_swa_bounded_replay enable_draft_weights_cpu_backup enable_encoder_swa_bounded_replay
    enable_fp32_lm_head enable_memory_saver enable_mis enable_return_aux_hidden_states enable_return_hidden_states
    enable_return_indexer_topk enable_return_routed_experts enable_tf32_matmul enable_watermark
    enable_weights_cpu_backup return_aux_hidden_state_layer_ids return_hidden_states_mode sampling_mask_max_tokens
    watermark_config watermark_context_window watermark_default_enabled watermark_enforce_all watermark_key
    watermark_key_b watermark_max_probability watermark_mixing_probability""",
    "CUDA graph and torch.compile capture": """
    cuda_graph_backend_decode cuda_graph_backend_prefill cuda_graph_bs_decode cuda_graph_bs_prefill
    cuda_graph_config cuda_graph_max_bs_decode cuda_graph_max_bs_prefill cuda_graph_max_seq_len_prefill
    cuda_graph_prefill_max_context debug_cuda_graph disable_cuda_graph disable_cuda_graph_padding
    disable_decode_cuda_graph disable_prefill_cuda_graph enable_cudagraph_gc enable_profile_cuda_graph
    enable_torch_compile enable_torch_compile_debug_mode torch_compile_max_bs""",
    "kernel and backend choice: numerics within the same weights, KV dtype and layout are named apart": """
    attention_backend bf16_gemm_backend decode_attention_backend disable_flashinfer_autotune dsa_decode_backend
    dsa_paged_mqa_logits_backend dsa_prefill_backend dsa_topk_backend dsa_triton_union dsv4_attn_backend
    dsv4_prefill_backend enable_amd_monokernel enable_deepseek_v4_fp4_indexer enable_dsa_fused_indexer
    enable_fused_qk_norm_rope enable_lean_attention enable_nvidia_megakernel enable_precise_embedding_interpolation
    flashinfer_autotune_skip_ops flashinfer_mla_disable_ragged fp4_gemm_runner_backend fp8_gemm_runner_backend
    grammar_backend prefill_attention_backend prefill_kv_cache_dequant_dtype sampling_backend
    triton_attention_num_kv_splits triton_attention_reduce_in_fp32 triton_attention_split_tile_size""",
    "Mamba/linear-attention state, whose hybrid pools this backend does not serve": """
    enable_int8_mamba_checkpoint enable_linear_replayssm enable_linear_replayssm_spec
    enable_mamba_cache_stochastic_rounding int8_mamba_ckpt_size linear_attn_backend linear_attn_decode_backend
    linear_attn_prefill_backend linear_attn_verify_backend linear_replayssm_cache_len mamba_backend
    mamba_cache_philox_rounds mamba_max_states_per_path mamba_radix_cache_strategy mamba_ssm_dtype
    mamba_track_interval uses_mamba_radix_cache""",
    "expert placement, dispatch and load balancing of the same expert weights": """
    deepep_config deepep_dispatcher_output_dtype deepep_mode deepep_v2_mode
    disable_flashinfer_cutlass_moe_fp4_allgather disable_shared_experts_fusion elastic_ep_backend
    elastic_ep_scale_timeout enable_elastic_expert_backup enable_eplb enable_fused_moe_sum_all_reduce
    enable_paged_experts enable_w4a4_mxfp4_megamoe enable_waterfill enforce_shared_experts_fusion
    ep_dispatch_algorithm ep_join_mode ep_num_redundant_experts eplb_algorithm
    eplb_min_rebalancing_utilization_threshold eplb_rebalance_layers_per_chunk eplb_rebalance_num_iterations
    expert_balancedness_report_mode expert_distribution_recorder_buffer_size expert_distribution_recorder_mode
    flashinfer_a2a_dispatch_type flashinfer_mxfp4_moe_precision fuseep_mode init_expert_location kt_cpuinfer
    kt_max_deferred_experts_per_token kt_method kt_num_gpu_experts kt_threadpool_count kt_weight_path
    moe_a2a_backend moe_runner_backend mooncake_ib_device paged_experts_num_resident""",
    "where weights live while the same weights run": """
    cpu_offload_gb offload_group_size offload_mode offload_num_in_group offload_prefetch_step ple_offload_backend
    ple_offload_dir ple_offload_embedding""",
    "batch overlap scheduling": """
    enable_single_batch_overlap enable_two_batch_overlap tbo_token_distribution_threshold""",
    "adapter serving limits; a LoRA request's pages are seeded by SGLang's extra_key": """
    enable_lora enable_lora_overlap_loading experts_shared_outer_loras lora_backend lora_drain_wait_threshold
    lora_eviction_policy lora_strict_loading lora_target_modules lora_use_virtual_experts max_loaded_loras
    max_lora_chunk_size max_lora_rank max_loras_per_batch""",
    "cache sizing, eviction and the host layout (stored in the canonical record format)": """
    _radix_eviction_policy_explicitly_set disable_radix_cache enable_flexkv enable_hierarchical_cache
    enable_hisparse enable_linker_mla_dedup enable_lmcache enable_session_radix_cache
    enable_unified_cache_external_linker flexkv_config_file hicache_host_memory_fraction hicache_host_memory_mode
    hicache_io_backend hicache_mem_layout hicache_ratio hicache_size hicache_storage_backend
    hicache_storage_backend_extra_config hicache_storage_prefetch_policy
    hicache_storage_prefetch_retry_max_attempts hicache_storage_prefetch_retry_poll_interval hicache_write_policy
    hisparse_config lmcache_config_file radix_cache_backend radix_eviction_policy radix_eviction_policy_config
    unified_cache_external_linker_backend unified_cache_external_linker_config""",
    "multimodal preprocessing; media content reaches the page hashes as pad token ids": """
    allowed_media_domains disable_fast_image_processor enable_broadcast_mm_inputs_process enable_mm_global_cache
    enable_multimodal enable_prefix_mm_cache image_processor_backend limit_mm_data_per_request
    media_url_max_file_size_mb mm_attention_backend mm_enable_dp_encoder mm_feature_transport
    mm_global_cache_backend mm_io_worker_num mm_preprocess_cache_size_mb mm_process_config mm_processor_worker_num
    trust_mm_content_hashes""",
    "how and from where the same weights load, or startup and ready behaviour": """
    checkpoint_engine_wait_weights_before_ready context_length custom_weight_loader decrypted_config_file
    decrypted_draft_config_file delete_ckpt_after_loading download_dir engine_info_bootstrap_port is_embedding
    model_checksum modelexpress_config modelopt_checkpoint_save_path modelopt_export_path
    remote_instance_weight_loader_backend remote_instance_weight_loader_seed_instance_ip
    remote_instance_weight_loader_seed_instance_service_port remote_instance_weight_loader_send_weights_group_ports
    remote_instance_weight_loader_start_seed_via_transfer_engine startup_weight_load_mode trust_remote_code
    weight_cache_mode weight_cache_socket weight_cache_timeout weight_loader_disable_mmap
    weight_loader_drop_cache_after_load weight_loader_prefetch_checkpoints weight_loader_prefetch_num_threads""",
    "logging, metrics, tracing and debugging": """
    bucket_e2e_request_latency bucket_inter_token_latency bucket_time_to_first_token crash_dump_folder
    debug_tensor_dump_input_file debug_tensor_dump_layers debug_tensor_dump_output_folder decode_log_interval
    enable_forward_pass_metrics enable_metrics enable_metrics_for_all_schedulers enable_mfu_metrics
    enable_request_time_stats_logging enable_trace export_metrics_to_file export_metrics_to_file_dir
    extra_metric_labels forward_hooks forward_pass_metrics_ipc_name forward_pass_metrics_worker_id
    gc_warning_threshold_secs generation_tokens_buckets kv_canary kv_canary_real_data kv_canary_sweep_interval
    kv_events_config load_publish_endpoint load_snapshot_publish_interval log_level log_level_http log_requests
    log_requests_format log_requests_level log_requests_target msprobe_dump_config otlp_service_name
    otlp_traces_endpoint prompt_tokens_buckets show_time_cost smg_http_sidecar_port stat_loggers
    tokenizer_metrics_allowed_custom_labels tokenizer_metrics_custom_labels_header trace_modules
    uvicorn_access_log_exclude_prefixes""",
    "addresses, ports, MoE/expert parallelism and weight sharding outside the attention KV": """
    dcp_comm_backend dcp_replicate_q_proj disable_attn_tp_gather dist_init_addr dist_timeout dwdp_size
    elastic_ep_initial_size enable_attn_tp_input_scattered enable_cp_decode_attn_tp enable_cp_tp_group_sharing
    enable_dense_mlp_attn_tp enable_dp_attention_local_control_broadcast enable_dp_lm_head enable_layernorm_sp
    enable_megamoe_for_layernorm_sp enable_p2p_check enable_shared_experts_attn_tp enable_tp_lm_head_all_to_all
    ep_join_rank_offset ep_size gated_launch_port load_balance_method max_ep_size moe_dense_tp_size moe_dp_size
    nccl_port nnodes node_rank pp_async_batch_depth pp_max_micro_batch_size shared_experts_tp_size""",
    "scheduling and pool sizing decide when tokens run, not their KV": """
    _swa_full_tokens_ratio_explicitly_set abort_on_priority_when_disabled chunked_prefill_size
    default_priority_value disable_chunked_prefix_cache disable_hybrid_swa_memory disable_overlap_schedule
    disable_priority_preemption enable_dynamic_chunking enable_mixed_chunk enable_prefill_delayer
    enable_priority_scheduling mamba_full_memory_ratio max_mamba_cache_size max_prefill_tokens max_queued_requests
    max_running_requests max_total_tokens mem_fraction_static min_free_slots_delay num_continuous_decode_steps
    prefill_decode_interval prefill_decode_interval_min_bs prefill_delayer_forward_passes_buckets
    prefill_delayer_max_delay_ms prefill_delayer_max_delay_passes prefill_delayer_queue_min_ratio
    prefill_delayer_token_usage_low_watermark prefill_delayer_wait_seconds_buckets prefill_max_requests
    prefill_only_disable_kv_cache priority_scheduling_preemption_threshold retraction_policy
    schedule_conservativeness schedule_low_priority_values_first schedule_policy scheduler_recv_interval
    swa_full_tokens_ratio swa_prefix_tails""",
    "API front end, tokenizer and chat templates; the page hashes name the token ids": """
    admin_api_key allow_auto_truncate api_key asr_max_buffer_seconds asr_max_concurrent_sessions batch_notify_size
    chat_template completion_template constrained_json_disable_any_whitespace constrained_json_max_whitespace_cnt
    constrained_json_whitespace_pattern default_chat_template_kwargs detokenizer_worker_num
    disable_tokenizer_batch_decode dynamic_batch_tokenizer_batch_size dynamic_batch_tokenizer_batch_timeout
    enable_cache_report enable_dynamic_batch_tokenizer enable_http2 enable_http_worker_reuseport
    enable_response_store enable_ssl_refresh enable_streaming_session enable_strict_thinking
    enable_tokenizer_batch_encode fastapi_root_path file_storage_path grpc_mode grpc_port
    grpc_response_timeout_secs grpc_worker_threads hf_chat_template_name host http2_initial_connection_window_size
    http2_max_concurrent_streams incremental_streaming_output port preferred_sampling_params reasoning_parser
    return_input_ids return_output_ids sampling_defaults served_model_name sidecar sidecar_args skip_server_warmup
    skip_tokenizer_init smg_grpc_mode ssl_ca_certs ssl_certfile ssl_keyfile ssl_keyfile_password stream_interval
    stream_response_default_include_usage strip_thinking_cache tokenizer_backend tokenizer_mode tokenizer_path
    tokenizer_worker_num tool_call_parser tool_server trust_request_chat_template warmups""",
    "speculative decoding: the draft model's KV never enters the target's host pool": """
    _speculative_draft_quantization_explicitly_set enable_multi_layer_eagle spec_trace_dir
    speculative_accept_threshold_acc speculative_accept_threshold_single speculative_adaptive
    speculative_adaptive_config speculative_algorithm speculative_attention_mode speculative_boundary_reduction
    speculative_dflash_block_size speculative_domino_candidate_pool_size speculative_draft_attention_backend
    speculative_draft_kv_cache_dtype speculative_draft_load_format speculative_draft_model_path
    speculative_draft_model_quantization speculative_draft_model_revision speculative_draft_sink_size
    speculative_draft_window_size speculative_dsa_topk_backend speculative_dspark_align_verify_tokens_to_graph_tier
    speculative_dspark_block_size speculative_dspark_confidence_sts_path speculative_dspark_sps_table_path
    speculative_eagle_topk speculative_enable_w4a4_mxfp4_megamoe speculative_moe_a2a_backend
    speculative_moe_runner_backend speculative_ngram_capacity speculative_ngram_external_corpus_max_tokens
    speculative_ngram_external_corpus_path speculative_ngram_external_sam_budget speculative_ngram_match_type
    speculative_ngram_max_bfs_breadth speculative_ngram_max_trie_depth speculative_ngram_min_bfs_breadth
    speculative_num_draft_tokens speculative_num_steps speculative_token_map speculative_use_block_verification
    speculative_use_rejection_sampling uno_lora_path""",
}

SERVER_ARGS_FIELDS: dict[str, str] = {
    **{name: f"identity: {why}" for name, why in IDENTITY.items()},
    **{name: f"ignored: {why}" for why, names in _IGNORED.items() for name in names.split()},
}
