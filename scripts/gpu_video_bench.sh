#!/usr/bin/env bash
# One device call: the attention at the video transformers' shapes (bf16) and SVD's (fp16) beside the peers,
# then whole transformer forwards (Wan 2.1 1.3B at 480p and 720p, CogVideoX-5B).  Reports under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
python -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null
export PYTHONPATH=/tmp/site
M=sdpa-cudnn,sdpa-flash,fa3-bf16,fa3-fp8,sageattn,exact-hybrid
timeout 150 python -m bench.attention --shapes dit --dtype bfloat16 --methods $M --out "$OUT/dit_bf16" \
  > "$OUT/dit_bf16.log" 2>&1; echo "attention dit bf16 rc $?"; sed -n '/^| shape/,/^$/p' "$OUT/dit_bf16/attention.md"
timeout 100 python -m bench.attention --shapes svd-spatial --frames 25 --methods $M --out "$OUT/svd_fp16" \
  > "$OUT/svd_fp16.log" 2>&1; echo "attention svd fp16 rc $?"; sed -n '/^| shape/,/^$/p' "$OUT/svd_fp16/attention.md"
timeout 170 python -m bench.dit --model wan2.1-1.3b --resolution 480p 720p --backends sdpa pasa fa3 --iters 3 \
  --out "$OUT/wan" > "$OUT/wan.log" 2>&1; echo "wan rc $?"; grep "^|" "$OUT/wan/dit.md" | cut -c1-200
timeout 110 python -m bench.dit --model cogvideox-5b --backends sdpa pasa fa3 --iters 3 \
  --out "$OUT/cog" > "$OUT/cog.log" 2>&1; echo "cog rc $?"; grep "^|" "$OUT/cog/dit.md" | cut -c1-200
