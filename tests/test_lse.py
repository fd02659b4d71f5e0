"""The log-sum-exp (``return_lse=True``): every variant, layout and kernel path against the exact one.

``lse`` is the natural-log log-sum-exp per query row of the true logits ``scale q . k``; ring attention
merges partial outputs by it, ``out = sum_i exp(lse_i - lse) out_i``, so an error ``d`` in ``lse`` is a
relative error ``d`` in a chunk's weight.  The error measure is therefore absolute:
``err_lse(x) = RMS over rows of |lse_x - lse_gold|``, ``lse_gold = logsumexp(scale q k^T)`` in float64
of the same fp16/bf16 inputs (``golden_attention(..., return_lse=True)``).

Bounds, each derived, none measured:

- ``"fp64"`` (the golden attention, PASA in float64): exact in real arithmetic, so within float64
  rounding of the largest logit, ``FP64_REL * max|lse|``.  For PASA this checks the recovered offset's
  algebra (``lse = m + log(l) + o_J``, ``o_J = gamma_J mu_J - delta_J``) on multi-block, ragged, GQA
  inputs.
- FP32-score FlashAttention (``flash_reference("hybrid")``, the FP32-accumulating reference), a priori
  per row: ``l`` sums ``p`` rounded to the GEMM dtype (relative ``u_g``), the fp32 score GEMM errs by at
  most ``D 2^-24 scale max_j sum_i |q_i k_ji|``, and the fp32 steps around it (``s * scale``,
  ``s - m``, ``exp``, the sum of ``n`` weights, ``m + log l``) by a few fp32 ulps of the largest
  logit and ``n 2^-24``;
- the exact shift in hybrid is FP32-score FA's accuracy (``test_exact_shift.py``'s criterion):
  ``err_lse <= 2 err_lse(FA hybrid) + FLOOR``; in half, where FA half is finite, ``<= 2 err_lse(FA
  half) + FLOOR`` (fp16 scores of centred keys only, fp32 ``m`` and ``l``);
- PASA in hybrid against ``logsumexp`` of its own logits, ``S' + gamma_j rowmean(S')`` of its rounded
  shifted keys in float64: FA hybrid's a priori terms plus the fp32 recovery's.  Against the true
  logits PASA's LSE also carries the rounding of its shifted keys, summed into the block mean and
  multiplied by gamma (15): an error its output does not see, since one block's softmax drops a
  common offset (measured here 4e-3 to 8e-2 against FA hybrid's 1e-4, all of it that model error);
  PASA in half is held to its reference only through the kernels;
- every kernel path (the interpreter): ``err_lse(kernel) <= K err_lse(reference of the same variant)
  + FLOOR`` with ``test_kernel_interpret.py``'s ``K`` (2; 3 for the exact shift in half) and for the
  same reasons (the same roundings, another summation order; the kernels form the LSE in log2 units
  where their state is, the references in natural units);
- the ring identity: the two halves of the keys, merged by their LSE, reproduce the full attention
  as accurately as one call, ``err(merged) <= 2 err(full) + FLOOR`` (``err`` the output's relative
  RMSE against the golden output) for the exact shift and plain FA.  A merge of PASA chunks moves
  weight between them by the difference of their LSE errors ``d_1 - d_2`` (above), at most
  ``|d_1 - d_2| / 4`` of ``o_1 - o_2`` per row (the slope of the sigmoid), so PASA's merge is held to
  ``2 (err(full) + E)`` with ``E`` that shift computed from the reference's own LSE errors; the
  kernels' merges (through the op, ``bnhd``) to ``K`` times the references' merge.

``FLOOR = 2^-23 RMS|lse_gold|`` is one fp32 ulp of the LSE: the fp32 output's own rounding, which no
path can beat and two paths may round apart.  LSE buffers start NaN-poisoned, so a finite LSE shows
every row was written.
"""
from __future__ import annotations

import math
import platform
from pathlib import Path

import pytest
import torch

from pasa_diffusers import cpu_math, numerics, pasa_attention
from pasa_diffusers.shift_matrix import gamma as recovery_gamma
from pasa_diffusers.shift_matrix import shift_entries
from pasa_diffusers.reference import (DEFAULT_BETA, exact_shift_reference, flash_reference, gemm_dtype,
                                      golden_attention, pasa_reference)
