#!/usr/bin/env bash
# Plain `vllm serve` with the tiered KV connector (no Dynamo). Same JSON as for dynamo.vllm.
#
# Embedded defaults for a single machine: a local SSD directory and a local-directory object
# tier (file://), no S3 server needed. Point object_url at s3://bucket/prefix to share blocks
# between nodes. Metrics: http://<host>:9464/metrics (dtkv_tier_hits_total, dtkv_tier_used_bytes,
# dtkv_offload_dropped_total, dtkv_checksum_failures_total, ...).
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-8B}
DATA=${DATA:-/var/lib/dtkv}

vllm serve "$MODEL" \
  --kv-transfer-config '{"kv_connector":"TieredKVConnector","kv_connector_module_path":"dynamo_tiered_kv.connectors.vllm","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"host_capacity_bytes":8589934592,"ssd_dir":"'"$DATA"'/ssd","object_url":"file://'"$DATA"'/objects","metrics_port":9464}}'
