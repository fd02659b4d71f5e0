#!/usr/bin/env bash
# One device call after a kernel change: the attention beside cuDNN and the peers (the video DiTs' shapes in bf16,
# SVD-XT's at 25 frames in fp16; the default and pasa-int8), then the whole GPU suite in 12 shards.
#   OUT=$OUT bash scripts/gpu_kernel_round.sh      (carry .whl)
set -u
. scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
methods=sdpa,peers,exact-hybrid,exact-int8
timeout 140 python3 -m bench.attention --shapes dit --dtype bfloat16 --methods $methods --out "$OUT/dit" \
  > "$OUT/dit.log" 2>&1; echo "attention dit rc=$?"
timeout 100 python3 -m bench.attention --shapes svd --frames 25 --methods $methods --out "$OUT/svd" \
  > "$OUT/svd.log" 2>&1; echo "attention svd rc=$?"
OUT=$OUT/suite SHARDS=12 timeout 330 bash scripts/gpu_suite.sh; echo "suite rc=$?"