from pasa_diffusers.variants import Variant


def _interpreted() -> bool:
    try:
        from pasa_diffusers.kernels.common import INTERPRET
    except ImportError:  # no triton
        return False
    return INTERPRET


interpreted = pytest.mark.skipif(not _interpreted(), reason="kernels built for the GPU (or no triton); set "
                                 "TRITON_INTERPRET=1 before pytest starts to run them on the CPU")
overflow_expected = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")

EPS32 = 2.0 ** -24
FP64_REL = 2.0 ** -40
K_BOUND = {("pasa", "half"): 2.0, ("pasa", "hybrid"): 2.0, ("none", "half"): 2.0, ("none", "hybrid"): 2.0,
           ("exact", "hybrid"): 2.0, ("exact", "half"): 3.0}
VARIANTS = list(K_BOUND)
REFERENCES = {"exact": exact_shift_reference, "pasa": pasa_reference, "none": flash_reference}

# name: ((B, Hq, Hk, Nq, Nk, D), q bias, k bias, k drift over the keys)
CASES = {
    "3-blocks,tail44,gqa": ((1, 4, 2, 70, 300, 32), 3.0, 3.0, 0.0),
    "k-bias-30": ((1, 2, 1, 40, 300, 64), 0.0, 30.0, 0.0),
    "drift-0->20,no-tail": ((1, 2, 1, 50, 256, 32), 2.0, 2.0, 20.0),
    "one-block,ragged": ((1, 2, 2, 33, 100, 32), 3.0, 3.0, 0.0),
    "one-block,nk=64": ((1, 2, 1, 20, 64, 32), 3.0, 3.0, 0.0),
    "temporal-25,bias-20": ((3, 2, 2, 25, 25, 64), 20.0, 20.0, 0.0),
}
OVERFLOW = {"q,k-bias-40": ((1, 2, 1, 20, 200, 64), 40.0, 40.0, 0.0)}
"""Raw scores q . k of about 1e5 > 65504: the naive half control overflows, every other variant does not."""


def _inputs(case: str, gen: torch.Generator, dtype=torch.float16):
    (b, hq, hk, nq, nk, d), q_bias, k_bias, drift = {**CASES, **OVERFLOW}[case]
    q = torch.randn(b, hq, nq, d, generator=gen) + q_bias
    k = torch.randn(b, hk, nk, d, generator=gen) + k_bias + drift * torch.linspace(0.0, 1.0, nk)[:, None]
    v = torch.randn(b, hk, nk, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _err_lse(lse: torch.Tensor, gold: torch.Tensor) -> float:
    return (lse.double() - gold).pow(2).mean().sqrt().item()


def _floor(gold: torch.Tensor) -> float:
    return 2 * EPS32 * gold.pow(2).mean().sqrt().item()


def _err(out: torch.Tensor, gold: torch.Tensor) -> float:
    return numerics.rel_rmse(out, gold) if torch.isfinite(out).all() else float("nan")


def _reference(q, k, v, shift, precision, **options):
    return REFERENCES[shift](q, k, v, precision=precision, return_lse=True, **options)


def _kernel(q, k, v, shift, precision, **options):
    """``dispatch.forward`` into a NaN-poisoned output and LSE: (out, lse)."""
    from pasa_diffusers.kernels import dispatch

    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"))
    result = dispatch.forward(q, k, v, out, scale=1.0 / math.sqrt(q.shape[-1]), variant=Variant(shift, precision),
                              beta=DEFAULT_BETA, lse=lse, **options)
    assert result is out
    return out, lse


def _merge(o1, l1, o2, l2):
    """Two partial outputs merged by their LSE in float64, as diffusers' ring does (in fp32)."""
    lse = torch.logaddexp(l1.double(), l2.double())
    w1, w2 = torch.exp(l1.double() - lse)[..., None], torch.exp(l2.double() - lse)[..., None]
    return w1 * o1.double() + w2 * o2.double(), lse


def _halves(q, k, v):
    """The keys split into two chunks off the 128-key block grid (each chunk blocks its keys anew)."""
    h = k.shape[2] // 2 + 7 if k.shape[2] > 50 else k.shape[2] // 2 - 1
    return (k[:, :, :h], v[:, :, :h]), (k[:, :, h:], v[:, :, h:])


# --- the references ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_fp64_lse_is_exact(case, gen):
    q, k, v = _inputs(case, gen)
    gold_out, gold = golden_attention(q, k, v, return_lse=True)
    assert gold.dtype == torch.float64 and gold.shape == q.shape[:3]
    expected = torch.logsumexp((q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).mT)
                               / math.sqrt(q.shape[-1]), dim=-1)
    tol = FP64_REL * expected.abs().max().item()
    assert (gold - expected).abs().max().item() <= tol
    for block_n in (128, 32):
        out, lse = pasa_reference(q, k, v, precision="fp64", block_n=block_n, return_lse=True)
        assert lse.dtype == torch.float64
        assert (lse - expected).abs().max().item() <= tol, f"PASA fp64 block_n={block_n}"
        assert (out - gold_out).abs().max().item() < 1e-10


