#!/usr/bin/env bash
# The video benchmarks on one H200, one part per 10-minute device call; reports under $OUT.
#
#   bash scripts/gpu_video_bench.sh [PART]
#
#   base (default)  the attention at the video transformers' shapes (bf16) and SVD's (fp16) beside the peers, then
#                   whole transformer forwards: Wan 2.1 1.3B at 480p and 720p, CogVideoX-5B
#   models          Wan 2.1 1.3B at 480p eager and --compile'd; LTX-Video 0.9 (2B) and Mochi 1 (10B) at their
#                   pipelines' default sizes (7,392 and 6,360 + 256 tokens)
#   long            HunyuanVideo (12.8B) at 540p, 129 frames (67,320 + 256 tokens, batch 1); Mochi 1 at 163 frames
#                   (44,520 + 256 tokens)
#   hunyuan-720p    HunyuanVideo at its default 720p, 129 frames (118,800 + 256 tokens, batch 1): SDPA, the default, FA3
#
# Times per forward (SDPA), estimated from Wan 2.1 1.3B's measured 1239 / 4950 ms at 32,760 / 75,600 tokens
# (bench/dit.py's docstring says how): LTX-Video ~0.2 s, Mochi 19 frames ~0.9 s and 163 frames ~9 s, HunyuanVideo
# 540p ~11 s and 720p ~27 s (its SDPA calls carry a text mask; a slower SDPA kernel would add to it).  A row of
# bench.dit takes --iters + 5 forwards; compiling Wan 1.3B is guessed at 1-2 minutes per backend.  The timeouts
# below are those estimates with room, each part's sum under 10 minutes.  Every row has FA3 beside SDPA and the
# default: the peers run HunyuanVideo's key-padding masks on each sample's kept keys, as PASA does.
set -uo pipefail
PART=${1:-base}
source "$(dirname "$0")/device_env.sh"

dit() {  # dit NAME TIMEOUT ARGS...: one bench.dit run into $OUT/NAME, its table printed (its log's end if it failed)
  local name=$1 limit=$2 rc
  shift 2
  timeout "$limit" python -m bench.dit "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc $rc"
  if [ "$rc" -eq 0 ]; then grep "^|" "$OUT/$name/dit.md" | cut -c1-220; else tail -n 8 "$OUT/$name.log"; fi
}

case $PART in
  base)
    M=sdpa-cudnn,sdpa-flash,fa3-bf16,fa3-fp8,sageattn,exact-hybrid
    timeout 150 python -m bench.attention --shapes dit --dtype bfloat16 --methods $M --out "$OUT/dit_bf16" \
      > "$OUT/dit_bf16.log" 2>&1; echo "attention dit bf16 rc $?"; sed -n '/^| shape/,/^$/p' "$OUT/dit_bf16/attention.md"
    timeout 100 python -m bench.attention --shapes svd-spatial --frames 25 --methods $M --out "$OUT/svd_fp16" \
      > "$OUT/svd_fp16.log" 2>&1; echo "attention svd fp16 rc $?"; sed -n '/^| shape/,/^$/p' "$OUT/svd_fp16/attention.md"
    dit wan 170 --model wan2.1-1.3b --resolution 480p 720p --backends sdpa pasa fa3 --iters 3
    dit cog 110 --model cogvideox-5b --backends sdpa pasa fa3 --iters 3
    ;;
  models)
    dit wan_compile 330 --model wan2.1-1.3b --resolution 480p --backends sdpa pasa fa3 --compile --iters 3
    dit ltx 80 --model ltx-video --backends sdpa pasa fa3 --iters 3
    dit mochi 120 --model mochi-1 --resolution 480x848x19 --backends sdpa pasa fa3 --iters 3
    ;;
  long)
    dit hunyuan_540p 300 --model hunyuan-video --resolution 540p --backends sdpa pasa fa3 --iters 2
    dit mochi_163f 230 --model mochi-1 --resolution 480x848x163 --backends sdpa pasa fa3 --iters 2
    ;;
  hunyuan-720p)
    dit hunyuan_720p 550 --model hunyuan-video --resolution 720p --backends sdpa pasa fa3 --iters 1
    ;;
  *)
    echo "gpu_video_bench.sh: unknown PART=$PART; expected base, models, long or hunyuan-720p" >&2
    exit 2
    ;;
esac
