"""The Triton kernel itself on CPU tensors, through Triton's interpreter (``TRITON_INTERPRET=1``).

``tests/conftest.py`` builds the kernels for the interpreter on hosts without CUDA; on a CUDA host
this module skips unless ``TRITON_INTERPRET=1`` was set before pytest started.  The interpreter
runs one fixed configuration (``INTERPRET_CONFIG``: ``BLOCK_M=64``; ``BLOCK_N`` = PASA's shift block
``PASA_BLOCK_N`` = 128, 64 for plain FA), so shapes stay small.

Tolerance rule (FlashAttention's): with ``err(x) = rel_rmse(x, golden_attention)`` (RMSE over
RMS of the float64 golden output),

    err(kernel) <= K * err(reference of the same variant) + TINY

where the reference of the same variant is ``pasa_reference(precision=p)`` for PASA and
``flash_reference(precision="half" | "hybrid")`` for plain FA half | hybrid.  ``K = 2`` for every
variant.  Why 2: the kernel rounds at the same points as the reference (the same stored shift
entries from ``shift_matrix.py``; k_shift, S', P rounded to the GEMM dtype; the state rounded to fp16 in
half), in the same natural-log units, but it sums in a different order (tile GEMMs, fp32 row sums)
and forms the exponent as one fp32 FMA ``s log2(e) - (m_new - delta) log2(e)`` where the half
reference rounds ``s + delta - m_new`` to fp16 twice.  Those change which way individual roundings
go, not how many there are, so the kernel's error is the reference's up to a factor well below 2.
Measured here (30 random cases, biased N(mean, 1) inputs, mean 0 to 10, head dims 32 to 128):
kernel / reference error ratios PASA half 0.86-1.03, FA half 0.92-1.01, PASA hybrid 1.00, FA hybrid
0.97-1.00.  (On the GPU the half GEMMs accumulate in fp16 per MMA k-step, which the interpreter's
numpy dot does not: see ``test_kernel_gpu.py`` for its K.)

Hybrid against plain fp32 FlashAttention: plain FA hybrid is that variant (its reference is
``flash_reference("hybrid")``, K = 2).  PASA hybrid has no constant factor over it: its scores S' are
rounded to fp16, an error proportional to |S'|, which grows with the inputs' bias (the paper's
uniform(30, 0.5) case: about 100x FA fp32) while FA fp32 keeps fp32 scores; so PASA hybrid is held
to its own reference (K = 2) and, in the overflow test, to being finite where naive half is not.

Exact shift (``shift="exact"``): the reference is ``exact_shift_reference(precision=p)``, ``K = 2`` in
hybrid, ``K = 3`` in half (as PASA half on the GPU: fp16 wgmma accumulators).  The kernel rounds at
the reference's points (half: the same ``q_s = round_fp16(scale q)`` and fp16 scores, ``log2(e)``
applied in the fp32 exponent FMA) but carries ``r_j`` once per block (``m_blk``) where the reference
rounds ``s + r_j`` per element.

``TINY = 1e-6`` only covers a reference error of exactly zero; every error here is >= 1e-4 (the
fp16/bf16 rounding of the output alone).  Every kernel output starts poisoned with NaN, so a finite
output proves every element was written.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from pasa_diffusers import numerics  # noqa: E402
from pasa_diffusers.shift_matrix import optimal_beta  # noqa: E402
from pasa_diffusers.kernels import dispatch, packed  # noqa: E402
from pasa_diffusers.kernels.common import INTERPRET  # noqa: E402
from pasa_diffusers.reference import (DEFAULT_BETA, exact_shift_reference, flash_reference,  # noqa: E402
                                      golden_attention, pasa_reference)
from pasa_diffusers.variants import Variant  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="kernels built for the GPU; set TRITON_INTERPRET=1 "
                                "before pytest starts to run them on the CPU")

K_BOUND = {("pasa", "half"): 2.0, ("pasa", "hybrid"): 2.0, ("flash", "half"): 2.0, ("flash", "hybrid"): 2.0,
           ("exact", "hybrid"): 2.0, ("exact", "half"): 3.0}
TINY = 1e-6
VARIANTS = list(K_BOUND)

# (B, Hq, Hk, Nq, Nk, D)
SHAPES = {
    "one-block": (1, 2, 2, 64, 64, 64),
    "nk<block_n,nq!=nk": (1, 2, 2, 7, 100, 32),
    "one-row,tail2,d16": (2, 4, 4, 1, 130, 16),
    "gqa,d80-padded": (1, 4, 2, 100, 130, 80),
    "3-kv-blocks,2-q-blocks,tail1": (1, 2, 1, 130, 257, 64),
    "one-key": (1, 1, 1, 33, 1, 64),
}


def _biased_inputs(shape, gen, *, bias=3.0, dtype=torch.float16):
    """q, k ~ N(bias, 1) (a sequence bias: what PASA removes), v ~ N(0, 1), as (B, H, N, D)."""
    b, hq, hk, nq, nk, d = shape
    q = torch.randn(b, hq, nq, d, generator=gen) + bias
    k = torch.randn(b, hk, nk, d, generator=gen) + bias
    v = torch.randn(b, hk, nk, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _kernel(q, k, v, kind, precision, *, out=None, beta=DEFAULT_BETA, **options):
    """Run the kernel into a NaN-poisoned output (or the given one) and return it."""
    if out is None:
        out = torch.full_like(q, float("nan"))
    scale = 1.0 / math.sqrt(q.shape[-1])
    shift = {"flash": "none"}.get(kind, kind)
    result = dispatch.forward(q, k, v, out, scale=scale, variant=Variant(shift, precision), beta=beta, **options)
    assert result is out
    return out


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in ulps of their dtype at ``a``'s magnitude (the spacing ``2^(e-1) eps`` of the binade
    ``[2^(e-1), 2^e)`` holding ``a``; the subnormal spacing below the normals)."""
    info = torch.finfo(a.dtype)
    _, exponent = torch.frexp(a.float())
    spacing = torch.clamp(torch.ldexp(torch.full_like(a, info.eps, dtype=torch.float32), exponent - 1),
                          min=info.smallest_normal * info.eps)
    return (a.float() - b.float()).abs() / spacing


