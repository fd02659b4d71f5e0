#!/usr/bin/env bash
# One device call: install the carried wheels, then the Gluon kernel's configs at head dim 128 and in bf16
# (bench.hopper: correctness of every config, then time) and their GPU tests.  Logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
summary() { grep -A12 "## Correctness" "$1" | grep "^| B" ; grep "alone\|sdpa-cudnn\|fa3\|sageattn\|exact-hybrid |" "$1" | cut -d"|" -f3,4,5,7; }
timeout 200 python -m bench.hopper --dtype bfloat16 --shapes 2,12,8192,128 --budget-s 100 \
  --configs 128,2,1,2 128,2,0,2 64,2,1,3 --out "$OUT/wide" > "$OUT/wide.log" 2>&1; echo "wide rc $?"
summary "$OUT/wide/hopper.md"
timeout 150 python -m bench.hopper --dtype bfloat16 --shapes 50,5,9216,64 50,20,576,64 --budget-s 60 \
  --configs 128,3,0,3 128,2,0,3 64,4,1,3 --out "$OUT/bf16" > "$OUT/bf16.log" 2>&1; echo "bf16 rc $?"
summary "$OUT/bf16/hopper.md"
timeout 200 python -m pytest tests/test_kernel_gpu.py -m gpu -q -k "gluon_dtypes" -p no:cacheprovider \
  > "$OUT/pytest.log" 2>&1; echo "pytest rc $?"; grep -E "FAILED|passed|failed" "$OUT/pytest.log" | tail -8
