"""``precision="fp8"`` (backend ``pasa-fp8``): the exact shift in 8 bits with FP8 e4m3 ``P V``, which is
``precision="int8"``'s path with ``pv_bits=8`` (``reference_int8`` step 5), through every public face: the op
on CPU tensors (the spec, bit for bit) and under Triton's interpreter (the portable 8-bit kernel), the variant,
the router, the processor and backend, and the command line.

The spec's own accuracy against the float64 golden (the error model with ``pv_bits=8``) is
``tests/test_int8.py``'s; here the op is held to the bound this precision is published with, relative RMSE
<= 4.5e-2 on every input class (FP8 ``P`` and ``V`` each cost about 2.5e-2), and from below by half the error
model's prediction, so that a ``P V`` left in 16 bits (``int8``'s 1e-2 and less) cannot pass for it.  Measured
at these shapes (128 query rows of 2 heads, 512 keys; fp16 head dim 64 and bf16 head dim 128, three seeds):
2.0-3.7e-2, 0.80-1.20x the model.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from bench.int8_accuracy import input_classes
from pasa_diffusers import numerics
from pasa_diffusers import reference_int8 as r8
from pasa_diffusers.kernels import block_tally
from pasa_diffusers.ops import pasa_attention
from pasa_diffusers.reference import golden_attention
from pasa_diffusers.variants import EIGHT_BIT, Variant, pv_bits
from tests.eight_bit import assert_spec_to_one_ulp

FP8 = Variant("exact", "fp8")
INT8 = Variant("exact", "int8")
FP8_BOUND = 4.5e-2
"""The relative RMSE ``precision="fp8"`` is published with, on every input class."""
CLASSES = list(input_classes((1, 1, 1, 16, 16)))
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _seed(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def _inputs(b, hq, hk, nq, nk, d, dtype, gen, bias=3.0):
    q = torch.randn(b, hq, nq, d, generator=gen) * 2 + bias
    k = torch.randn(b, hk, nk, d, generator=gen) + bias + torch.linspace(0, 10, nk)[:, None]
    v = torch.randn(b, hk, nk, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# ---- the variant ---------------------------------------------------------------------------------------

def test_fp8_is_an_8_bit_precision_with_fp8_p_v():
    assert EIGHT_BIT == ("int8", "fp8") and (pv_bits("int8"), pv_bits("fp8")) == (16, 8)
    assert FP8.name == "exact-fp8" and FP8.label == "exact fp8" and not FP8.half
    with pytest.raises(ValueError, match=r"^pv_bits: precision='hybrid' is not an 8-bit precision"):
        pv_bits("hybrid")


def test_fp8_is_the_exact_shifts_only():
    from pasa_diffusers.processors import PASAAttnProcessor

    q = torch.randn(1, 1, 8, 16).half()
    for shift in ("pasa", "none", True, False):
        with pytest.raises(ValueError, match=r"^pasa_attention: precision='fp8' runs the exact shift only, got "
                                             r"shift='(pasa|none)' \(precision='fp8' is the exact shift's 8-bit"):
            pasa_attention(q, q, q, precision="fp8", shift=shift)
    with pytest.raises(ValueError, match=r"^Variant: precision='fp8' runs the exact shift only"):
        Variant("pasa", "fp8")
    with pytest.raises(ValueError, match=r"^PASAAttnProcessor: precision='fp8' runs the exact shift only"):
        PASAAttnProcessor(precision="fp8", shift="pasa")
    with pytest.raises(ValueError, match=r"dtype torch.float32 is not supported for precision='fp8'"):
        pasa_attention(q.float(), q.float(), q.float(), precision="fp8")


# ---- the op on CPU tensors: the spec --------------------------------------------------------------------

def test_the_op_runs_the_spec_on_cpu_tensors(gen):
    """``pasa_attention(precision="fp8")`` on CPU tensors without the interpreter is ``int8_reference(...,
    pv_bits=8)``, bit for bit, in both layouts, with its log-sum-exp; the op's call counts its key blocks; and
    it is not ``precision="int8"``'s result (``P V`` in 8 bits, not 16)."""
    q, k, v = _inputs(1, 4, 2, 50, 300, 64, torch.float16, gen)
    spec, spec_lse = r8.int8_reference(q, k, v, pv_bits=8, return_lse=True)
    if INTERPRETING:  # the op runs the kernel (test_op_runs_the_portable_8_bit_kernel_with_fp8_p_v)
        pytest.skip("TRITON_INTERPRET=1: the op runs the kernel, not the reference")
    block_tally.reset()
    out, lse = pasa_attention(q, k, v, precision="fp8", return_lse=True)
    assert torch.equal(out, spec) and torch.equal(lse, spec_lse)
    assert block_tally.counts()["blocks"] == 4 * 3  # (batch, query head) x key blocks
    bnhd = pasa_attention(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), precision="fp8", layout="bnhd")
    assert torch.equal(bnhd.transpose(1, 2), spec)
    assert not torch.equal(out, pasa_attention(q, k, v, precision="int8"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,d", [(torch.float16, 64), (torch.bfloat16, 128)], ids=["fp16-64", "bf16-128"])
def test_the_op_within_its_published_bound_on_every_class(dtype, d, gen):
    """Every class of ``bench.int8_accuracy.input_classes``: relative RMSE against the golden at most
    :data:`FP8_BOUND`, and at least half the error model's prediction for ``pv_bits=8`` (shrunk by three
    standard deviations of its scatter over the model's effective rows, as ``tests/test_int8.py`` holds it)."""
    if INTERPRETING:
        pytest.skip("TRITON_INTERPRET=1: the op runs the kernel (test_kernel_matches_the_spec holds it to the spec)")
    for name, (q, k, v) in input_classes((1, 2, 1, 512, d), seed=_seed(gen), dtype=dtype).items():
        q = q[:, :, ::4]
        err = numerics.rel_rmse(pasa_attention(q, k, v, precision="fp8"), golden_attention(q, k, v))
        model, rows = r8.error_model(q, k, v, pv_bits=8)
        low = model / 2 * math.sqrt(max(0.0, 1.0 - 3.0 * math.sqrt(2.0 / rows)))
        assert low <= err <= FP8_BOUND, f"{name}: error {err:.3e} outside [{low:.3e}, {FP8_BOUND:.1e}]"


# ---- the router ----------------------------------------------------------------------------------------

def test_the_router_plans_the_8_bit_kernels_with_fp8_p_v():
    """``precision="fp8"`` plans the int8 path's kernels with ``pv_bits`` 8 (its own when none is given, or 8
    given); ``pv_bits=16`` conflicts and is refused naming both; ``"int8"`` keeps 16 unless given 8."""
    from pasa_diffusers.kernels import dispatch

    q = torch.randn(1, 2, 64, 64).half()
    found = dispatch.plan(q, q, q, q, variant=FP8)
    assert (found.kernel, found.prepass, found.block_n, found.pv_bits) == ("portable-int8", "quantize", 128, 8)
    assert set(found.rejected) == set(dispatch.kernel_names()) - {"portable-int8"}
    assert found.rejected["portable"] == "it runs the 16-bit precisions, not precision='fp8'"
    assert found.describe().startswith("portable-int8 + quantize pre-pass, P V in FP8 (not ")
    assert dispatch.plan(q, q, q, q, variant=FP8, pv_bits=8) == found
    assert dispatch.plan(q, q, q, q, variant=INT8).pv_bits == 16
    assert dispatch.plan(q, q, q, q, variant=INT8, pv_bits=8).pv_bits == 8
    assert dispatch.plan(q, q, q, q, variant=Variant()).pv_bits == 16
    with pytest.raises(ValueError, match=r"^dispatch.plan: precision='fp8' computes P V in FP8 e4m3 \(pv_bits=8\), "
                                         r"got pv_bits=16; for P V in 16 bits use precision='int8'$"):
        dispatch.plan(q, q, q, q, variant=FP8, pv_bits=16)
    with pytest.raises(ValueError, match=r"^dispatch.plan: unknown pv_bits=4; expected one of \(16, 8\)"):
        dispatch.plan(q, q, q, q, variant=FP8, pv_bits=4)
    for kernel in ("portable", "packed", "gluon"):
        with pytest.raises(ValueError, match=f"kernel='{kernel}' has no 8-bit path; precision='fp8' runs one of"):
            dispatch.plan(q, q, q, q, variant=FP8, kernel=kernel)
    with pytest.raises(ValueError, match="precision='fp8' centres blocks of 128 keys, got block_n=64"):
        dispatch.plan(q, q, q, q, variant=FP8, block_n=64)
    with pytest.raises(ValueError, match="prepass=False"):
        dispatch.plan(q, q, q, q, variant=FP8, prepass=False)
    with pytest.raises(ValueError, match=r"pv_bits and fallback are the 8-bit kernels' options \(precision='int8' "
                                         r"or 'fp8'\), got pv_bits=8"):
        dispatch.plan(q, q, q, q, variant=Variant(), pv_bits=8)


def test_fp8_p_v_is_refused_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    """A CUDA GPU below sm_89 (A100: sm_80) has no FP8 tensor cores: ``dispatch.fp8_problem`` says so, and the
    router refuses ``P V`` in FP8 there with one line naming the GPU and what to use instead (the capability is
    faked: this host has no GPU)."""
    from pasa_diffusers.kernels import dispatch

    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    gpu = torch.device("cuda", 0)
    assert dispatch.fp8_problem(gpu) == ("P V in FP8 e4m3 needs FP8 tensor cores (sm_89 or later); NVIDIA "
                                         "A100-SXM4-80GB is sm_80")
    assert dispatch.fp8_problem(torch.device("cpu")) is None
    for ada_or_later in ((8, 9), (9, 0), (10, 0)):
        capability["value"] = ada_or_later
        assert dispatch.fp8_problem(gpu) is None
    monkeypatch.setattr(dispatch, "fp8_problem", lambda device: "P V in FP8 e4m3 needs FP8 tensor cores")
    dispatch.forget_plans()  # plans are kept per signature: route these calls afresh
    q = torch.randn(1, 2, 64, 64).half()
    try:
        with pytest.raises(ValueError, match=r"^dispatch.plan: precision='fp8': P V in FP8 e4m3 needs FP8 tensor "
                                             r"cores; use precision='int8' \(P V in 16 bits\)$"):
            dispatch.plan(q, q, q, q, variant=FP8)
        with pytest.raises(ValueError, match=r"^dispatch.plan: precision='int8', pv_bits=8: .*; use pv_bits=16$"):
            dispatch.plan(q, q, q, q, variant=INT8, pv_bits=8)
        assert dispatch.plan(q, q, q, q, variant=INT8).pv_bits == 16
    finally:
        dispatch.forget_plans()


# ---- the kernel under the interpreter --------------------------------------------------------------------

triton = pytest.importorskip("triton")

from pasa_diffusers.kernels import dispatch, int8, quantize  # noqa: E402
from pasa_diffusers.kernels.common import INTERPRET  # noqa: E402
from pasa_diffusers.shift_matrix import DEFAULT_BETA  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRET, reason="kernels built for the GPU; set TRITON_INTERPRET=1 "
                                 "before pytest starts to run them on the CPU")


@interpreted
@pytest.mark.parametrize("shape", [(1, 4, 2, 70, 200, 64, torch.float16), (1, 2, 2, 20, 129, 32, torch.bfloat16)],
                         ids=["gqa,ragged,fp16", "bf16,d32"])
def test_kernel_matches_the_spec(shape, gen):
    """``dispatch.forward`` of ``precision="fp8"`` (no ``pv_bits`` given) runs the portable 8-bit kernel with FP8
    ``P V``: the spec with ``pv_bits=8`` to one ulp of the inputs' dtype (``tests/test_int8.py``'s rule for the
    kernel against the spec: the same codes, fp32 rounding apart), and bit for bit what ``precision="int8"``
    with ``pv_bits=8`` gives."""
    q, k, v = _inputs(*shape, gen)
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    assert dispatch.forward(q, k, v, out, scale=scale, variant=FP8, beta=DEFAULT_BETA) is out
    spec = r8.int8_reference(q, k, v, pv_bits=8, block_n=int8.INTERPRET_CONFIG["BLOCK_N"])
    assert_spec_to_one_ulp(out, spec, v, 8)
    as_int8 = dispatch.forward(q, k, v, torch.empty_like(q), scale=scale, variant=INT8, beta=DEFAULT_BETA, pv_bits=8)
    assert torch.equal(out, as_int8)


@interpreted
def test_op_runs_the_portable_8_bit_kernel_with_fp8_p_v(gen, monkeypatch):
    """Under the interpreter the op runs the portable 8-bit kernel on the pre-pass's codes with V in e4m3 (the
    same bits as launching them directly)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read per call by the op
    q, k, v = _inputs(1, 4, 2, 40, 200, 64, torch.float16, gen)
    direct = int8.attend(q, quantize.prepare(q, k, v, scale=0.125, pv_bits=8), torch.empty_like(q), scale=0.125)
    assert torch.equal(pasa_attention(q, k, v, precision="fp8"), direct)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(torch.float16, 64), (torch.bfloat16, 128)], ids=["fp16-64", "bf16-128"])
def test_gpu_op_within_its_published_bound_on_every_class(dtype, d, gen):
    """On CUDA the op runs an 8-bit kernel (whichever ``kernel="auto"`` takes at 1024 keys) with FP8 ``P V``: on
    every class within :data:`FP8_BOUND` of the golden and above half the error model, as on the CPU (the
    kernels' FP8 accumulators keep about 22 bits per key tile, far below the codes' error)."""
    for name, (q, k, v) in input_classes((1, 2, 1, 1024, d), seed=_seed(gen), dtype=dtype).items():
        q = q[:, :, ::4]
        qc, kc, vc = (t.cuda() for t in (q, k, v))
        found = dispatch.plan(qc, kc, vc, torch.empty_like(qc), variant=FP8)
        assert found.kernel in dispatch.INT8_KERNELS and found.pv_bits == 8, found.describe()
        out = pasa_attention(qc, kc, vc, precision="fp8").cpu()
        err = numerics.rel_rmse(out, golden_attention(q, k, v))
        model, rows = r8.error_model(q, k, v, pv_bits=8)
        low = model / 2 * math.sqrt(max(0.0, 1.0 - 3.0 * math.sqrt(2.0 / rows)))
        assert low <= err <= FP8_BOUND, f"{name}: error {err:.3e} outside [{low:.3e}, {FP8_BOUND:.1e}]"


# ---- the backend: processors and the command line ------------------------------------------------------------

def test_fp8_processor_runs_one_key_block_in_the_default_precision(gen):
    """``precision="fp8"`` takes the "one key block" fallback as ``"int8"`` does: a call whose keys are one block
    is the default's 16-bit op bit for bit, counted; from two blocks on the 8-bit op runs (no fallback)."""
    from diffusers.models.attention_processor import Attention

    from pasa_diffusers.processors import PASAAttnProcessor

    torch.manual_seed(_seed(gen))
    attn = Attention(query_dim=64, heads=1, dim_head=64).half().eval().requires_grad_(False)
    for tokens, fallbacks in ((64, {"one key block": 1}), (200, {})):
        x = torch.randn(2, tokens, 64, generator=gen).half()
        fp8, hybrid = PASAAttnProcessor(precision="fp8"), PASAAttnProcessor()
        assert "one key block" in fp8.fallback_cases
        out = fp8(attn, x)
        assert fp8.fallbacks == fallbacks and fp8.calls == 1
        assert torch.equal(out, hybrid(attn, x)) == bool(fallbacks)
        assert torch.isfinite(out).all()


def test_pasa_fp8_backend_routes_a_video_transformer(gen):
    """``apply(model, "pasa-fp8")`` on a tiny Wan with 432 video tokens: the self-attention runs the 8-bit
    variant with FP8 ``P V`` (its key blocks counted), the cross-attention to the short prompt (one key block)
    the default, counted as "one key block"; the forward stays finite and near SDPA's.  The bound is a sanity
    check, as ``pasa-int8``'s in ``tests/test_int8.py``: each call's relative error is at most
    :data:`FP8_BOUND`, and the two blocks' residual stream adds a few of them.  Its difference from SDPA is
    larger than ``pasa-int8``'s (measured 2.6-2.8x over four seeds): ``P V`` ran in 8 bits."""
    from pasa_diffusers import install
    from pasa_diffusers.backends import BACKENDS
    from pasa_diffusers.pipelines.video_dits import example_inputs, tiny_transformer

    if INTERPRETING:
        pytest.skip("slow under the interpreter; the reference path is the same processor code")
    assert BACKENDS["pasa-fp8"].variant == FP8 and BACKENDS["pasa-fp8"].options == {"precision": "fp8",
                                                                                   "shift": "exact"}
    model = tiny_transformer("wan")
    inputs = example_inputs("wan", model, gen)
    inputs["hidden_states"] = torch.randn(2, model.config.in_channels, 3, 24, 24, generator=gen)  # 3 x 12 x 12 tokens
    diffs = {}
    with torch.no_grad():
        stock = model(**inputs)[0]
        for backend in ("pasa-int8", "pasa-fp8"):
            block_tally.reset()
            install.apply(model, backend)
            out = model(**inputs)[0]
            counters = install.fallback_summary(model)
            install.restore(model)
            assert counters["backends"] == [backend] and set(counters["fallbacks"]) == {"one key block"}
            assert 0 < counters["fallbacks"]["one key block"] < counters["calls"]
            assert block_tally.counts()["blocks"] > 0 and torch.isfinite(out).all()
            diffs[backend] = ((out - stock).norm() / stock.norm()).item()
    assert 0 < diffs["pasa-int8"] < diffs["pasa-fp8"] <= 5e-2, diffs


def test_the_cli_refuses_pasa_fp8_on_one_key_block_runs(tmp_path, capsys):
    """``pasa generate --attention pasa-fp8`` on a run whose every call has at most one key block (tiny CogVideoX:
    48 video + 7 text tokens in one joint attention) is refused before any step, as ``pasa-int8`` is; a list of
    backends names each 8-bit one it holds."""
    from pasa_diffusers.cli import common, main

    out = tmp_path / "out"
    assert main(["generate", "--model", "tiny-cogvideox", "--attention", "pasa-fp8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("pasa generate: error: --attention pasa-fp8: every attention call of ") and (
        "takes at most 55 keys, one key block of 128, which pasa-fp8 computes in 16 bits (its documented "
        "fallback): no call would run in 8 bits") in err
    assert not out.exists() or list(out.iterdir()) == []
    from pasa_diffusers.pipelines.video import default_settings, load_video

    pipe = load_video("tiny-cogvideox")
    with pytest.raises(common.UsageError, match=r"^--backends pasa,pasa-int8,pasa-fp8: every attention call .* which "
                                                r"pasa-int8, pasa-fp8 computes in 16 bits"):
        common.check_key_blocks(pipe, default_settings(pipe), ["pasa", "pasa-int8", "pasa-fp8"], "--backends")
    common.check_key_blocks(pipe, default_settings(pipe), ["pasa", "bf16"], "--backends")  # no 8-bit backend