def _reference(q, k, v, kind, precision, **options):
    if kind == "pasa":
        return pasa_reference(q, k, v, precision=precision, **options)
    if kind == "exact":
        return exact_shift_reference(q, k, v, precision=precision, **options)
    return flash_reference(q, k, v, precision=precision, **options)


def _assert_within_bound(out, ref, gold, kind, precision):
    assert torch.isfinite(out).all(), f"{kind}-{precision}: {numerics.nonfinite_count(out)} non-finite outputs"
    err, err_ref = numerics.rel_rmse(out, gold), numerics.rel_rmse(ref, gold)
    bound = K_BOUND[kind, precision] * err_ref + TINY
    assert err <= bound, f"{kind}-{precision}: kernel error {err:.3e} > {bound:.3e} (reference {err_ref:.3e})"


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("kind,precision", VARIANTS, ids=[f"{k}-{p}" for k, p in VARIANTS])
def test_matches_golden_within_reference_bound(kind, precision, shape, gen):
    q, k, v = _biased_inputs(shape, gen)
    out = _kernel(q, k, v, kind, precision)
    _assert_within_bound(out, _reference(q, k, v, kind, precision), golden_attention(q, k, v), kind, precision)


@pytest.mark.parametrize("kind,precision", VARIANTS, ids=[f"{k}-{p}" for k, p in VARIANTS])
def test_bnhd_views_give_the_contiguous_result(kind, precision, gen):
    """diffusers hands (B, N, H, D) tensors viewed as (B, H, N, D): no copies, the same bits."""
    b, hq, hk, nq, nk, d = 2, 4, 2, 70, 130, 64
    q, k, v = _biased_inputs((b, hq, hk, nq, nk, d), gen)
    q_v, k_v, v_v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert q_v.stride(2) == hq * d and k_v.stride(2) == hk * d and not q_v.is_contiguous()
    out_v = torch.full((b, nq, hq, d), float("nan"), dtype=q.dtype).transpose(1, 2)
    _kernel(q_v, k_v, v_v, kind, precision, out=out_v)
    expected = _kernel(q, k, v, kind, precision)
    assert torch.equal(out_v, expected)


