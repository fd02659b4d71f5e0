#!/usr/bin/env bash
# One device call: the Gluon kernel's configs with and without the consumers' ping-pong schedule
# (bench.hopper: correctness of every config, then time), bf16 at head dim 128 and fp16 at 64.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
summary() { grep -A12 "## Correctness" "$1" | grep "^| B" ; grep "alone\|sdpa-cudnn\|fa3\|sageattn" "$1" | cut -d"|" -f3,4,5,7; }
timeout 220 python -m bench.hopper --dtype bfloat16 --shapes 2,12,8192,128 1,2,32760,128 --budget-s 120 \
  --configs 128,2,0,2 128,2,0,2,1 128,2,1,2,1 64,3,1,2,1 --out "$OUT/wide" > "$OUT/wide.log" 2>&1; echo "wide rc $?"
summary "$OUT/wide/hopper.md"
timeout 200 python -m bench.hopper --shapes 50,5,9216,64 50,20,576,64 --budget-s 80 \
  --configs 128,3,0,3 128,3,0,3,1 64,4,1,3 64,4,1,3,1 128,2,1,3,1 --out "$OUT/d64" > "$OUT/d64.log" 2>&1; echo "d64 rc $?"
summary "$OUT/d64/hopper.md"
