"""Launch configurations of the attention kernel: autotune pools, their pruning and the tuned-result cache.

PASA's ``BLOCK_N`` is not tuned: it is the shift block (``rules.SHIFT_BLOCK``), which changes the
result (and the beta fixed point is solved for n = 128); nor is the exact shift's when it centres its
one key block inside the loop.  The autotuner picks ``BLOCK_M``, warps and stages.  Plain
FlashAttention also tunes ``BLOCK_N``, and so does the exact shift with keys centred by its pre-pass:
its tiles divide the centre block (each tile reads its block's centre), which does not change the
math, only the order of the online softmax's rescalings (a 128-key tile takes 250 registers per thread
where a 64-key tile takes 166, compiled for sm_90; on the H200, 2026-12-01: 0.65x -> 0.76x cuDNN at
576 keys, 9216 keys unchanged within the spread of runs).  Configs whose tiles do not fit the 227 KB
of shared memory of an sm_90 SM are pruned before compiling (head dims above 128); the single-stage
fallbacks serve head dim 256.  "short" configs serve at most 32 query rows
(SVD's temporal attention, N = 14 or 25), where 128-row tiles would be mostly padding.

Tuned on the H200 (triton 3.6, fp16, head dim 64; bench/bench_attention.py, 2026-11-29), winners:
  spatial (2F, 5, 9216) and (2F, 10, 2304): PASA and exact BLOCK_M 64 / 4 warps / 3 stages; plain FA
    BLOCK_M 128 (half) or 64-128 (hybrid), BLOCK_N 64, 4 warps, 3 stages;
  spatial 576 and 144 tokens: BLOCK_M 64 (BLOCK_N 64 for FA), 4 warps, 3 stages;
  temporal (F = 14, 25 frames): FA BLOCK_M 16 / 32 with BLOCK_N 32; PASA BLOCK_M 64 (half) or 16-64
    (hybrid), 2 stages;  the paper's (1, 28, 1407, 128): BLOCK_M 128, 8 warps, 3 stages.
  The short pool gained one- and two-warp configs on 2026-11-30: a 16-32 x 64 tile in one warp keeps
  every reduction (the exact shift's centre over the keys, the row maxima) inside the warp; measured at
  (18432, 5, 25, 64): exact hybrid 2.06 ms with 4 warps -> 0.66 ms with one, PASA half 0.74 -> 0.42 ms
  (bench/README.md, "temporal configs").

The packed kernel (``packed_fwd.py``: the exact shift on short one-block sequences) has its own
pool: sequences per program and warps, pruned to the fewest warps whose tiles fit the registers.

Autotuning results persist across processes (``cache_results=True``): Triton stores each tuning
key's timings in its cache directory (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), keyed by
the Triton version, the GPU target (e.g. ``cuda:90``), the kernel source, the key and the config
pool, so a process that meets a shape bucket another process already tuned on this machine loads
the winner instead of benchmarking every config again.
"""
from __future__ import annotations

import triton

__all__ = ["AUTOTUNE_KEY", "INTERPRET_CONFIG", "PACKED_INTERPRET_CONFIG", "SMEM_LIMIT", "autotuned", "autotuned_packed",
           "bucket", "pow2_tile"]

SMEM_LIMIT = 232448
"""Bytes of shared memory one block may use on sm_90."""

SMALL_TILE = 64
"""The largest key-tile extent (keys and head dim) a config of fewer than 4 warps may take."""

AUTOTUNE_KEY = ["HEAD_DIM", "NQ_BUCKET", "NK_BUCKET", "HALF_STATE", "SHIFT", "SHIFT_IN_LOOP", "ONE_BLOCK",
                "CENTRE_BLOCK", "BLOCK_N"]
"""The kernel arguments a tuned config is chosen by (the tiled pool tunes BLOCK_N, so it drops the last one)."""

INTERPRET_CONFIG = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 1}
"""The interpreter's fixed configuration (plus BLOCK_N: the shift block, or 64 for plain FA), which a
``config`` given to ``pasa_forward`` overrides."""


def _configs(entries, with_block_n: bool) -> list[triton.Config]:
    if with_block_n:
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in entries]
    return [triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s) for bm, w, s in entries]


# (BLOCK_M, [BLOCK_N,] num_warps, num_stages) per pool: "long" query sequences, "short" ones (at most
# 32 rows), "fallback" for head dim 256, whose tiles fit shared memory only single-stage.
_SHIFT_CONFIGS = {
    "long": _configs([(128, 8, 3), (128, 8, 2), (64, 4, 3)], False),
    "short": _configs([(32, 1, 2), (16, 1, 2), (32, 2, 2), (64, 4, 2)], False),
    "fallback": _configs([(64, 4, 1), (64, 8, 1)], False),
}
_TILED_CONFIGS = {
    "long": _configs([(128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)], True),
    "short": _configs([(32, 32, 1, 2), (16, 32, 1, 2), (32, 32, 2, 2), (64, 64, 4, 2)], True),
    "fallback": _configs([(64, 64, 4, 2), (64, 64, 8, 2)], True),
}


def _smem_bytes(cfg: triton.Config, block_n: int, block_d: int) -> int:
    """Shared memory of a config as Triton 3.x lays it out on sm_90: q once, k and v per stage."""
    bn = cfg.kwargs.get("BLOCK_N", block_n)
    return 2 * block_d * (cfg.kwargs["BLOCK_M"] + 2 * bn * cfg.num_stages)