@pytest.mark.parametrize("kind", ["pasa", "flash", "exact"])
def test_bf16_hybrid(kind, gen):
    shape = (1, 4, 2, 100, 130, 64)
    q, k, v = _biased_inputs(shape, gen, dtype=torch.bfloat16)
    out = _kernel(q, k, v, kind, "hybrid")
    assert out.dtype == torch.bfloat16
    _assert_within_bound(out, _reference(q, k, v, kind, "hybrid"), golden_attention(q, k, v), kind, "hybrid")


OVERFLOW_EXPECTED = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")


@OVERFLOW_EXPECTED
@pytest.mark.parametrize("dist,mean,amplitude", [("uniform", 30.0, 0.5), ("hybrid", 30.0, 10.0)])
def test_paper_overflow_case(dist, mean, amplitude):
    """max|q.k| > 65504: naive fp16 FA returns NaN/inf, PASA half and hybrid stay finite and accurate."""
    q, k, v = numerics.paper_inputs(dist, mean, amplitude, shape=(1, 2, 1, 130, 128), seed=7)
    assert (q.double() @ k.double().transpose(-1, -2)).abs().max() > 65504
    gold = golden_attention(q, k, v)

    sentinel = 12345.0
    naive = _kernel(q, k, v, "flash", "half", out=torch.full_like(q, sentinel))
    assert not (naive == sentinel).any()
    assert numerics.nonfinite_count(naive) > 0

    for kind, precision in [("pasa", "half"), ("pasa", "hybrid"), ("flash", "hybrid"), ("exact", "hybrid"),
                            ("exact", "half")]:
        out = _kernel(q, k, v, kind, precision)
        _assert_within_bound(out, _reference(q, k, v, kind, precision), gold, kind, precision)


@OVERFLOW_EXPECTED
@pytest.mark.parametrize("precision", ["half", "hybrid"])
def test_resonance_overflow(precision):
    """The paper's q/k "resonance" along the head dim: naive half overflows, PASA does not."""
    q, k, v = numerics.resonance_inputs((1, 2, 2, 128, 64), phase="in", bias=50.0, seed=3)
    assert (q.double() @ k.double().transpose(-1, -2)).abs().max() > 65504
    assert numerics.nonfinite_count(_kernel(q, k, v, "flash", "half", out=torch.zeros_like(q))) > 0
    gold = golden_attention(q, k, v)
    for kind in ("pasa", "exact"):
        out = _kernel(q, k, v, kind, precision)
        _assert_within_bound(out, _reference(q, k, v, kind, precision), gold, kind, precision)


@pytest.mark.parametrize("precision", ["half", "hybrid"])
def test_exact_shift_drifting_blocks(precision, gen):
    """block_n=32: 5 key blocks (tail 22) with a drifting bias, each centred on its own mean."""
    q, k, v = _biased_inputs((1, 2, 1, 50, 150, 32), gen, bias=2.0)
    k = (k.float() + torch.linspace(0.0, 20.0, 150)[:, None]).half()
    out = _kernel(q, k, v, "exact", precision, block_n=32)
    ref = exact_shift_reference(q, k, v, precision=precision, block_n=32)
    _assert_within_bound(out, ref, golden_attention(q, k, v), "exact", precision)


@pytest.mark.parametrize("precision", ["half", "hybrid"])
def test_running_average_over_many_blocks(precision, gen):
    """block_n=32 gives 5 key blocks (tail 22) whose means drift: avg_j, delta_j and eps_j all matter."""
    shape = (1, 2, 1, 50, 150, 32)
    q, k, v = _biased_inputs(shape, gen, bias=2.0)
    k = (k.float() + torch.linspace(0.0, 6.0, 150)[:, None]).half()  # a bias growing along the keys
    out = _kernel(q, k, v, "pasa", precision, block_n=32)
    ref = pasa_reference(q, k, v, precision=precision, block_n=32)
    _assert_within_bound(out, ref, golden_attention(q, k, v), "pasa", precision)


