"""The exact shift in hybrid precision for Hopper (sm_90): TMA tensor descriptors, optional warp specialisation.

One Triton kernel, :func:`exact_fwd_tma_kernel`, and its launch wrapper :func:`exact_forward_tma`.  It
computes the project's default variant (``shift="exact"``, ``precision="hybrid"``; the portable kernel
is ``pasa_fwd.py`` with ``SHIFT="exact"``) from the outputs of the key pre-pass (``centre_k.py``):
the centred keys ``k_c`` and the centres ``c_j``.  What differs from the portable kernel is only how
tiles reach shared memory: every tile is a ``tl.make_tensor_descriptor`` load (the copy engine,
``cp.async.bulk.tensor``), out-of-range rows and columns arrive as zeros, and ``WARP_SPECIALIZE``
lets Triton split the key loop into a producer warpgroup (the copies) and consumer warpgroups (the
GEMMs and the softmax).  Triton 3.6 on sm_90 crashes on a second loop after a specialised one and on
pointer loads inside it, so the ragged last key block is masked inside the single loop (``MASK_N``,
set only when ``Nk`` is not a multiple of ``BLOCK_N``) and every load in the loop is a descriptor load.
Warp specialisation also needs ``R_ON_TC`` (``q . c_j`` as a small wgmma): the pass aborts on the fp32
register copy of ``q`` that the FMA form reads, and on any reduction that does not depend on the scores
(see :func:`_row_shift`).  Without warp specialisation both forms compile.

Under ``TRITON_INTERPRET=1`` (set before ``triton`` is first imported) the kernel runs on CPU tensors
through Triton's numpy interpreter (descriptors included; fp16 only: numpy cannot multiply bf16).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import rules
from .centre_k import centre_k_kernel

__all__ = ["exact_fwd_tma_kernel", "exact_forward_tma", "exact_attention_tma", "centre_keys", "DEFAULT_CONFIG",
           "SHIFT_BLOCK", "INTERPRET", "kernel_call"]

SHIFT_BLOCK = rules.SHIFT_BLOCK
"""Keys per centre ``c_j`` (the pre-pass's block); ``BLOCK_N`` divides it."""
R_TILE = tl.constexpr(16)
"""Centre rows one ``R_ON_TC`` load brings (the N of the (BLOCK_M, 16) wgmma that forms ``r_j``)."""


@triton.jit
def _row_shift(q, q32, desc_c, blk, qk_scale, zero, R_ON_TC: tl.constexpr):
    """``r_j = qk_scale (q . c_j)`` (BLOCK_M,) fp32, ``c_j`` the centre of key block ``blk``.

    ``R_ON_TC=False``: fp32 products and an fp32 sum over the head dim (as the portable kernel and
    ``reference.exact_shift_reference``); ``q32`` is ``q`` widened once, ``desc_c`` loads the (1, BLOCK_D)
    fp32 row ``c_j``.  ``R_ON_TC=True``: the same dot on the tensor cores: ``desc_c`` loads R_TILE
    centre rows ``blk, blk + 1, ...`` in the GEMM dtype (``c_j`` are values of it, so exact), one
    (BLOCK_M, 16) wgmma with fp32 accumulation, column 0 kept.  Exact products either way; the
    tensor cores' fp32 accumulation truncates (about half an ulp per k-step of 16).

    ``zero`` (BLOCK_M,) is ``0 * m_s``, an exact zero (``m_s`` is finite) added to the products: it
    makes ``r_j`` depend on the score tile.  Triton 3.6's Hopper warp specialisation splits the rows
    between two consumer warpgroups by walking forward from the first dot; a reduction it can only
    reach backwards (``r_j``'s, independent of ``s``) aborts the pass ("Unexpected op",
    WSDataPartition.cpp).  The zero costs one multiply per row.
    """
    if R_ON_TC:
        c_tile = desc_c.load([blk, 0])
        rc = tl.dot(q, tl.trans(c_tile), tl.zeros([q.shape[0], c_tile.shape[0]], tl.float32) + zero[:, None])
        first = tl.arange(0, c_tile.shape[0]) == 0
        return tl.sum(tl.where(first[None, :], rc, 0.0), axis=1) * qk_scale
    else:
        c_j = desc_c.load([blk, 0])
        return tl.sum(tl.fma(q32, c_j, zero[:, None]), axis=1) * qk_scale


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def exact_fwd_tma_kernel(
    q_ptr, kc_ptr, v_ptr, c_ptr, o_ptr,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    stride_cz, stride_ch, stride_cj,
    H_Q, KV_GROUP, N_Q, N_K, N_BLOCKS, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SHIFT_BLOCK_N: tl.constexpr, MASK_N: tl.constexpr, R_ON_TC: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """``out = softmax(scale q k^T) v`` for one block of ``BLOCK_M`` query rows of one (batch, head).

    Inputs from the pre-pass: ``k_c = k_blk - c_j`` (exact in the GEMM dtype ``g``) and the centres
    ``c_j`` (fp32 holding ``g`` values; ``g`` itself for ``R_ON_TC``), one per ``SHIFT_BLOCK_N`` keys.
    In log2 units, ``qk_scale = scale log2(e)``, per key tile of ``BLOCK_N`` keys (inside block ``j =
    start_n // SHIFT_BLOCK_N``):

        r_j    = qk_scale (q . c_j)                    (fp32, per row: :func:`_row_shift`)
        s      = fp32(q k_c^T)                         (tensor cores, fp32 accumulation, unscaled)
        s      = -inf in the columns past N_K          (MASK_N only)
        m_s    = qk_scale rowmax(s),  m_blk = m_s + r_j,  m_new = max(m_i, m_blk)
        p      = round_g(exp2(fma(s, qk_scale, -(m_s - (m_blk - m_new)))))
        alpha  = exp2(m_i - m_new)
        l_i    = alpha l_i + rowsum(p),  acc = alpha acc + p v_blk,  m_i = m_new

    and at the end ``out = acc / l_i``.  ``qk_scale s + r_j`` is the tile's true logit (times log2 e)
    in real arithmetic; the row offset goes through the tile's own centred maximum ``m_s`` because
    ``r_j`` reaches 1e4 for biased inputs, where fp32 rounds at 1e-3 (``r_j - m_new`` alone would put
    that rounding into every exponent).  ``l_i`` sums the ``p`` rounded to ``g`` that multiply V
    (``pasa_fwd.py``, "Normalizer").  The same arithmetic as the portable kernel's hybrid exact shift;
    only the summation order of the GEMMs may differ.

    Loop invariant: ``acc / l_i == softmax(scale q K^T) V`` over the keys seen so far, ``m_i`` the
    running maximum logit (log2 units).

    Tiles (``g`` = fp16 or bf16): q (BLOCK_M, BLOCK_D) g, in shared memory for the wgmma, and ``q32``
    its fp32 copy in registers (``R_ON_TC=False``); k_blk (= k_c), v_blk (BLOCK_N, BLOCK_D) g, one
    per pipeline stage; s, p (BLOCK_M, BLOCK_N) fp32 (p rounded to g for ``P V``); m_i, l_i, r_j, m_s
    (BLOCK_M,) fp32; acc (BLOCK_M, BLOCK_D) fp32.  ``BLOCK_D`` is ``HEAD_DIM`` rounded up to a power
    of two: the descriptors' shapes are the true (N, HEAD_DIM), so the copy engine fills rows past
    ``N_Q``/``N_K`` and columns past ``HEAD_DIM`` with zeros and the output store drops them.

    Grid: one program per (query block, batch x head) on axis 0, query blocks fastest (programs
    running together read the same K/V).  Descriptors are built per program from the (batch, head)
    base pointer (``triton.set_allocator`` provides their scratch), so any (B, H, N, D) strides with
    16-byte-aligned rows serve, e.g. diffusers' (B, N, H, D) tensors transposed.
    """
    pid = tl.program_id(0)
    num_m_blocks = tl.cdiv(N_Q, BLOCK_M)
    pid_m = pid % num_m_blocks
    pid_bh = pid // num_m_blocks
    off_z = (pid_bh // H_Q).to(tl.int64)
    off_hq = (pid_bh % H_Q).to(tl.int64)
    off_hk = off_hq // KV_GROUP
    start_m = pid_m * BLOCK_M

    desc_q = tl.make_tensor_descriptor(q_ptr + off_z * stride_qz + off_hq * stride_qh, shape=[N_Q, HEAD_DIM],
                                       strides=[stride_qm, 1], block_shape=[BLOCK_M, BLOCK_D])
    desc_k = tl.make_tensor_descriptor(kc_ptr + off_z * stride_kz + off_hk * stride_kh, shape=[N_K, HEAD_DIM],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
    desc_v = tl.make_tensor_descriptor(v_ptr + off_z * stride_vz + off_hk * stride_vh, shape=[N_K, HEAD_DIM],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D])
    desc_o = tl.make_tensor_descriptor(o_ptr + off_z * stride_oz + off_hq * stride_oh, shape=[N_Q, HEAD_DIM],
                                       strides=[stride_om, 1], block_shape=[BLOCK_M, BLOCK_D])
    c_rows: tl.constexpr = R_TILE if R_ON_TC else 1
    desc_c = tl.make_tensor_descriptor(c_ptr + off_z * stride_cz + off_hk * stride_ch, shape=[N_BLOCKS, HEAD_DIM],
                                       strides=[stride_cj, 1], block_shape=[c_rows, BLOCK_D])

    q = desc_q.load([start_m, 0])
    q32 = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_j = tl.arange(0, BLOCK_N)

    for start_n in tl.range(0, N_K, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k_blk = desc_k.load([start_n, 0])
        v_blk = desc_v.load([start_n, 0])
        s = tl.dot(q, tl.trans(k_blk))
        if MASK_N:
            s = tl.where((start_n + offs_j < N_K)[None, :], s, float("-inf"))
        m_s = tl.max(s, axis=1) * qk_scale
        r_j = _row_shift(q, q32, desc_c, start_n // SHIFT_BLOCK_N, qk_scale, m_s * 0.0, R_ON_TC)
        m_blk = m_s + r_j
        m_new = tl.maximum(m_i, m_blk)
        p = tl.math.exp2(tl.fma(s, qk_scale, -(m_s - (m_blk - m_new))[:, None])).to(q.dtype)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = alpha * l_i + tl.sum(p.to(tl.float32), axis=1)
        acc = tl.dot(p, v_blk, acc * alpha[:, None])
        m_i = m_new

    desc_o.store([start_m, 0], (acc / l_i[:, None]).to(q.dtype))


INTERPRET = not isinstance(exact_fwd_tma_kernel, triton.runtime.jit.JITFunction)
"""True when ``TRITON_INTERPRET=1`` was set before triton was imported: the kernel then runs on CPU."""

# ---------------------------------------------------------------------------------------------------
# Configurations.  Not yet timed on the H200 (bench/bench_hopper.py does that); compiled for sm_90 with
# triton 3.6 by bench/hopper_compile_check.py.  BLOCK_N must divide SHIFT_BLOCK (64 or 128).
# ---------------------------------------------------------------------------------------------------
DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "warp_specialize": False,
                  "r_on_tc": False}
INTERPRET_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "warp_specialize": False}
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the in-kernel tensor descriptors (128 bytes each, per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Install :func:`_scratch` as Triton's allocator unless the caller has set one."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def merged_config(fn: str, base: dict, config: dict | None) -> dict:
    """``base`` updated by ``config``, whose keys must be ``base``'s; ``ValueError`` naming ``fn`` otherwise."""
    unknown = set(config or {}) - set(base)
    if unknown:
        raise ValueError(f"{fn}: unknown config keys {sorted(unknown)}; expected {sorted(base)}")
    return {**base, **(config or {})}


def check_centres(fn: str, k_c: torch.Tensor, centres: torch.Tensor) -> None:
    """``centres`` as the pre-pass writes them for ``k_c``: float32 (B, Hk, ceil(Nk / SHIFT_BLOCK), D) on
    ``k_c``'s device; ``ValueError`` naming it otherwise."""
    b, h_k, n_k, d = k_c.shape
    n_blocks = triton.cdiv(n_k, SHIFT_BLOCK)
    if centres.dtype != torch.float32 or tuple(centres.shape) != (b, h_k, n_blocks, d) or centres.device != k_c.device:
        raise ValueError(f"{fn}: centres must be float32 (B, Hk, ceil(Nk / {SHIFT_BLOCK}), D) = "
                         f"{(b, h_k, n_blocks, d)} "
                         f"on {k_c.device} (centre_keys' output), got centres.shape={tuple(centres.shape)} "
                         f"{centres.dtype} on {centres.device}")


def descriptor_layout_problem(tensors) -> str | None:
    """What a TMA descriptor needs of each ``(name, tensor)``: unit stride in the head dim, a 16-byte-aligned
    base and B, H, N strides that are multiples of 16 bytes (the (batch, head) strides enter the base
    address, so they count too).  The first unmet need, naming the tensor, or ``None``."""
    for name, t in tensors:
        size, d = t.element_size(), t.shape[-1]
        if t.stride(-1) != 1:
            return (f"{name} must have unit stride in the head dim, got "
                    f"{name}.stride()={tuple(t.stride())} for {name}.shape={tuple(t.shape)}")
        bad = [i for i in range(3) if (t.stride(i) * size) % 16 != 0 and t.shape[i] > 1]
        if t.data_ptr() % 16 != 0 or bad:
            return (f"{name} does not suit a TMA descriptor: its base address and its B, H, N strides "
                    f"must be multiples of 16 bytes, got data_ptr % 16 = {t.data_ptr() % 16}, "
                    f"{name}.stride()={tuple(t.stride())} ({t.dtype}, head dim {d}: contiguous (B, H, N, D) or "
                    f"(B, N, H, D) tensors qualify when D * {size} is a multiple of 16)")
    return None


def check_descriptor_layout(fn: str, tensors) -> None:
    """:func:`descriptor_layout_problem` as a ``ValueError`` prefixed by ``fn``."""
    problem = descriptor_layout_problem(tensors)
    if problem is not None:
        raise ValueError(f"{fn}: {problem}")


def _validate(q, k_c, v, centres, out) -> None:
    """Raise ``ValueError`` (naming the argument) for what the descriptors or the kernel cannot take."""
    fn = "exact_forward_tma"
    tensors = (("q", q), ("k_c", k_c), ("v", v), ("out", out), ("centres", centres))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be a 4-d (B, H, N, D) tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, q on {q.device}")
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k_c.dtype == v.dtype == out.dtype):
        raise ValueError(f"{fn}: q, k_c, v, out must share dtype float16 or bfloat16, got "
                         f"{q.dtype}, {k_c.dtype}, {v.dtype}, {out.dtype}")
    b, h_q, n_q, d = q.shape
    h_k = k_c.shape[1]
    if out.shape != q.shape:
        raise ValueError(f"{fn}: out.shape={tuple(out.shape)} must equal q.shape={tuple(q.shape)}")
    if k_c.shape != v.shape or k_c.shape[0] != b or k_c.shape[3] != d:
        raise ValueError(f"{fn}: k_c, v must be (B, Hk, Nk, D) matching q: q.shape={tuple(q.shape)}, "
                         f"k_c.shape={tuple(k_c.shape)}, v.shape={tuple(v.shape)}")
    if h_q % h_k != 0:
        raise ValueError(f"{fn}: q heads ({h_q}) must be a multiple of k/v heads ({h_k})")
    check_centres(fn, k_c, centres)
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head dim {d} is outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM} (q.shape={tuple(q.shape)}); "
                         "use pasa_fwd.pasa_forward")
    check_descriptor_layout(fn, tensors)
    if q.device.type == "cpu" and not INTERPRET:
        raise RuntimeError(f"{fn}: CPU tensors run only under Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported")
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise ValueError(f"{fn}: the interpreter cannot multiply bfloat16 (numpy); use float16 on the CPU")
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] < 9:
        raise ValueError(f"{fn}: tensor descriptors need sm_90 or newer, got "
                         f"sm_{''.join(map(str, torch.cuda.get_device_capability(q.device)))}; "
                         "use pasa_fwd.pasa_forward")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{fn}: unsupported device {q.device}")


