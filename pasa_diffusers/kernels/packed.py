"""The exact shift for short sequences: several whole (batch, head) sequences per program, one pass.

Temporal attention in a video UNet is tens of thousands of sequences of 14-25 tokens (one per pixel
and head).  Each one is a single key block, so its softmax needs no running state: a program loads
``SEQS`` whole sequences as 3-D tiles, centres each sequence's keys, and computes scores, softmax and
``P V`` with batched tile products.  Every byte of q, k, v is read once and o written once; the work
is bandwidth-bound, and packing gives each program enough rows (``SEQS x BLOCK_Q``) to keep its
loads wide while every reduction stays inside one sequence's tile.

Same result as ``portable.pasa_fwd_kernel`` with ``SHIFT="exact"`` on one key block (and as
``reference.exact_shift_reference``): the same centre (``common.centre_tile``), the same roundings;
only the summation order inside the tile products may differ.

Configs: sequences per program (``SEQS``) and warps, pruned to the fewest warps whose tiles fit the
registers (``TILE_PER_WARP``); one warp per program wins on the H200 (docs/notes/did_not_help.md).
``CENTRE_IN_G`` is tuned too.  No loop, so one stage.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .call import Call, Kernel, Plan
from .common import INTERPRET, LN2, LOG2E, cdiv, centre_tile, lse_arg, mma, round_to, strides3
from .tuning import autotuned, bucket, interpreter_autotunes, pow2_tile

__all__ = ["packed_fwd_kernel", "forward", "MAX_TOKENS", "packs"]

MAX_TOKENS = 64
"""The longest query and key sequences the packed kernel takes (one 64-row tile per sequence)."""


def packs(n_q: int, n_k: int) -> bool:
    """Whether sequences of ``n_q`` queries and ``n_k`` keys fit the packed kernel."""
    return n_q <= MAX_TOKENS and n_k <= MAX_TOKENS


@triton.jit(do_not_specialize=["N_SEQ", "N_Q", "N_K"])
def packed_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    H_Q, KV_GROUP, N_SEQ, N_Q, N_K,
    NSEQ_BUCKET,  # autotune key only
    scale, G_ULP,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    SEQS: tl.constexpr, CENTRE_IN_G: tl.constexpr, PRECISION: tl.constexpr, STORE_LSE: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
):
    """``out = softmax(scale q k^T) v`` for ``SEQS`` whole sequences: flat (batch, head) indices
    ``pid * SEQS ...``, each with all its ``N_Q`` queries and ``N_K`` keys in one tile.

    Tiles (``g`` = the GEMM dtype, fp16 or bf16; one leading axis of ``SEQS`` sequences):
        q (SEQS, BLOCK_Q, BLOCK_D) g;  v (SEQS, BLOCK_K, BLOCK_D) g
        k32 (SEQS, BLOCK_D, BLOCK_K) fp32 (g values): the keys, loaded transposed (the product's B operand)
        c (SEQS, BLOCK_D) fp32 (g values): each sequence's centre, ``common.centre_tile`` over its keys
            (the exact centre in hybrid, the rounded mean in half);  k_c^T = k - c, subtracted in g
            when ``CENTRE_IN_G`` (a tuned switch: fewer instructions and registers, but a layout the
            compiler handles worse for some tiles) or as round_g(fp32(k - c)) otherwise: the same
            values (exact in hybrid; in half both are the correctly rounded difference, since fp32
            has at least 2p + 2 bits of g's p and the double rounding is innocuous)
        s (SEQS, BLOCK_Q, BLOCK_K): fp32(q k_c^T) (hybrid)  |  fp16(q_s k_c^T), q_s = round_fp16(scale q) (half)
        x = unit s - unit rowmax(s)   (fp32, one FMA; unit = scale log2(e) in hybrid, log2(e) in half)
        p = exp2(x) rounded to g (hybrid) | fp16 (half);  l = rowsum(p) fp32
        o = (p v) * (1 / l): ``p v`` with fp32 accumulators (hybrid) or fp16 ones (half)
        lse = (m + r + log2(l)) ln 2, r = scale log2(e) (q . c)   (fp32, STORE_LSE only; m = unit rowmax(s))

    ``q . c`` is the same for every key of a row, so softmax drops it: one key block needs no offset
    and no running maximum; only the log-sum-exp of the true logits needs it back (``r``, formed as
    the portable kernel's ``r_j``; stored into the contiguous (B, Hq, Nq) fp32 buffer at ``lse_ptr``).
    Rows past ``N_Q``, values past ``N_K`` and sequences past ``N_SEQ`` load as zero, keys past ``N_K``
    as copies of the last key; padded keys get ``-inf`` scores; padded rows and sequences are not
    stored.
    """
    pid = tl.program_id(0)
    offs_s = pid * SEQS + tl.arange(0, SEQS)
    s_valid = offs_s < N_SEQ
    off_z = (offs_s // H_Q).to(tl.int64)
    off_hq = (offs_s % H_Q).to(tl.int64)
    off_hk = off_hq // KV_GROUP

    offs_i = tl.arange(0, BLOCK_Q)
    offs_j = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    i_valid = offs_i < N_Q
    j_valid = offs_j < N_K
    q_mask = s_valid[:, None, None] & i_valid[None, :, None]
    kv_mask = s_valid[:, None, None] & j_valid[None, :, None]
    kt_mask = s_valid[:, None, None]
    if BLOCK_D != HEAD_DIM:
        d_valid = offs_d < HEAD_DIM
        q_mask = q_mask & d_valid[None, None, :]
        kv_mask = kv_mask & d_valid[None, None, :]
        kt_mask = kt_mask & d_valid[None, :, None]

    q_rows = (off_z * stride_qz + off_hq * stride_qh)[:, None, None] + offs_i[None, :, None] * stride_qm
    # keys past N_K load key N_K - 1 again: the centre's extremes then need no mask
    k_cols = ((off_z * stride_kz + off_hk * stride_kh)[:, None, None]
              + tl.minimum(offs_j, N_K - 1)[None, None, :] * stride_kn)
    v_rows = (off_z * stride_vz + off_hk * stride_vh)[:, None, None] + offs_j[None, :, None] * stride_vn
    q = tl.load(q_ptr + q_rows + offs_d[None, None, :], mask=q_mask, other=0.0)
    k_g = tl.load(k_ptr + k_cols + offs_d[None, :, None], mask=kt_mask, other=0.0)
    k32 = k_g.to(tl.float32)
    v = tl.load(v_ptr + v_rows + offs_d[None, None, :], mask=kv_mask, other=0.0)
    g_ty = v.dtype

    c = centre_tile(k32, j_valid[None, None, :], N_K, G_ULP, g_ty, PRECISION != "half", INTERPRET_BF16, 2, True)
    if CENTRE_IN_G and not INTERPRET_BF16:  # the interpreter cannot subtract bf16
        k_t = k_g - c.to(g_ty)[:, :, None]
    else:
        k_t = round_to(k32 - c[:, :, None], g_ty, INTERPRET_BF16)
    if PRECISION == "half":
        q_s = (q.to(tl.float32) * scale).to(tl.float16)
        s = tl.dot(q_s, k_t, out_dtype=tl.float16).to(tl.float32)
        unit = LOG2E
    else:
        s = mma(q, k_t, tl.zeros([SEQS, BLOCK_Q, BLOCK_K], tl.float32), INTERPRET_BF16)
        unit = scale * LOG2E
    s = tl.where(j_valid[None, None, :], s, float("-inf"))
    m = tl.max(s, axis=2) * unit
    x = tl.fma(s, unit, -m[:, :, None])
    if PRECISION == "half":
        p = tl.math.exp2(x).to(tl.float16)
        pv = tl.dot(p, v, out_dtype=tl.float16).to(tl.float32)
    else:
        p = round_to(tl.math.exp2(x), g_ty, INTERPRET_BF16)
        pv = mma(p, v, tl.zeros([SEQS, BLOCK_Q, BLOCK_D], tl.float32), INTERPRET_BF16)
    l = tl.sum(p.to(tl.float32), axis=2)
    inv_l = 1.0 / l
    out = round_to(pv * inv_l[:, :, None], o_ptr.dtype.element_ty, INTERPRET_BF16)

    o_rows = (off_z * stride_oz + off_hq * stride_oh)[:, None, None] + offs_i[None, :, None] * stride_om
    tl.store(o_ptr + o_rows + offs_d[None, None, :], out, mask=q_mask)
    if STORE_LSE:
        r = tl.sum(q.to(tl.float32) * c[:, None, :], axis=2) * (scale * LOG2E)
        lse = ((m + r) + tl.math.log2(l)) * LN2
        lse_rows = offs_s.to(tl.int64)[:, None] * N_Q + offs_i[None, :]
        tl.store(lse_ptr + lse_rows, lse, mask=s_valid[:, None] & i_valid[None, :])


AUTOTUNE_KEY = ["HEAD_DIM", "BLOCK_Q", "BLOCK_K", "PRECISION", "NSEQ_BUCKET"]
INTERPRET_CONFIG = {"SEQS": 2, "CENTRE_IN_G": False, "num_warps": 4, "num_stages": 1}
"""The interpreter's configuration: two sequences per program (the 3-D tiles' batch axis)."""

TILE_PER_WARP = 2048
"""The most elements of one (SEQS, tokens, BLOCK_D) tile a warp holds: 64 fp32 registers per thread for
the fp32 key tile (twice that spills, compiled for sm_90)."""

CONFIGS = [triton.Config({"SEQS": seqs, "CENTRE_IN_G": in_g}, num_warps=w, num_stages=1)
           for seqs, w in [(1, 1), (2, 1), (1, 2), (1, 4), (1, 8)] for in_g in (False, True)]
"""(sequences per program, warps) x ``CENTRE_IN_G``."""


def _prune(configs, named_args, **kwargs):
    """The configs whose tiles fit ``TILE_PER_WARP``, of those the ones with the fewest warps."""
    per_seq = max(kwargs["BLOCK_Q"], kwargs["BLOCK_K"]) * kwargs["BLOCK_D"]
    fitting = [c for c in configs if c.kwargs["SEQS"] * per_seq <= TILE_PER_WARP * c.num_warps]
    fewest = min(c.num_warps for c in fitting)
    return [c for c in fitting if c.num_warps == fewest]


_packed_fwd_tuned = autotuned(packed_fwd_kernel, CONFIGS, AUTOTUNE_KEY, _prune, name="packed")


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, scale: float,
            precision: str, config: dict | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Write the exact shift's ``softmax(scale q k^T) v`` into ``out`` (and each row's log-sum-exp into
    ``lse``) and return ``out``.

    Resolved arguments (``dispatch.forward`` checks and plans the call):
        q: ``(B, Hq, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` with ``Hq % Hk == 0`` and ``packs(Nq, Nk)``;
            out: ``(B, Hq, Nq, D)``; any strides with unit stride in the head dim.
        scale: softmax scale; precision: ``"hybrid"`` or ``"half"``.
        config: fixed ``SEQS`` (sequences per program, a power of two), ``CENTRE_IN_G`` (bool, default
            False) and ``num_warps`` instead of autotuning (under the interpreter: over
            ``INTERPRET_CONFIG``, whose ``num_warps`` it ignores).
        lse: ``None``, or a contiguous fp32 ``(B, Hq, Nq)`` buffer for the natural-log log-sum-exp of each
            row's true logits ``scale q . k`` (``STORE_LSE``).
    """
    batch, h_q, n_q, head_dim = q.shape
    h_k, n_k = k.shape[1], k.shape[2]
    n_seq = batch * h_q
    args = (q, k, v, out, lse_arg(lse, q.device), *strides3(q), *strides3(k), *strides3(v), *strides3(out),
            h_q, h_q // h_k, n_seq, n_q, n_k, bucket(n_seq), float(scale), torch.finfo(q.dtype).eps)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=pow2_tile(head_dim), BLOCK_Q=pow2_tile(n_q), BLOCK_K=pow2_tile(n_k),
                PRECISION=precision, STORE_LSE=lse is not None, INTERPRET_BF16=INTERPRET and q.dtype == torch.bfloat16)

    def grid(meta_):
        return (cdiv(n_seq, meta_["SEQS"]),)

    if config is not None or (INTERPRET and not interpreter_autotunes()):
        fixed = {"CENTRE_IN_G": False, **(INTERPRET_CONFIG if INTERPRET else {}), **(config or {})}
        if not isinstance(fixed.get("SEQS"), int) or fixed["SEQS"] < 1 or fixed["SEQS"] & (fixed["SEQS"] - 1):
            raise ValueError(f"packed.forward: config['SEQS'] must be a power of two, got {fixed.get('SEQS')!r}")
        if not isinstance(fixed["CENTRE_IN_G"], bool):
            raise ValueError(f"packed.forward: config['CENTRE_IN_G'] must be a bool, got {fixed['CENTRE_IN_G']!r}")
        packed_fwd_kernel[grid](*args, **meta, **fixed)
    else:
        _packed_fwd_tuned[grid](*args, **meta)
    return out


def unsuitable(call: Call) -> str | None:
    """Why the packed kernel cannot run ``call`` (an exact-shift call), or ``None``."""
    if call.block_mask is not None:
        return "it takes no block_mask yet"
    n_q, n_k = call.q.shape[2], call.k.shape[2]
    if not (call.one_block and packs(n_q, n_k)):
        return (f"it takes sequences of at most {MAX_TOKENS} queries and keys in one key block; "
                f"got {n_q} queries and {n_k} keys (block_n={call.shift_block})")
    if call.prepass:
        return "prepass=True: it centres each sequence's keys itself"
    return None


def launch(call: Call, plan: Plan) -> None:
    """:func:`forward` on ``call``'s raw keys."""
    forward(call.q, call.k, call.v, call.out, scale=call.scale, precision=call.variant.precision, config=call.config,
            lse=call.lse)


ENTRY = Kernel("packed", ("hybrid", "half"), ("exact",), launch, unsuitable)