@pytest.mark.parametrize("beta", [0.5, optimal_beta(128, torch.float16, 1.0, start=1.0 - 2.0 ** -6)],
                         ids=["0.5", "0.9845"])
@pytest.mark.parametrize("precision", ["half", "hybrid"])
def test_other_beta(precision, beta, gen):
    q, k, v = _biased_inputs((1, 2, 2, 40, 200, 64), gen, bias=4.0)
    out = _kernel(q, k, v, "pasa", precision, beta=beta)
    ref = pasa_reference(q, k, v, precision=precision, beta=beta)
    _assert_within_bound(out, ref, golden_attention(q, k, v), "pasa", precision)


@pytest.mark.parametrize("precision", ["half", "hybrid"])
def test_prepass_shift_equals_fused_shift(precision, gen):
    """The pre-pass (``prepass.shift_keys``) computes the very same shifted keys as the fused loop."""
    q, k, v = _biased_inputs((1, 4, 2, 70, 300, 80), gen)
    fused = _kernel(q, k, v, "pasa", precision, prepass=False)
    prepass = _kernel(q, k, v, "pasa", precision, prepass=True)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, prepass)


@pytest.mark.parametrize("shape", [(3, 2, 2, 25, 25, 64), (2, 2, 1, 70, 32, 80), (1, 1, 1, 128, 128, 64)],
                         ids=["temporal-25,ragged", "gqa,nk=32,d80", "nk=128"])
@pytest.mark.parametrize("precision", ["half", "hybrid"])
def test_exact_centring_in_the_loop_equals_the_prepass(precision, shape, gen):
    """All keys in one block: the portable kernel centres its key tile itself (what it does unless told
    otherwise) with the pre-pass's ``centre_tile``: the same centres, the same bits."""
    q, k, v = _biased_inputs(shape, gen, bias=20.0)
    fused = _kernel(q, k, v, "exact", precision, kernel="portable")
    assert dispatch.plan(q, k, v, fused, variant=Variant("exact", precision), kernel="portable").prepass is None
    prepass = _kernel(q, k, v, "exact", precision, kernel="portable", prepass=True)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, prepass)
    _assert_within_bound(fused, _reference(q, k, v, "exact", precision), golden_attention(q, k, v), "exact",
                         precision)


@pytest.mark.parametrize("shape", [(3, 3, 3, 25, 25, 64), (2, 4, 2, 14, 9, 80), (1, 3, 3, 1, 40, 16),
                                   (1, 1, 1, 64, 64, 32)],
                         ids=["temporal-25,odd-seqs", "gqa,nq!=nk,d80", "one-row,d16", "nk=64"])
@pytest.mark.parametrize("precision,dtype", [("half", torch.float16), ("hybrid", torch.float16),
                                             ("hybrid", torch.bfloat16)], ids=["half", "hybrid", "hybrid-bf16"])
def test_packed_sequences_equal_the_loop(precision, dtype, shape, gen):
    """Several whole sequences per program (``packed.py``, what "auto" picks for short one-block
    sequences) compute what the loop computes: the same centres, the same roundings, with the centred
    keys subtracted in fp32 or in the GEMM dtype (``CENTRE_IN_G``), so every packed config gives the same
    bits.  Against the loop each element is equal or one ulp of the dtype apart: the loop's key tile has
    another padded length, and the interpreter's numpy dot then sums the same fp32 products in another
    order (seed 2530032314: 1 of 8960 outputs one ulp apart at d80).  The odd batch x heads leaves the
    last program with a padded sequence slot; inputs are (B, N, H, D) memory, as diffusers'."""
    b, hq, hk, nq, nk, d = shape
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in _biased_inputs(shape, gen, bias=20.0, dtype=dtype))
    assert dispatch.plan(q, k, v, q, variant=Variant("exact", precision)).kernel == "packed"
    packed = _kernel(q, k, v, "exact", precision)
    fused = _kernel(q, k, v, "exact", precision, kernel="portable")
    assert torch.isfinite(packed).all()
    assert (_ulps_apart(packed, fused) <= 1).all()
    assert torch.equal(_kernel(q, k, v, "exact", precision, kernel="packed"), packed)
    assert torch.equal(_kernel(q, k, v, "exact", precision, config={"CENTRE_IN_G": True}), packed)
    _assert_within_bound(packed, _reference(q, k, v, "exact", precision), golden_attention(q, k, v), "exact",
                         precision)


