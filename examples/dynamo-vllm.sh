#!/usr/bin/env bash
# A Dynamo vLLM worker with the tiered KV connector: host memory -> local NVMe -> S3.
#
# Dynamo's worker passes --kv-transfer-config to vLLM, which imports the connector from
# kv_connector_module_path (the same mechanism KVBM's DynamoConnector and LMCache use).
# Every setting can also come from DYN_TIERED_KV_* environment variables or a YAML file
# (DYN_TIERED_KV_CONFIG_FILE, see tiered-kv.yaml); kv_connector_extra_config wins over both.
# kv_load_failure_policy=recompute: a missing or corrupt stored block is recomputed, never an error
# (the connector also switches it on itself when it is left at vLLM's default "fail").
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-8B}
export DYN_TIERED_KV_TENANT_SALT=${DYN_TIERED_KV_TENANT_SALT:?set a per-tenant secret}
export DYN_TIERED_KV_S3_ACCESS_KEY=${DYN_TIERED_KV_S3_ACCESS_KEY:-}
export DYN_TIERED_KV_S3_SECRET_KEY=${DYN_TIERED_KV_S3_SECRET_KEY:-}

python -m dynamo.frontend --http-port 8000 &

python -m dynamo.vllm \
  --model "$MODEL" \
  --kv-transfer-config '{"kv_connector":"TieredKVConnector","kv_connector_module_path":"dynamo_tiered_kv.connectors.vllm","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"host_capacity_bytes":17179869184,"ssd_dir":"/mnt/nvme/dtkv","ssd_capacity_bytes":549755813888,"object_url":"s3://kv-cache/'"${MODEL//\//-}"'","s3_endpoint_url":"http://rgw.storage.svc:7480","admission":"always","metrics_port":9464}}'
