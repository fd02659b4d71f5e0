#!/usr/bin/env bash
# The same `pasa compare` on the full-size random-weight SVD on 1 GPU and on 2 GPUs through torchrun:
# checks that the merged 2-GPU records equal the 1-GPU ones (every field but time and rank), and
# prints the wall times and a short table (also in $OUT/summary.md); exits non-zero when the PSNRs differ.
#
# On a machine with 2 GPUs, from the repository root:
#
#     OUT=out/multi_gpu PASA_WHEELS=.whl bash scripts/compare_multi_gpu.sh
#
# PASA_WHEELS (optional): a folder of wheels the machine lacks (diffusers, ...), installed under $WORK
# first (a pasa_diffusers wheel in it is skipped: this checkout is what runs).
#
# Settings (environment, defaults in brackets): H [576], W [1024], FRAMES [14], STEPS [4],
# IMAGES [builtin:rocket,builtin:coffee], SEEDS [0-1] (so 4 samples), BACKENDS [pasa,sdpa],
# MODEL [svd-xt-random: SVD-XT's full-size pipeline with random weights, built on each GPU], DEVICE [cuda],
# WORK [/tmp/compare-multi-gpu, for the installs].  DEVICE=cpu MODEL=tiny-resonant H=32 W=32 tries the
# script on a CPU (gloo).  Outputs: $OUT/one and $OUT/two (run folders: report.md, report.json,
# samples.jsonl, plots), $OUT/*.log, $OUT/summary.md.
set -euo pipefail

OUT=${OUT:-$PWD/out/compare_multi_gpu}
H=${H:-576}
W=${W:-1024}
FRAMES=${FRAMES:-14}
STEPS=${STEPS:-4}
IMAGES=${IMAGES:-builtin:rocket,builtin:coffee}
SEEDS=${SEEDS:-0-1}
BACKENDS=${BACKENDS:-pasa,sdpa}
MODEL=${MODEL:-svd-xt-random}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"

# Dependencies missing on the machine (from $PASA_WHEELS), and this package with its `pasa` console script.
# Everything goes under $WORK, and this checkout comes first on the path (before any pasa_diffusers wheel).
WORK=${WORK:-/tmp/compare-multi-gpu}
SITE=$WORK/site
PKG=$WORK/pkg
rm -rf "$WORK" && mkdir -p "$SITE" "$PKG/bin"
if [ -n "${PASA_WHEELS:-}" ]; then
    find "$PASA_WHEELS" -type f -name '*.whl' ! -name 'pasa_diffusers-*' -exec \
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" {} +
fi
cp -r pasa_diffusers "$PKG/pasa_diffusers"
printf '#!%s\nimport sys\nfrom pasa_diffusers.cli import main\nsys.exit(main())\n' "$(command -v python3)" > "$PKG/bin/pasa"
chmod +x "$PKG/bin/pasa"
export PYTHONPATH=$PKG:$SITE PATH=$PKG/bin:$PATH

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1 || true

ARGS=(compare --model "$MODEL" --device "$DEVICE" --images "$IMAGES" --seeds "$SEEDS" --backends "$BACKENDS"
      --frames "$FRAMES" --steps "$STEPS" --height "$H" --width "$W" --worst 1)
rm -rf "$OUT/one" "$OUT/two"

t0=$(date +%s.%N)
CUDA_VISIBLE_DEVICES=0 pasa "${ARGS[@]}" --out "$OUT/one" > "$OUT/one.log" 2> "$OUT/one.err"
t1=$(date +%s.%N)
CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2 --no-python pasa "${ARGS[@]}" --out "$OUT/two" \
    > "$OUT/two.log" 2> "$OUT/two.err"
t2=$(date +%s.%N)

cd /tmp  # the check below must not import the repository's unmapped pasa_diffusers/
python3 - "$OUT" "$t0" "$t1" "$t2" <<'EOF' | tee "$OUT/summary.md"
import json, math, sys
from pathlib import Path

out, (t0, t1, t2) = Path(sys.argv[1]), map(float, sys.argv[2:5])
one_s, two_s = t1 - t0, t2 - t1
def records(run):
    return [json.loads(line) for line in (out / run / "samples.jsonl").read_text().splitlines()]
def number(v):
    return math.inf if v == "inf" else math.nan if v is None else float(v)
one, two = records("one"), records("two")
key = lambda r: (r["image"], r["seed"], r["backend"])
assert [key(r) for r in one] == [key(r) for r in two], "the two runs hold different samples"
same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))
worst = {m: max((abs(number(a[m]) - number(b[m])) for a, b in zip(one, two)
                 if not same(number(a[m]), number(b[m]))), default=0.0) for m in ("psnr", "ssim", "temporal_psnr")}
timing = ("seconds", "rank")
identical = all({k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
                for a, b in zip(one, two))
reports = {run: json.loads((out / run / "report.json").read_text()) for run in ("one", "two")}
settings = reports["one"]["settings"]
samples = reports["one"]["samples"]
gpu = reports["one"]["versions"].get("gpu", settings["device"])
print(f"## pasa compare on {reports['one']['model']}: 1 GPU vs 2 GPUs (torchrun)\n")
print(f"{samples} samples, {settings['num_frames']} frames of {settings['height']}x{settings['width']}, "
      f"{settings['num_inference_steps']} steps, backends {', '.join(settings['backends'])} + fp32 reference; "
      f"{gpu}; torch {reports['one']['versions']['torch']}.\n")
print("| run | GPUs | wall s (whole command) | speedup |\n|---|---:|---:|---:|")
print(f"| pasa compare | 1 | {one_s:.1f} | 1.00 |")
print(f"| torchrun --nproc-per-node 2 pasa compare | 2 | {two_s:.1f} | {one_s / two_s:.2f} |\n")
print("| backend | PSNR dB, 1 GPU | PSNR dB, 2 GPUs | s per video, 1 GPU | s per video, 2 GPUs |\n|---|---:|---:|---:|---:|")
for name in settings["backends"]:
    cells = []
    for run in ("one", "two"):
        agg = reports[run]["aggregate"][name]
        cells.append(agg["psnr"]["mean"])
    secs = [reports[run]["aggregate"][name]["seconds"]["mean"] for run in ("one", "two")]
    fmt = lambda v: v if isinstance(v, str) else "n/a" if v is None else f"{v:.2f}"
    print(f"| {name} | {fmt(cells[0])} | {fmt(cells[1])} | {secs[0]:.2f} | {secs[1]:.2f} |")
print(f"\nmerged 2-GPU records equal the 1-GPU ones: {'yes, every field but time and rank' if identical else 'NO'}; "
      f"largest differences: PSNR {worst['psnr']:.3g} dB, SSIM {worst['ssim']:.3g}, "
      f"temporal PSNR {worst['temporal_psnr']:.3g} dB")
print(f"ranks that generated samples in the 2-GPU run: {sorted({r['rank'] for r in two})}")
sys.exit(0 if worst["psnr"] <= 1e-3 else 1)
EOF