@pytest.mark.parametrize("tokens,head_dim", [(16, 64), (32, 64), (64, 64), (32, 128), (64, 256), (16, 16)])
def test_packed_configs_fit_and_use_the_fewest_warps(tokens, head_dim):
    """The packed kernel's autotune pool, pruned: every config's tiles fit ``TILE_PER_WARP``
    elements per warp, no config that fits has fewer warps, and some config fits every legal shape."""
    kept = packed._prune(packed.CONFIGS, {}, BLOCK_Q=tokens, BLOCK_K=tokens, BLOCK_D=head_dim)
    per_warp = [c.kwargs["SEQS"] * tokens * head_dim / c.num_warps for c in kept]
    assert kept and max(per_warp) <= packed.TILE_PER_WARP
    fitting = [c for c in packed.CONFIGS
               if c.kwargs["SEQS"] * tokens * head_dim <= packed.TILE_PER_WARP * c.num_warps]
    assert {c.num_warps for c in kept} == {min(c.num_warps for c in fitting)}


@pytest.mark.parametrize("shape,shift,block_n,match", [
    ((1, 1, 1, 65, 65, 32), "exact", None, "kernel='packed' cannot run this call: it takes sequences of at most 64 "
                                           "queries and keys in one key block; got 65 queries"),
    ((1, 1, 1, 8, 40, 32), "exact", 16, r"got 8 queries and 40 keys \(block_n=16\)"),
    ((1, 1, 1, 8, 8, 32), "pasa", None, "kernel='packed' is the exact shift's; got shift='pasa'"),
])
def test_packed_refuses_what_it_cannot_take(shape, shift, block_n, match, gen):
    q, k, v = _biased_inputs(shape, gen)
    with pytest.raises(ValueError, match=match):
        dispatch.forward(q, k, v, torch.empty_like(q), scale=0.125, variant=Variant(shift, "hybrid"),
                         beta=DEFAULT_BETA, kernel="packed", block_n=block_n)


@pytest.mark.parametrize("shape,shift,kernel,match", [
    ((1, 2, 2, 300, 300, 64), "exact", "gluon", "kernel='gluon' cannot run this call: Triton's interpreter runs no Gluon"),
    ((1, 2, 2, 30, 30, 64), "exact", "gluon", "kernel='gluon' cannot run this call: all keys form one block"),
    ((1, 2, 2, 300, 300, 64), "pasa", "gluon", "kernel='gluon' is the exact shift's; got shift='pasa'"),
    ((1, 2, 2, 300, 300, 64), "exact", "cudnn",
     re.escape(f"unknown kernel='cudnn'; expected one of {dispatch.KERNELS}")),
])
def test_kernel_choice_refuses_what_it_cannot_run(shape, shift, kernel, match, gen):
    """A kernel named explicitly says why it cannot run a call rather than running another kernel."""
    q, k, v = _biased_inputs(shape, gen)
    with pytest.raises(ValueError, match=match):
        dispatch.forward(q, k, v, torch.empty_like(q), scale=0.125, variant=Variant(shift, "hybrid"),
                         beta=DEFAULT_BETA, kernel=kernel)


