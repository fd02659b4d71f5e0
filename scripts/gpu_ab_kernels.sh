#!/usr/bin/env bash
# One device call: the Gluon kernels of this tree against the ones saved in ab_old/ (same machine, same run):
# bench.attention at the video DiTs' shapes in bf16, cuDNN and the peers beside them.
#   mkdir ab_old && for f in hopper hopper_int8; do git show REV:pasa_diffusers/kernels/$f.py > ab_old/$f.py; done
#   OUT=$OUT bash scripts/gpu_ab_kernels.sh   (carry .whl; ab_old/ stays untracked so the device gets it; delete it after)
set -u
. scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
K=pasa_diffusers/kernels
timeout 200 python3 -m bench.attention --shapes dit --dtype bfloat16 \
  --methods sdpa-cudnn,fa3-bf16,fa3-fp8,sageattn,exact-hybrid,exact-int8 --out "$OUT/new" > "$OUT/new.log" 2>&1
echo "new rc=$?"
mkdir -p /tmp/ab_new && cp $K/hopper.py $K/hopper_int8.py /tmp/ab_new/ && cp ab_old/hopper.py ab_old/hopper_int8.py $K/
timeout 150 python3 -m bench.attention --shapes dit --dtype bfloat16 --methods sdpa-cudnn,exact-hybrid,exact-int8 \
  --out "$OUT/old" > "$OUT/old.log" 2>&1
echo "old rc=$?"
cp /tmp/ab_new/hopper.py /tmp/ab_new/hopper_int8.py $K/