def _fits(cfg: triton.Config, block_n: int, block_d: int) -> bool:
    """Whether a config's tiles fit shared memory, and, with fewer than 4 warps, a 64 x 64 key tile
    (a one-warp program with a 128 x 128 tile spills and takes ptxas minutes to compile)."""
    bn = cfg.kwargs.get("BLOCK_N", block_n)
    small_tile = bn <= SMALL_TILE and block_d <= SMALL_TILE
    return _smem_bytes(cfg, block_n, block_d) <= SMEM_LIMIT and (cfg.num_warps >= 4 or small_tile)


def _with_block_n(cfg: triton.Config, block_n: int) -> triton.Config:
    """``cfg`` with its key tile set to ``block_n``."""
    return triton.Config({**cfg.kwargs, "BLOCK_N": block_n}, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _prune(configs, named_args, **kwargs):
    """The short- or long-query configs that fit (``_fits``); the single-stage fallbacks if none.  The
    exact shift's tiles divide its centre block (``CENTRE_BLOCK``); tiles of the whole block if none do."""
    tiled = "BLOCK_N" in configs[0].kwargs
    table = _TILED_CONFIGS if tiled else _SHIFT_CONFIGS
    block_d, block_n = kwargs["BLOCK_D"], kwargs.get("BLOCK_N", 64)
    pool = table["short"] if named_args["NQ_BUCKET"] <= 32 else table["long"]
    if tiled and kwargs["SHIFT"] == "exact":
        centre = kwargs["CENTRE_BLOCK"]
        pool = [c for c in pool if centre % c.kwargs["BLOCK_N"] == 0] or [_with_block_n(c, centre) for c in pool]
    fitting = [c for c in pool if _fits(c, block_n, block_d)]
    if fitting:
        return fitting
    fallback = table["fallback"]
    if tiled and kwargs["SHIFT"] == "exact":
        fallback = [_with_block_n(c, min(c.kwargs["BLOCK_N"], kwargs["CENTRE_BLOCK"])) for c in fallback]
    return [c for c in fallback if _smem_bytes(c, block_n, block_d) <= SMEM_LIMIT] or fallback[:1]


def autotuned(kernel, *, tune_block_n: bool):
    """``kernel`` under Triton's autotuner: the pool of the variants whose tile is their shift block
    (``tune_block_n=False``: PASA, the exact shift centring in the loop) or the tiled pool, which also
    tunes ``BLOCK_N`` (plain FlashAttention, the exact shift with pre-centred keys); results cached on
    disk across processes."""
    table = _TILED_CONFIGS if tune_block_n else _SHIFT_CONFIGS
    pool = [c for cs in table.values() for c in cs]
    key = AUTOTUNE_KEY[:-1] if tune_block_n else AUTOTUNE_KEY
    return triton.autotune(pool, key=key, prune_configs_by={"early_config_prune": _prune},
                           cache_results=True)(kernel)


PACKED_AUTOTUNE_KEY = ["HEAD_DIM", "BLOCK_Q", "BLOCK_K", "HALF_STATE", "NSEQ_BUCKET"]
PACKED_INTERPRET_CONFIG = {"SEQS": 2, "num_warps": 4, "num_stages": 1}
"""The packed kernel's interpreter configuration: two sequences per program (the 3-D tiles' batch axis)."""

PACKED_TILE_PER_WARP = 2048
"""The most elements of one (SEQS, tokens, BLOCK_D) tile a warp of the packed kernel holds: 64 fp32
registers per thread for the fp32 key tile (twice that spills, compiled for sm_90)."""

# (SEQS, num_warps): sequences per program and its warps; no loop, so one stage.  Measured on the H200
# (bench/temporal_packed.py, 2026-11-30): one warp per program wins (25 frames: one sequence, 14: two);
# programs of 2-8 warps holding 2-8 sequences ran 1.4-2.5x slower.  CENTRE_IN_G (the centred keys
# subtracted in fp16/bf16 rather than fp32) is tuned too: on the H200 (2026-12-01) it made 14 frames
# 1 % faster and 25 frames 15 % slower.
_PACKED_CONFIGS = [triton.Config({"SEQS": seqs, "CENTRE_IN_G": in_g}, num_warps=w, num_stages=1)
                   for seqs, w in [(1, 1), (2, 1), (1, 2), (1, 4), (1, 8)] for in_g in (False, True)]


def _prune_packed(configs, named_args, **kwargs):
    """The packed configs whose tiles fit ``PACKED_TILE_PER_WARP``, of those the ones with the fewest warps."""
    per_seq = max(kwargs["BLOCK_Q"], kwargs["BLOCK_K"]) * kwargs["BLOCK_D"]
    fitting = [c for c in _PACKED_CONFIGS if c.kwargs["SEQS"] * per_seq <= PACKED_TILE_PER_WARP * c.num_warps]
    fewest = min(c.num_warps for c in fitting)
    return [c for c in fitting if c.num_warps == fewest]


def autotuned_packed(kernel):
    """The packed kernel (``packed_fwd.py``) under Triton's autotuner, results cached on disk."""
    return triton.autotune(_PACKED_CONFIGS, key=PACKED_AUTOTUNE_KEY,
                           prune_configs_by={"early_config_prune": _prune_packed}, cache_results=True)(kernel)


def pow2_tile(n: int) -> int:
    """The smallest power of two >= max(n, 16): a tile extent that covers n."""
    return max(16, triton.next_power_of_2(n))


def bucket(n: int) -> int:
    """Autotune bucket of a sequence length: a power of two in [16, 16384]."""
    return min(max(16, triton.next_power_of_2(n)), 16384)