def test_auto_and_portable_kernels_agree_off_hopper(gen):
    """Where Gluon cannot run (here: the interpreter), ``kernel="auto"`` is the portable kernel, and the
    plan says why not the others."""
    q, k, v = _biased_inputs((1, 2, 2, 300, 300, 64), gen)
    plan = dispatch.plan(q, k, v, q, variant=Variant())
    assert (plan.kernel, plan.prepass) == ("portable", "centre")
    assert set(plan.rejected) == set(dispatch.kernel_names()) - {"portable"}
    assert {name: plan.rejected[name] for name in ("packed", "gluon", "gluon-int8", "portable-int8")} == {
        "packed": "it takes sequences of at most 64 queries and keys in one key block; got 300 queries and 300 keys "
                  "(block_n=128)",
        "gluon": "Triton's interpreter runs no Gluon",
        "gluon-int8": "it runs the 8-bit precisions, not precision='hybrid'",
        "portable-int8": "it runs the 8-bit precisions, not precision='hybrid'"}
    assert plan.describe().startswith("portable + centre pre-pass (not packed: it takes")
    assert torch.equal(_kernel(q, k, v, "exact", "hybrid"), _kernel(q, k, v, "exact", "hybrid", kernel="portable"))


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose data starts 2 bytes past a 16-byte boundary (same shape and strides)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    return flat.view(t.shape).copy_(t)


def test_plans_are_kept_per_call_signature(gen):
    """A repeated call gets the kept plan (the same object: no routing again) whatever its tensors' data; a
    change of anything the routing reads (the keys' count, a stride, the dtype, the 16-byte alignment of a TMA
    operand, the variant, the kernel, the pre-pass, the config) is planned on its own, and every kept plan
    equals a fresh one."""
    dispatch.forget_plans()
    q, k, v = _biased_inputs((1, 2, 2, 300, 300, 64), gen)
    out = torch.empty_like(q)
    first = dispatch.plan(q, k, v, out, variant=Variant())
    assert dispatch.plan(q.clone(), k.clone(), v.clone(), torch.empty_like(q), variant=Variant()) is first
    bnhd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    calls = {
        "keys": ((q, k[:, :, :200], v[:, :, :200], out), {}),
        "strides": ((*bnhd, out), {}),
        "dtype": (tuple(t.bfloat16() for t in (q, k, v, out)), {}),
        "aligned q": ((_misaligned(q), k, v, out), {}),
        "aligned v": ((q, k, _misaligned(v), out), {}),
        "aligned out": ((q, k, v, _misaligned(out)), {}),
        "variant": ((q, k, v, out), {"variant": Variant("pasa", "hybrid")}),
        "kernel": ((q, k, v, out), {"kernel": "portable"}),
        "prepass": ((q, k, v, out), {"prepass": True}),
        "block_n": ((q, k, v, out), {"block_n": 64}),
        "config": ((q, k, v, out), {"config": {"BLOCK_M": 64}}),
        "int8": ((q, k, v, out), {"variant": Variant("exact", "int8")}),
        "pv_bits": ((q, k, v, out), {"variant": Variant("exact", "int8"), "pv_bits": 8}),
        "fallback": ((q, k, v, out), {"variant": Variant("exact", "int8"), "fallback": False}),
    }
    kept = {}
    for name, (tensors, options) in calls.items():
        kept[name] = dispatch.plan(*tensors, **{"variant": Variant(), **options})
        assert kept[name] is not first, name
        assert dispatch.plan(*tensors, **{"variant": Variant(), **options}) is kept[name], name
    assert kept["variant"].prepass == "shift"
    assert kept["int8"].kernel == "portable-int8" and kept["pv_bits"] is not kept["int8"] is not kept["fallback"]
    dispatch.forget_plans()
    assert dispatch.plan(q, k, v, out, variant=Variant()) == first
    for name, (tensors, options) in calls.items():
        fresh = dispatch.plan(*tensors, **{"variant": Variant(), **options})
        assert fresh == kept[name] and fresh is not kept[name], name


@pytest.mark.parametrize("tile", [16, 32, 64])
@pytest.mark.parametrize("precision", ["half", "hybrid"])
def test_exact_tiles_smaller_than_the_centre_block(precision, tile, gen):
    """Keys centred per block of 128 by the pre-pass, attended in tiles of 16-64 keys (what the tiled
    autotune pool may pick): each tile reads its block's centre; the same math as one tile per block,
    only the online softmax rescales at other points."""
    q, k, v = _biased_inputs((1, 4, 2, 70, 300, 80), gen, bias=20.0)
    out = _kernel(q, k, v, "exact", precision, config={"BLOCK_N": tile})
    whole = _kernel(q, k, v, "exact", precision)
    gold = golden_attention(q, k, v)
    _assert_within_bound(out, _reference(q, k, v, "exact", precision), gold, "exact", precision)
    assert numerics.rel_rmse(out, whole) <= K_BOUND["exact", precision] * numerics.rel_rmse(whole, gold)


