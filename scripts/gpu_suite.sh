#!/usr/bin/env bash
# The GPU test suite (every test marked gpu under tests/) in SHARDS parallel pytest processes on one
# machine.  A cold machine spends most of the suite compiling and autotuning Triton kernels, which is
# CPU work, so several processes sharing the one GPU finish sooner than one.
#
#     OUT=out/gpu_suite SHARDS=4 bash scripts/gpu_suite.sh [extra pytest arguments, e.g. -k temporal]
#     SUITE_SECONDS=420 bash scripts/gpu_suite.sh      # under a time limit: no test starts after 420 s
#     SHARDS=14 SHARD_RANGE=0-6 bash scripts/gpu_suite.sh   # shards 0..6 of 14 only; SHARD_RANGE=7-13 the rest
#     SHARDS=14 AT_ONCE=7 bash scripts/gpu_suite.sh          # 14 shards, at most 7 running at a time
#     TESTS=tests/test_int8.py bash scripts/gpu_suite.sh     # the gpu tests of these files or folders only
#
# SHARD_RANGE (first-last, default all) runs part of the split, so that a suite longer than one call's time limit
# runs whole in two calls of half the shards each, the same SHARDS in both (the split depends on it alone).
# AT_ONCE (default: all) caps the shards running at a time: the next one starts when one ends, so a split made for
# a larger GPU's memory (14 shards of an H200) runs whole in one call on a smaller one (7 at a time on an H100),
# under one SUITE_SECONDS.
#
# SHARDS unset: one shard per 10 GiB of the first GPU's memory, at most one per CPU (14 on an H200, 7 on an H100:
# a shard's tests peak near 10-16 GiB; 10 shards ran an H100's 80 GiB out of memory in 48 tests, 7 in 2 of 678,
# which the memory rerun below takes), or 4 without nvidia-smi.
#
# Runs on a GPU machine after `pip install -e .` (docs/DEVELOPING.md); where that cannot fetch, carried wheels
# (WHEELS, default .whl: diffusers, optionally the peers, whose tests skip without them) are installed first
# (device_env.sh, which also stops with one line if the package or what it needs does not import).
# TESTS (default tests) names the files or folders whose gpu-marked tests are collected: collecting all of tests/
# imports every test module (23 s on a 2-core machine), one file about 5 s.
# The test ids are split round-robin, so every shard gets a mix of shapes and variants, and shard i starts
# i/SHARDS of the way into its list: at any time the shards run different test files, so the memory-heavy
# parametrisations of one test (SVD's 9216 keys, float64 goldens) no longer all run at once in every shard, as they
# did when the shards kept the same order (the out-of-memory failures of 2026-12-06), and a kernel compiled by one
# shard is in Triton's cache when the next needs it (not yet timed against the plain split).  Each shard runs
# under scripts/gpu_shard.py: a test that loses its process's CUDA context (an illegal address) is one
# failure, and the shard's remaining tests rerun in a new process.  Writes, per shard,
# $OUT/gpu_suite_<i>.log (-v: a line per test, so a shard cut short by a time limit still says what
# passed; the slowest tests of each run; its last line the shard's counts) and
# $OUT/ratios_<i>/gpu_error_ratios.md (the kernel / reference error ratios), and prints each shard's summary line.  Tests that ran out of GPU memory beside the
# other shards then rerun alone in one process (scripts/gpu_memory_retry.py, log $OUT/gpu_suite_memory.log, one
# line printed); the exit status is non-zero if any other test failed or a rerun one failed again.
set -uo pipefail

OUT=${OUT:-$PWD/out/gpu_suite}
if [[ -n "${SUITE_SECONDS:-}" ]]; then  # shards start no test past this; they write their summaries and stop
  export PASA_SUITE_DEADLINE=$(( $(date +%s) + SUITE_SECONDS ))
fi
if [[ -z "${SHARDS:-}" ]]; then
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | head -1)
  if [[ "$mib" =~ ^[0-9]+$ ]]; then
    SHARDS=$(( mib / 10240 ))
    (( SHARDS > $(nproc) )) && SHARDS=$(nproc)
    (( SHARDS < 1 )) && SHARDS=1
  else
    SHARDS=4
  fi
fi
if [[ -n "${AT_ONCE:-}" && ! "${AT_ONCE}" =~ ^[1-9][0-9]*$ ]]; then
  echo "$0: AT_ONCE=$AT_ONCE must be a whole number of shards, at least 1" >&2
  exit 2
fi
first=0
last=$(( SHARDS - 1 ))
if [[ -n "${SHARD_RANGE:-}" ]]; then
  if [[ ! "$SHARD_RANGE" =~ ^([0-9]+)-([0-9]+)$ ]] \
     || (( BASH_REMATCH[1] > BASH_REMATCH[2] || BASH_REMATCH[2] >= SHARDS )); then
    echo "$0: SHARD_RANGE=$SHARD_RANGE must be FIRST-LAST with 0 <= FIRST <= LAST < SHARDS=$SHARDS" >&2
    exit 2
  fi
  first=${BASH_REMATCH[1]}
  last=${BASH_REMATCH[2]}
fi
read -ra paths <<< "${TESTS:-tests}"
for path in "${paths[@]}"; do
  if [[ ! -e "$path" ]]; then
    echo "$0: TESTS names $path, which is not a file or folder here (run from the repository root)" >&2
    exit 2
  fi
done
. "$(dirname "$0")/device_env.sh"  # after the arguments' checks: a refusal costs no import
mkdir -p "$OUT"
ids="$OUT/test_ids.txt"
python -m pytest "${paths[@]}" -m gpu --collect-only -q -p no:cacheprovider "$@" | grep '::' > "$ids"
running=""
(( first > 0 || last < SHARDS - 1 )) && running=", running shards $first-$last"
[[ -n "${AT_ONCE:-}" ]] && running+=", at most $AT_ONCE at once"
echo "$(wc -l < "$ids") tests in $SHARDS shards$running"

pids=()
for ((i = first; i <= last; i++)); do
  while [[ -n "${AT_ONCE:-}" ]] && (( $(jobs -rp | wc -l) >= AT_ONCE )); do
    sleep 1
  done
  # round-robin, then shard i starts i/SHARDS of the way into its list (wrapping round)
  awk -v n="$SHARDS" -v i="$i" 'NR % n == i { a[c++] = $0 }
      END { s = int(c * i / n); for (j = 0; j < c; j++) print a[(j + s) % c] }' "$ids" > "$OUT/shard_$i.txt"
  if [[ -s "$OUT/shard_$i.txt" ]]; then
    rm -f "$OUT/gpu_suite_$i.log"
    PASA_REPORT_DIR="$OUT/ratios_$i" python scripts/gpu_shard.py "$OUT/shard_$i.txt" "$OUT/gpu_suite_$i.log" "$@" &
    pids+=($!)
  fi
done

status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
for ((i = first; i <= last; i++)); do
  [[ -f "$OUT/gpu_suite_$i.log" ]] && echo "shard $i: $(tail -1 "$OUT/gpu_suite_$i.log")"
done
if (( status != 0 )); then
  python scripts/gpu_memory_retry.py "$OUT" "$@"
  status=$?
fi
exit $status