def _fa_hybrid_bound(q, k, gold):
    """The a priori per-row bound of FP32-score FlashAttention's LSE error (module docstring)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    k_rep = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    abs_dot = q.double().abs() @ k_rep.abs().mT
    logits = scale * (q.double() @ k_rep.mT)
    u_g = torch.finfo(gemm_dtype(q.dtype)).eps / 2
    gemm = q.shape[-1] * EPS32 * scale * abs_dot.amax(-1)
    fp32_steps = EPS32 * (6 * logits.abs().amax(-1) + gold.abs() + 4 + k.shape[2])
    return math.log1p(u_g / (1 - u_g)) + gemm + fp32_steps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_references_at_fp32_accuracy(case, dtype, gen):
    q, k, v = _inputs(case, gen, dtype)
    _, gold = golden_attention(q, k, v, return_lse=True)
    _, fa = flash_reference(q, k, v, precision="hybrid", return_lse=True)
    assert fa.dtype == torch.float32 and fa.shape == q.shape[:3]
    excess = (fa.double() - gold).abs() - _fa_hybrid_bound(q, k, gold)
    assert excess.max().item() <= 0.0, f"FA hybrid LSE above its a priori bound by {excess.max().item():.2e}"
    _, exact = exact_shift_reference(q, k, v, precision="hybrid", return_lse=True)
    err, err_fa = _err_lse(exact, gold), _err_lse(fa, gold)
    bound = 2.0 * err_fa + _floor(gold)
    assert err <= bound, f"exact hybrid LSE error {err:.3e} > {bound:.3e} (FA hybrid {err_fa:.3e})"


def _pasa_logits(q, k, block_n=128):
    """PASA's own model of the true logits in float64, per block ``j``: ``S' + gamma_j rowmean(S')`` with
    ``S' = q k_shift^T`` of its rounded shifted keys (``reference.pasa_reference``'s step 1, from the
    stored entries); also ``max|S'|``, ``max|rowmean(S')|`` per row, ``max_j sum_i |q_i k_shift_ji|``."""
    g, scale = gemm_dtype(q.dtype), 1.0 / math.sqrt(q.shape[-1])
    k_rep = k.to(g).repeat_interleave(q.shape[1] // k.shape[1], 1)
    logits, s_abs, mu_abs, dot_abs = [], [], [], []
    for start in range(0, k.shape[2], block_n):
        k_blk = k_rep[:, :, start:start + block_n].float()
        diag, off = shift_entries(DEFAULT_BETA, k_blk.shape[2], g, scale)
        k_shift = ((diag - off) * k_blk + off * k_blk.sum(-2, keepdim=True)).to(g).double()
        s = q.double() @ k_shift.mT
        mu = s.mean(-1, keepdim=True)
        logits.append(s + recovery_gamma(DEFAULT_BETA, k_blk.shape[2], g, scale) * mu)
        s_abs.append(s.abs().amax(-1))
        mu_abs.append(mu.abs().squeeze(-1))
        dot_abs.append((q.double().abs() @ k_shift.abs().mT).amax(-1))
    top = (lambda xs: torch.stack(xs).amax(0))
    return torch.cat(logits, -1), top(s_abs), top(mu_abs), top(dot_abs)


@pytest.mark.parametrize("case", list(CASES))
def test_pasa_hybrid_lse_is_the_lse_of_its_own_logits(case, gen):
    """PASA hybrid's LSE against ``logsumexp`` of its own logit model (``_pasa_logits``, float64): within
    FA hybrid's a priori terms for those logits plus the fp32 recovery, ``gamma`` times a few fp32
    roundings of the block mean per block (``mu``, ``avg_j``, ``delta_j``, ``eps_j``, ``o_J``) and the mean's
    fp32 sum of ``n`` scores.  (Against the true logits it also carries the rounding of its shifted
    keys, times gamma through the mean: the variant's error, which the kernels are held to.)"""
    q, k, v = _inputs(case, gen)
    _, lse = pasa_reference(q, k, v, precision="hybrid", return_lse=True)
    logits, s_abs, mu_abs, dot_abs = _pasa_logits(q, k)
    model = torch.logsumexp(logits, dim=-1)
    n_k, blocks = k.shape[2], -(-k.shape[2] // 128)
    gam = recovery_gamma(DEFAULT_BETA, min(128, n_k), torch.float16, 1.0 / math.sqrt(q.shape[-1]))
    u_g = torch.finfo(torch.float16).eps / 2
    bound = (math.log1p(u_g / (1 - u_g)) + q.shape[-1] * EPS32 * dot_abs
             + EPS32 * (6 * logits.abs().amax(-1) + model.abs() + 4 + n_k)
             + EPS32 * gam * (8 * (blocks + 1) * mu_abs + min(128, n_k) * s_abs))
    excess = (lse.double() - model).abs() - bound
    assert excess.max().item() <= 0.0, f"PASA hybrid LSE {excess.max().item():.2e} above its bound off its own logits"


@overflow_expected
@pytest.mark.parametrize("case", list(CASES))
def test_exact_half_lse_within_fa_half(case, gen):
    q, k, v = _inputs(case, gen)
    _, gold = golden_attention(q, k, v, return_lse=True)
    _, exact = exact_shift_reference(q, k, v, precision="half", return_lse=True)
    _, fa = flash_reference(q, k, v, precision="half", return_lse=True)
    assert torch.isfinite(exact).all()
    if torch.isfinite(fa).all():
        err, err_fa = _err_lse(exact, gold), _err_lse(fa, gold)
        assert err <= 2.0 * err_fa + _floor(gold), f"exact half {err:.3e} > 2 x FA half {err_fa:.3e}"


def _ring_check(parts, full, gold_full, gold_lse_parts, gold_out, shift):
    """The ring identity's bound (module docstring) for one path's halves ``parts`` and ``full`` call."""
    (o1, l1), (o2, l2) = parts
    merged, lse = _merge(o1, l1, o2, l2)
    err_merged, err_full = _err(merged, gold_out), _err(full[0], gold_out)
    bound = 2.0 * err_full
    if shift == "pasa":
        d = (l1.double() - gold_lse_parts[0]) - (l2.double() - gold_lse_parts[1])
        moved = (d.abs()[..., None] / 4) * (o1.double() - o2.double())
        bound = 2.0 * (err_full + moved.pow(2).mean().sqrt().item() / gold_out.pow(2).mean().sqrt().item())
    return err_merged, bound + _floor(gold_full), lse


@overflow_expected
@pytest.mark.parametrize("case", ["3-blocks,tail44,gqa", "k-bias-30", "drift-0->20,no-tail", "temporal-25,bias-20"])
@pytest.mark.parametrize("shift,precision", VARIANTS, ids=[f"{s}-{p}" for s, p in VARIANTS])
def test_reference_halves_merge_to_the_full_attention(shift, precision, case, gen):
    q, k, v = _inputs(case, gen)
    gold_out, gold = golden_attention(q, k, v, return_lse=True)
    full = _reference(q, k, v, shift, precision)
    halves = _halves(q, k, v)
    parts = [_reference(q, kh, vh, shift, precision) for kh, vh in halves]
    gold_parts = [golden_attention(q, kh, vh, return_lse=True)[1] for kh, vh in halves]
    err, bound, lse = _ring_check(parts, full, gold, gold_parts, gold_out, shift)
    assert err <= bound, f"merged {err:.3e} > {bound:.3e} (full {_err(full[0], gold_out):.3e})"
    assert _err_lse(lse, gold) <= 2.0 * max(_err_lse(p[1], g) for p, g in zip(parts, gold_parts)) + _floor(gold)


# --- the public op ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("shift,precision", VARIANTS + [("exact", "fp64"), ("pasa", "fp64")],
                         ids=[f"{s}-{p}" for s, p in VARIANTS] + ["exact-fp64", "pasa-fp64"])
def test_op_returns_the_reference_lse_in_bhn(shift, precision, layout, gen):
    """CPU tensors: the op's ``(out, lse)`` is the reference's, ``lse`` (B, Hq, Nq) whatever the layout,
    and ``out`` the same bits as without ``return_lse``."""
    q, k, v = _inputs("one-block,ragged", gen)
    view = (lambda t: t.transpose(1, 2)) if layout == "bnhd" else (lambda t: t)
    args = [view(t) for t in (q, k, v)]
    out, lse = pasa_attention(*args, precision=precision, shift=shift, layout=layout, return_lse=True)
    assert lse.shape == q.shape[:3] and lse.is_contiguous()
    assert lse.dtype == (torch.float64 if precision == "fp64" else torch.float32)
    assert torch.equal(out, pasa_attention(*args, precision=precision, shift=shift, layout=layout))
    if precision == "fp64":
        ref_out, ref_lse = (golden_attention(q, k, v, return_lse=True) if shift == "exact"
                            else pasa_reference(q, k, v, precision="fp64", return_lse=True))
    else:
        ref_out, ref_lse = _reference(q, k, v, shift, precision)
    assert torch.equal(view(out), ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("q_shape,kv_shape", [((0, 2, 40, 32), (0, 2, 40, 32)), ((1, 2, 0, 32), (1, 2, 40, 32))],
                         ids=["batch-0", "no-queries"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_empty_inputs_return_an_empty_lse(q_shape, kv_shape, layout, gen):
    q = torch.randn(*q_shape, generator=gen).half()
    k, v = (torch.randn(*kv_shape, generator=gen).half() for _ in range(2))
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out, lse = pasa_attention(q, k, v, layout=layout, return_lse=True)
    assert out.shape == q.shape and out.numel() == 0
    assert lse.shape == (q_shape[0], q_shape[1], q_shape[2]) and lse.dtype == torch.float32 and lse.numel() == 0


@pytest.mark.parametrize("value", [1, "yes", None])
def test_return_lse_must_be_a_bool(value, gen):
    q = torch.randn(1, 2, 8, 32, generator=gen).half()
    with pytest.raises(ValueError, match=rf"^pasa_attention: return_lse must be a bool, got return_lse={value!r}"):
        pasa_attention(q, q, q, return_lse=value)


NUMERICS = Path(__file__).resolve().parents[1] / "docs" / "NUMERICS.md"
TABLE_COLUMNS = {"exact hybrid": ("exact", "hybrid"), "exact half": ("exact", "half"), "PASA hybrid": ("pasa", "hybrid"),
                 "PASA half": ("pasa", "half"), "FA hybrid": ("none", "hybrid"), "naive half": ("none", "half")}
"""The LSE table's columns in docs/NUMERICS.md -> the (shift, precision) its block prints them as."""


def _lse_block_and_table() -> tuple[str, list[list[str]]]:
    """docs/NUMERICS.md's LSE section: the code of its python block and the cells of the table after it."""
    section = NUMERICS.read_text().split("\n# The log-sum-exp", 1)[1]
    code, after = section.split("```python\n", 1)[1].split("\n```\n", 1)
    lines = after.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return code, [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start:end]]


def test_the_lse_table_is_what_its_block_prints():
    """docs/NUMERICS.md's LSE table, cell by cell, against what the python block above it prints here: each
    error to its two printed digits (6 % covers their rounding), each non-finite count exactly.  The block pins
    torch's CPU math first (``cpu_math``): unpinned, each machine prints its own MKL path's rounding of logits in
    the thousands (docs/NUMERICS.md names the cells that moved).  Other machines have other paths: the test runs
    on x86-64 only."""
    import contextlib
    import io

    if not cpu_math.portable_host():
        pytest.skip(f"the table is x86-64's pinned math; this is {platform.machine()}")
    code, table = _lse_block_and_table()
    header, rows = table[0], table[2:]
    assert header[1:] == list(TABLE_COLUMNS) and len(rows) == 10
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(NUMERICS), "exec"), {})
    measured = {}
    for line in printed.getvalue().splitlines():
        *name, shift, precision, value = line.split()
        measured[" ".join(name), shift, precision] = float(value)
    assert len(measured) == 10 * len(TABLE_COLUMNS)
    for row in rows:
        for column, cell in zip(header[1:], row[1:]):
            value = measured[(row[0], *TABLE_COLUMNS[column])]
            where = f"{row[0]}, {column}: the table says {cell}, the block printed {value:g}"
            if cell.startswith("non-finite"):
                assert value == int(cell.split("(")[1].split()[0].rstrip(")")), where
            else:
                assert abs(value - float(cell)) <= 0.06 * float(cell), where


def test_compiled_op_returns_the_lse_without_graph_breaks(gen):
    """``pasa::attention_lse`` traces with ``fullgraph=True`` (its fake gives the LSE's shape and dtype)
    and computes what eager computes; ``torch.library.opcheck`` passes on it."""
    from pasa_diffusers import ops

    q, k, v = (t.transpose(1, 2) for t in _inputs("one-block,ragged", gen))

    def attend(q, k, v):
        out, lse = pasa_attention(q, k, v, layout="bnhd", return_lse=True)
        return out, lse.transpose(1, 2)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    for got, expected in zip(compiled(q, k, v), attend(q, k, v)):
        assert torch.equal(got, expected)
    torch.library.opcheck(ops._attention_lse_op, (q, k, v, 0.2, "hybrid", "exact", DEFAULT_BETA, "bnhd"))


# --- the kernels (Triton's interpreter) -------------------------------------------------------------

# (path, case, shifts, dispatch options): the key paths the interpreter reaches, each for all its shifts
KERNEL_PATHS = [
    ("auto,gqa,tail44", "3-blocks,tail44,gqa", ("exact", "pasa", "none"), {}),  # exact: centre pre-pass
    ("shift-prepass", "3-blocks,tail44,gqa", ("pasa",), {"prepass": True}),
    ("tiles-of-32", "3-blocks,tail44,gqa", ("exact",), {"config": {"BLOCK_N": 32}}),
    ("k-bias-30", "k-bias-30", ("exact", "pasa", "none"), {}),
    ("drift,block_n=32,no-tail", "drift-0->20,no-tail", ("exact", "pasa"), {"block_n": 32}),
    ("drift,no-tail", "drift-0->20,no-tail", ("none",), {}),
    ("one-block-in-loop,ragged", "one-block,ragged", ("exact", "pasa", "none"), {}),
    ("one-block,centre-prepass", "one-block,ragged", ("exact",), {"prepass": True}),
    ("one-block,nk=64", "one-block,nk=64", ("exact", "pasa", "none"), {}),  # exact: packed
    ("packed", "temporal-25,bias-20", ("exact",), {}),
    ("temporal-25", "temporal-25,bias-20", ("pasa", "none"), {}),
    ("overflow", "q,k-bias-40", ("exact", "pasa", "none"), {}),
]
KERNEL_CALLS = [(shift, precision, path, case, options) for path, case, shifts, options in KERNEL_PATHS
                for shift in shifts for precision in ("hybrid", "half")]


@interpreted
@overflow_expected
@pytest.mark.parametrize("shift,precision,path,case,options", KERNEL_CALLS,
                         ids=[f"{s}-{p}-{path}" for s, p, path, _, _ in KERNEL_CALLS])
def test_kernel_lse_within_reference_bound(shift, precision, path, case, options, gen):
    q, k, v = _inputs(case, gen)
    _, gold = golden_attention(q, k, v, return_lse=True)
    ref_options = {"block_n": options["block_n"]} if "block_n" in options else {}
    _, ref = _reference(q, k, v, shift, precision, **ref_options)
    out, lse = _kernel(q, k, v, shift, precision, **options)
    if case in OVERFLOW and (shift, precision) == ("none", "half"):  # the naive control: its rows overflow
        assert not torch.isfinite(ref).any() and not torch.isfinite(lse).any()
        return
    assert torch.isfinite(lse).all(), f"{(~torch.isfinite(lse)).sum().item()} LSE rows not finite (or not written)"
    err, err_ref = _err_lse(lse, gold), _err_lse(ref, gold)
    bound = K_BOUND[shift, precision] * err_ref + _floor(gold)
    assert err <= bound, f"{shift}-{precision} {path}: kernel LSE error {err:.3e} > {bound:.3e} (ref {err_ref:.3e})"


@interpreted
@pytest.mark.parametrize("shift", ["exact", "pasa", "none"])
def test_kernel_lse_bf16(shift, gen):
    q, k, v = _inputs("3-blocks,tail44,gqa", gen, torch.bfloat16)
    _, gold = golden_attention(q, k, v, return_lse=True)
    _, ref = _reference(q, k, v, shift, "hybrid")
    _, lse = _kernel(q, k, v, shift, "hybrid")
    err, err_ref = _err_lse(lse, gold), _err_lse(ref, gold)
    assert err <= K_BOUND[shift, "hybrid"] * err_ref + _floor(gold), f"{err:.3e} vs reference {err_ref:.3e}"


@interpreted
@pytest.mark.parametrize("precision", ["half", "hybrid"])
def test_packed_lse_equals_the_loop(precision, gen):
    """The packed kernel forms ``r`` and ``lse`` as the portable loop does on one block: the same bits."""
    from pasa_diffusers.kernels import dispatch

    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs("temporal-25,bias-20", gen))
    assert dispatch.plan(q, k, v, q, variant=Variant("exact", precision)).kernel == "packed"
    packed_out, packed_lse = _kernel(q, k, v, "exact", precision)
    loop_out, loop_lse = _kernel(q, k, v, "exact", precision, kernel="portable")
    assert torch.equal(packed_out, loop_out) and torch.equal(packed_lse, loop_lse)
    assert torch.equal(_kernel(q, k, v, "exact", precision, config={"CENTRE_IN_G": True})[1], packed_lse)