@pytest.mark.parametrize("tile", [48, 256])
def test_exact_tile_must_divide_the_centre_block(tile, gen):
    q, k, v = _biased_inputs((1, 1, 1, 16, 300, 32), gen)
    with pytest.raises(ValueError, match=f"config\\['BLOCK_N'\\]={tile} must be a power of two >= 16 that divides"):
        _kernel(q, k, v, "exact", "hybrid", config={"BLOCK_N": tile})


def test_exact_centring_in_the_loop_needs_one_block(gen):
    q, k, v = _biased_inputs((1, 1, 1, 16, 130, 32), gen)
    with pytest.raises(ValueError, match="no kernel can run this call: packed: .*; portable: prepass=False: it "
                                         "centres keys inside the loop only when all 130 keys"):
        _kernel(q, k, v, "exact", "hybrid", prepass=False)


@pytest.mark.parametrize("options,kind,precision", [({}, "exact", "hybrid"), ({"precision": "half", "shift": "pasa"},
                                                                                 "pasa", "half")],
                         ids=["default", "paper-half"])
def test_through_pasa_attention(monkeypatch, gen, options, kind, precision):
    """``ops.pasa_attention`` on CPU tensors with TRITON_INTERPRET=1 runs this kernel (bnhd layout); its
    default is the exact shift in hybrid."""
    from pasa_diffusers.ops import pasa_attention

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    b, hq, hk, n, d = 1, 4, 2, 90, 64
    q, k, v = (t.transpose(1, 2).contiguous() for t in _biased_inputs((b, hq, hk, n, n, d), gen))
    out = pasa_attention(q, k, v, layout="bnhd", **options)
    direct = _kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kind, precision)
    assert out.shape == (b, n, hq, d)
    assert torch.equal(out.transpose(1, 2), direct)


def test_through_pasa_attention_rejects_what_the_kernels_cannot_run(monkeypatch, gen):
    """The op checks the inputs once, before the kernels (which take them as they come)."""
    from pasa_diffusers.ops import pasa_attention

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _biased_inputs((1, 2, 2, 16, 16, 32), gen)
    strided = torch.randn(1, 2, 16, 64, generator=gen).half()[..., ::2]
    with pytest.raises(ValueError, match=r"^pasa_attention: q must have unit stride in the head dim"):
        pasa_attention(strided, k, v, precision="half", shift="pasa")
    with pytest.raises(ValueError, match="dtype torch.bfloat16 is not supported for precision='half'"):
        pasa_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), precision="half", shift="pasa")
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        pasa_attention(q, k[:, :1].expand(1, 3, 16, 32), v[:, :1].expand(1, 3, 16, 32), precision="half")


def test_dispatch_refuses_unknown_options(gen):
    q, k, v = _biased_inputs((1, 2, 2, 16, 16, 32), gen)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match=r"^dispatch.plan: precision='fp64' has no kernel"):
        dispatch.forward(q, k, v, out, scale=0.2, variant=Variant("exact", "fp64"), beta=0.9)
    with pytest.raises(ValueError, match=r"^dispatch.plan: prepass must be None \(auto\), True or False"):
        dispatch.forward(q, k, v, out, scale=0.2, variant=Variant(), beta=0.9, prepass="yes")
    with pytest.raises(ValueError, match="plain FlashAttention \\(shift='none'\\) has no key pre-pass"):
        dispatch.forward(q, k, v, out, scale=0.2, variant=Variant("none", "half"), beta=0.9, prepass=True)
    with pytest.raises(ValueError, match="block_n is the shift block"):
        dispatch.forward(q, k, v, out, scale=0.2, variant=Variant("none", "half"), beta=0.9, block_n=64)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(3, 4, 2, 130, 257, 64), (4, 1, 1, 130, 130, 32), (1, 6, 6, 70, 300, 80)],
                         ids=["gqa,head-ranges", "batch-ranges", "head-ranges,d80"])
