#!/usr/bin/env bash
# Disaggregated serving with Dynamo on one node with 2 GPUs: a prefill worker and a decode worker,
# each with vLLM's MultiConnector over TieredKVConnector and NixlConnector, behind Dynamo's
# frontend with the KV router. (Dynamo's PdConnector cannot be used: it accepts only KVBM, LMCache
# or FlexKV as its first connector; MultiConnector is a wrapper Dynamo's prefill handler knows.)
#
# MultiConnector loads from the first connector that reports a hit and saves through all of them:
# - prefill: [TieredKVConnector, NixlConnector]. A prefix stored on host, SSD or S3 is loaded
#   instead of recomputed; NIXL then hands the full KV to the decode worker.
# - decode:  [NixlConnector, TieredKVConnector]. The KV that prefill sends over NIXL comes first;
#   ours stores what decode adds, so the next turn of a conversation finds it on any worker.
# kv_load_failure_policy=recompute sits on the MultiConnector: vLLM's scheduler reads it there.
# Each worker gets its own SSD directory and metrics port; the object tier is shared (a file://
# directory here, s3://bucket/prefix across nodes). PYTHONHASHSEED=0 keeps block hashes equal
# across processes, as the router needs.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-8B}
DATA=${DATA:-/var/lib/dtkv}
export DYN_TIERED_KV_TENANT_SALT=${DYN_TIERED_KV_TENANT_SALT:?set a per-tenant secret}
export PYTHONHASHSEED=0

# KV router with per-tier prefix-hit weights (Dynamo's defaults: host 0.75, disk/external 0.25).
# The connector's KV events name the tier holding each block: CPU_PINNED (host), DISK (SSD),
# EXTERNAL (object tier), so these weights apply to blocks only dynamo-tiered-kv holds.
python -m dynamo.frontend --http-port 8000 --router-mode kv \
  --router-host-cache-hit-weight 0.75 --router-disk-cache-hit-weight 0.5 &

CUDA_VISIBLE_DEVICES=0 python -m dynamo.vllm --model "$MODEL" --disaggregation-mode prefill \
  --kv-events-config '{"publisher":"zmq","topic":"kv-events","endpoint":"tcp://*:5557","enable_kv_cache_events":true}' \
  --kv-transfer-config '{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"connectors":[{"kv_connector":"TieredKVConnector","kv_connector_module_path":"dynamo_tiered_kv.connectors.vllm","kv_role":"kv_both","kv_connector_extra_config":{"host_capacity_bytes":17179869184,"ssd_dir":"'"$DATA"'/prefill-ssd","object_url":"file://'"$DATA"'/objects","metrics_port":9464}},{"kv_connector":"NixlConnector","kv_role":"kv_both"}]}}' &

CUDA_VISIBLE_DEVICES=1 python -m dynamo.vllm --model "$MODEL" --disaggregation-mode decode \
  --kv-events-config '{"publisher":"zmq","topic":"kv-events","endpoint":"tcp://*:5558","enable_kv_cache_events":true}' \
  --kv-transfer-config '{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"connectors":[{"kv_connector":"NixlConnector","kv_role":"kv_both"},{"kv_connector":"TieredKVConnector","kv_connector_module_path":"dynamo_tiered_kv.connectors.vllm","kv_role":"kv_both","kv_connector_extra_config":{"host_capacity_bytes":17179869184,"ssd_dir":"'"$DATA"'/decode-ssd","object_url":"file://'"$DATA"'/objects","metrics_port":9474}}]}}'