@interpreted
@pytest.mark.parametrize("shift,precision", VARIANTS, ids=[f"{s}-{p}" for s, p in VARIANTS])
def test_storing_the_lse_leaves_the_output_unchanged(shift, precision, gen):
    from pasa_diffusers.kernels import dispatch

    for case in ("3-blocks,tail44,gqa", "one-block,ragged"):
        q, k, v = _inputs(case, gen)
        out, _ = _kernel(q, k, v, shift, precision)
        plain = torch.full_like(q, float("nan"))
        dispatch.forward(q, k, v, plain, scale=1.0 / math.sqrt(q.shape[-1]), variant=Variant(shift, precision),
                         beta=DEFAULT_BETA)
        assert torch.equal(out, plain)


@interpreted
@overflow_expected
@pytest.mark.parametrize("case", ["3-blocks,tail44,gqa", "temporal-25,bias-20"])
@pytest.mark.parametrize("shift,precision", VARIANTS, ids=[f"{s}-{p}" for s, p in VARIANTS])
def test_kernel_halves_merge_as_the_reference_halves(shift, precision, case, monkeypatch, gen):
    """Through ``pasa_attention`` (``bnhd``, the interpreted kernels): the two halves' outputs merged by
    their LSE are within ``K`` of the references' merge."""
    q, k, v = _inputs(case, gen)
    gold_out = golden_attention(q, k, v)
    halves = _halves(q, k, v)
    ref_parts = [_reference(q, kh, vh, shift, precision) for kh, vh in halves]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel_parts = []
    for kh, vh in halves:
        out, lse = pasa_attention(*(t.transpose(1, 2) for t in (q, kh, vh)), precision=precision, shift=shift,
                                  layout="bnhd", return_lse=True)
        kernel_parts.append((out.transpose(1, 2), lse))
    merged_ref, _ = _merge(*ref_parts[0], *ref_parts[1])
    merged, _ = _merge(*kernel_parts[0], *kernel_parts[1])
    err, err_ref = _err(merged, gold_out), _err(merged_ref, gold_out)
    assert err <= K_BOUND[shift, precision] * err_ref + 1e-6, f"kernel merge {err:.3e} vs reference {err_ref:.3e}"