def centre_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hybrid pre-pass (``centre_k.py``, exact centres): ``(k_c, centres)`` for key blocks of 128.

    ``k`` (B, Hk, Nk, D) fp16/bf16, any strides with unit stride in D; ``k_c`` comes back contiguous
    (B, Hk, Nk, D) in ``k.dtype``, ``centres`` (B, Hk, ceil(Nk / 128), D) fp32.
    """
    batch, h_k, n_k, head_dim = k.shape
    block_d = max(16, triton.next_power_of_2(head_dim))
    n_blocks = triton.cdiv(n_k, SHIFT_BLOCK)
    k_c = torch.empty((batch, h_k, n_k, head_dim), dtype=k.dtype, device=k.device)
    centres = torch.empty((batch, h_k, n_blocks, head_dim), dtype=torch.float32, device=k.device)
    centre_k_kernel[(batch * h_k, n_blocks)](
        k, k_c, centres, k.stride(0), k.stride(1), k.stride(2), *k_c.stride()[:3], *centres.stride()[:3],
        h_k, n_k, torch.finfo(k.dtype).eps,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=SHIFT_BLOCK, EXACT_CENTRE=True,
        INTERPRET_BF16=INTERPRET and k.dtype == torch.bfloat16, num_warps=4 if block_d <= 64 else 8)
    return k_c, centres


def exact_forward_tma(q: torch.Tensor, k_c: torch.Tensor, v: torch.Tensor, centres: torch.Tensor,
                      out: torch.Tensor, *, scale: float, config: dict | None = None) -> torch.Tensor:
    """Write ``softmax(scale q k^T) v`` into ``out`` from the pre-pass's ``k_c`` and ``centres``; return it.

    Args:
        q: ``(B, Hq, Nq, D)``; k_c, v: ``(B, Hk, Nk, D)`` with ``Hq % Hk == 0``; out: ``(B, Hq, Nq, D)``;
            fp16 or bf16, head dim 16..128.  Layouts: any strides with unit stride in D whose B, H
            and N strides are multiples of 16 bytes, on a 16-byte-aligned base: contiguous (B, H, N, D),
            and diffusers' contiguous (B, N, H, D) viewed as (B, H, N, D) by a transpose (N stride
            H * D), both whenever D * element size is a multiple of 16 (D % 8 == 0 in fp16/bf16).
            Anything else raises ``ValueError`` naming the tensor.
        centres: ``(B, Hk, ceil(Nk / 128), D)`` fp32, the exact centres (``centre_keys``).
        scale: softmax scale.
        config: ``BLOCK_M`` (64 / 128), ``BLOCK_N`` (64 / 128), ``num_warps``, ``num_stages``,
            ``warp_specialize`` (Triton's automatic warp specialisation of the key loop; needs
            ``r_on_tc``), ``r_on_tc`` (``q . c_j`` on the tensor cores); missing keys from
            ``DEFAULT_CONFIG`` (the interpreter's own small config under ``TRITON_INTERPRET=1``).
    """
    _validate(q, k_c, v, centres, out)
    if q.device.type == "cuda":
        _ensure_allocator()
    grid, args, meta = kernel_call(q, k_c, v, centres, out, scale=scale, config=config)
    exact_fwd_tma_kernel[grid](*args, **meta)
    return out


def kernel_call(q, k_c, v, centres, out, *, scale: float, config: dict | None = None):
    """``(grid, args, meta)`` of the launch ``exact_fwd_tma_kernel[grid](*args, **meta)`` (no validation).

    Split from :func:`exact_forward_tma` so that ``bench/hopper_compile_check.py`` compiles exactly
    what the wrapper launches (from meta tensors, without a GPU).
    """
    cfg = merged_config("exact_forward_tma", {**DEFAULT_CONFIG, **(INTERPRET_CONFIG if INTERPRET else {})}, config)
    if cfg["warp_specialize"] and not cfg["r_on_tc"]:
        raise ValueError("exact_forward_tma: config warp_specialize=True needs r_on_tc=True (Triton 3.6's Hopper "
                         "warp specialisation aborts on the fp32 register copy of q that the FMA row shift reads)")
    if SHIFT_BLOCK % cfg["BLOCK_N"] != 0 or cfg["BLOCK_N"] < 16:
        raise ValueError(f"exact_forward_tma: config BLOCK_N={cfg['BLOCK_N']} must divide the shift block "
                         f"{SHIFT_BLOCK}")
    batch, h_q, n_q, head_dim = q.shape
    h_k, n_k = k_c.shape[1], k_c.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))
    c_src = centres
    if cfg["r_on_tc"]:
        c_src = centres.to(q.dtype)  # exact: the centres are values of the GEMM dtype
        if (c_src.stride(2) * c_src.element_size()) % 16 != 0:
            raise ValueError(f"exact_forward_tma: r_on_tc needs D * {c_src.element_size()} to be a multiple of 16 "
                             f"(head dim {head_dim})")
    grid = (triton.cdiv(n_q, cfg["BLOCK_M"]) * batch * h_q,)
    args = (q, k_c, v, c_src, out,
            *q.stride()[:3], *k_c.stride()[:3], *v.stride()[:3], *out.stride()[:3], *c_src.stride()[:3],
            h_q, h_q // h_k, n_q, n_k, c_src.shape[2], float(scale) * math.log2(math.e))
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                SHIFT_BLOCK_N=SHIFT_BLOCK, MASK_N=n_k % cfg["BLOCK_N"] != 0, R_ON_TC=bool(cfg["r_on_tc"]),
                WARP_SPECIALIZE=bool(cfg["warp_specialize"]), num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])
    return grid, args, meta


def exact_attention_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                        config: dict | None = None) -> torch.Tensor:
    """The pre-pass and the kernel: ``softmax(scale q k^T) v`` for (B, H, N, D) views; ``out`` contiguous."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    k_c, centres = centre_keys(k)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return exact_forward_tma(q, k_c, v, centres, out, scale=scale, config=config)
