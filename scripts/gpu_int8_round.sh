#!/usr/bin/env bash
# One device call for the 8-bit path: its GPU tests, the fallback's cost, then accuracy beside the peers.
#   OUT=$OUT bash scripts/gpu_int8_round.sh      (carry .whl)
set -u
. scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/test_int8.py -p no:cacheprovider 2>&1 | tail -4
timeout 150 python3 -m bench.int8_fallback --dtype bfloat16 --out "$OUT/fb_dit" > "$OUT/fb_dit.log" 2>&1; echo "fallback dit rc=$?"
timeout 90 python3 -m bench.int8_fallback --shapes svd-spatial --frames 25 --out "$OUT/fb_svd" > "$OUT/fb_svd.log" 2>&1; echo "fallback svd rc=$?"
timeout 260 python3 -m bench.accuracy --out "$OUT/acc16" > "$OUT/acc16.log" 2>&1; echo "accuracy fp16 rc=$?"