@interpreted
def test_dispatch_refuses_a_wrong_lse_buffer(gen):
    from pasa_diffusers.kernels import dispatch

    q, k, v = _inputs("one-block,ragged", gen)
    for bad in (torch.empty(q.shape[:3], dtype=torch.float16), torch.empty(1, 33, 2).transpose(1, 2),
                torch.empty(q.shape[:2])):
        with pytest.raises(ValueError, match=r"^dispatch.forward: lse must be a contiguous float32 tensor of shape "
                                             r"\(B, Hq, Nq\)=\(1, 2, 33\)"):
            dispatch.forward(q, k, v, torch.empty_like(q), scale=0.2, variant=Variant(), beta=DEFAULT_BETA, lse=bad)


# --- the compiled kernels (CUDA) --------------------------------------------------------------------

GPU_K_BOUND = {**K_BOUND, ("pasa", "half"): 3.0, ("none", "half"): 3.0}
"""``test_kernel_gpu.py``'s ``K``: 3 for the half variants (sm_90's fp16 wgmma accumulators round every
k-step of 16, up to ``sqrt(D / 16)`` times the reference's one score rounding), 2 in hybrid."""
GPU_SHAPES = {  # (B, Hq, Hk, Nq, Nk, D), k bias: the kernel each shape reaches on an H200 by default
    "spatial-2304,k-bias-30": ((1, 4, 4, 2304, 2304, 64), 30.0),  # exact hybrid: Gluon
    "temporal-25": ((256, 4, 4, 25, 25, 64), 2.0),  # exact: packed
    "gqa,d80,ragged": ((1, 6, 2, 1000, 777, 80), 2.0),  # portable (+ centre / shift pre-pass)
    "one-query-row,d128": ((2, 2, 2, 1, 1407, 128), 2.0),
}


