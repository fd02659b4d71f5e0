#!/usr/bin/env bash
# One device call for the Gluon int8 kernel: its GPU tests, then its speed and the pre-pass's alone beside
# the portable kernel, cuDNN and the peers at the video transformers' and SVD's shapes.
#   OUT=$OUT bash scripts/gpu_int8_gluon.sh      (carry .whl; TESTS=-k expression, BENCH_KERNELS=gluon,portable)
set -u
. scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 260 python3 -m pytest -q -m gpu tests/test_int8.py -p no:cacheprovider -rf -k "${TESTS:-gpu}" 2>&1 | tail -15
timeout 160 python3 -m bench.int8_fallback --dtype bfloat16 --kernels "${BENCH_KERNELS:-gluon,portable}" --prepass \
  --out "$OUT/gl_dit" > "$OUT/gl_dit.log" 2>&1; echo "gluon dit rc=$?"
timeout 100 python3 -m bench.int8_fallback --shapes svd-spatial --frames 25 --kernels "${BENCH_KERNELS:-gluon,portable}" \
  --prepass --out "$OUT/gl_svd" > "$OUT/gl_svd.log" 2>&1; echo "gluon svd rc=$?"
