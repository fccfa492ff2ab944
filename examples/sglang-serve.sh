#!/usr/bin/env bash
# SGLang (0.5.23, the version Dynamo 1.7 pins) with dynamo-tiered-kv as HiCache's L3 storage:
# `--hicache-storage-backend dynamic` loads TieredHiCacheStorage; "interface_v1": 1 selects the
# zero-copy page interface (the only one it serves). Every other key of the extra config is a
# dynamo-tiered-kv setting (TieredKVConfig); DYN_TIERED_KV_* env and DYN_TIERED_KV_CONFIG_FILE work too.
#
#   bash examples/sglang-serve.sh            # plain sglang.launch_server
#   bash examples/sglang-serve.sh --dynamo   # the same flags on a Dynamo SGLang worker (python -m dynamo.sglang)
#
# page_first_direct (SGLang switches to its direct I/O backend for it) and layer_first take the
# backend's compiled page copy; page_first, SGLang's default, works too (`dtkv bench sglang`).
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-8B}
DATA=${DATA:-/var/lib/dtkv}
ENTRY=(python -m sglang.launch_server)
[ "${1:-}" = --dynamo ] && ENTRY=(python -m dynamo.sglang)

"${ENTRY[@]}" --model-path "$MODEL" \
  --enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first_direct \
  --hicache-write-policy write_through --hicache-storage-prefetch-policy timeout \
  --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config '{"backend_name":"dynamo_tiered_kv","module_path":"dynamo_tiered_kv.connectors.sglang","class_name":"TieredHiCacheStorage","interface_v1":1,"host_capacity_bytes":8589934592,"ssd_dir":"'"$DATA"'/ssd","object_url":"file://'"$DATA"'/objects","metrics_port":9464}'