def _gpu_inputs(shape, k_bias, gen):
    b, hq, hk, nq, nk, d = shape
    q = torch.randn(b, hq, nq, d, generator=gen) + 2.0
    k = torch.randn(b, hk, nk, d, generator=gen) + k_bias
    v = torch.randn(b, hk, nk, d, generator=gen)
    return tuple(t.half().cuda() for t in (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_SHAPES))
@pytest.mark.parametrize("shift,precision", VARIANTS, ids=[f"{s}-{p}" for s, p in VARIANTS])
def test_gpu_lse_within_reference_bound(shift, precision, case, gen):
    """Through the op on (B, N, H, D) CUDA tensors: the LSE within ``K`` of the reference's (computed on
    the same GPU tensors), and the output the same bits as without ``return_lse``."""
    q, k, v = _gpu_inputs(*GPU_SHAPES[case], gen)
    _, gold = golden_attention(q, k, v, return_lse=True)
    _, ref = _reference(q, k, v, shift, precision)
    bnhd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    out, lse = pasa_attention(*bnhd, shift=shift, precision=precision, layout="bnhd", return_lse=True)
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and lse.is_contiguous()
    assert torch.equal(out, pasa_attention(*bnhd, shift=shift, precision=precision, layout="bnhd"))
    if not torch.isfinite(ref).all():
        assert not torch.isfinite(lse).all()
        return
    err, err_ref = _err_lse(lse, gold), _err_lse(ref, gold)
    bound = GPU_K_BOUND[shift, precision] * err_ref + _floor(gold)
    assert err <= bound, f"{shift}-{precision} {case}: kernel LSE error {err:.3e} > {bound:.3e} (ref {err_ref:.3e})"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["spatial-2304,k-bias-30", "temporal-25"])
def test_gpu_ring_merge_of_the_default(case, gen):
    """The default's two key halves, merged by their LSE, reproduce one call's accuracy."""
    q, k, v = _gpu_inputs(*GPU_SHAPES[case], gen)
    gold_out = golden_attention(q, k, v)
    full = pasa_attention(q, k, v)
    parts = [pasa_attention(q, kh, vh, return_lse=True) for kh, vh in _halves(q, k, v)]
    merged, _ = _merge(*parts[0], *parts[1])
    err, err_full = _err(merged, gold_out), _err(full, gold_out)
    assert err <= 2.0 * err_full + 1e-6, f"merged {err:.3e} > 2 x one call's {err_full:.3e}"
