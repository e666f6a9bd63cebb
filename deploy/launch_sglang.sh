#!/usr/bin/env bash
# Example: one SGLang instance with tierstore as L3 (config in deploy/tierstore.json).
# Leave out "redis_url" in the JSON to use the embedded Redis under the first path instead.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a model path or name}
exec python -m sglang.launch_server --model-path "$MODEL" \
  --enable-hierarchical-cache --hicache-ratio 2 \
  --hicache-write-policy write_through_selective \
  --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config "@$(dirname "$0")/tierstore.json" \
  --enable-cache-report "$@"