@pytest.mark.parametrize("kind,precision", [("exact", "hybrid"), ("exact", "half"), ("pasa", "hybrid")],
                         ids=["exact-hybrid", "exact-half", "pasa-hybrid"])
def test_key_ranges_one_after_the_other_give_the_whole_calls_bits(monkeypatch, kind, precision, shape, gen):
    """A call whose pre-pass copy of the keys would exceed ``PREPASS_SHARE`` of the output runs in ranges of
    batch and kv head: every head is attended as in one launch, so the output and the LSE keep their bits
    (through (B, N, H, D) views too)."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _biased_inputs(shape, gen, bias=20.0))
    options = {"kernel": "portable", "prepass": True}
    variant = Variant(kind, precision)
    monkeypatch.setattr(dispatch, "MIN_RANGE_FLOP", 1.0)
    assert len(dispatch.key_chunks(k, q)) > 1

    def run():
        out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"))
        dispatch.forward(q, k, v, out, scale=0.125, variant=variant, beta=DEFAULT_BETA, lse=lse, **options)
        return out, lse

    ranged_out, ranged_lse = run()
    monkeypatch.setattr(dispatch, "PREPASS_SHARE", 1e9)
    assert dispatch.key_chunks(k, q) == [((0, shape[0]), (0, shape[2]))]
    whole_out, whole_lse = run()
    assert torch.isfinite(whole_out).all() and torch.isfinite(whole_lse).all()
    assert torch.equal(ranged_out, whole_out) and torch.equal(ranged_lse, whole_lse)


@pytest.mark.parametrize("shape,keys", [((2, 12, 32760, 128), 32760), ((1, 40, 32760, 128), 32760),
                                        ((2, 48, 17776, 64), 17776), ((50, 5, 9216, 64), 9216),
                                        ((50, 20, 576, 64), 576), ((50, 10, 2304, 64), 2304),
                                        ((2, 24, 4096, 128), 512), ((3, 7, 100, 64), 100), ((1, 1, 4096, 64), 4096),
                                        ((3, 5, 40000, 128), 40000), ((1, 3, 75600, 128), 75600)],
                         ids=["wan", "wan-14b", "cogvideox", "svd-9216", "svd-576", "svd-2304", "cross-attention",
                              "odd-heads", "one-head", "odd-long", "three-heads-long"])
def test_key_ranges_cover_every_head_once_within_the_share(shape, keys):
    """The ranges of :func:`key_chunks` cover each (batch, kv head) exactly once; where the call's work fills
    its ranges (twice :data:`MIN_RANGE_FLOP` per range the copy needs), each range's copy of the keys is within
    ``PREPASS_SHARE`` of the output (unless it is one head); a call of less than twice that work runs in one
    range, and no range of a ranged call holds less than half of it."""
    batch, heads, queries, dim = shape
    out = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    k = torch.empty((batch, heads, keys, dim), dtype=torch.bfloat16, device="meta")
    ranges = dispatch.key_chunks(k, out)
    covered = [(b, h) for (b0, b1), (h0, h1) in ranges for b in range(b0, b1) for h in range(h0, h1)]
    assert sorted(covered) == [(b, h) for b in range(batch) for h in range(heads)]
    per_head = keys * dim * k.element_size()
    work_per_head = 4.0 * queries * keys * dim
    budget = dispatch.PREPASS_SHARE * out.numel() * out.element_size()
    needed = math.ceil(batch * heads * per_head / budget)
    if batch * heads * work_per_head >= 2 * dispatch.MIN_RANGE_FLOP * needed:
        for (b0, b1), (h0, h1) in ranges:
            assert (b1 - b0) * (h1 - h0) == 1 or (b1 - b0) * (h1 - h0) * per_head <= budget
    if batch * heads * work_per_head < 2 * dispatch.MIN_RANGE_FLOP:
        assert len(ranges) == 1
    if len(ranges) > 1:
        assert min((b1 - b0) * (h1 - h0) for (b0, b1), (h0, h1) in ranges) * work_per_head >= \
            dispatch.MIN_RANGE_FLOP / 2
    assert len(ranges) == 1 or batch * heads * per_head > budget
