"""The diffusers processors: module selection, exactness against AttnProcessor2_0, fallbacks, restore.

Runs on the CPU with the tiny SVD pipeline (head dims 16 and 32); the PASA op runs its exact PyTorch
reference there.  Tolerances are relative to the reference output's largest magnitude,
``max|out - ref| / max|ref|``; inputs and weights are fresh draws from the ``gen`` fixture (its seed is
printed; replay with ``PASA_TEST_SEED``).
"""
from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock, TemporalBasicTransformerBlock
from diffusers.models.attention_processor import Attention, AttnProcessor2_0

from pasa_diffusers import install as I
from pasa_diffusers import processors as P
from pasa_diffusers.ops import pasa_attention
from pasa_diffusers.pipelines.svd import load_svd

FP16_TOL = 2.0**-8
"""4 fp16 ulps of the largest output: the fp16 output rounding alone is 2**-11 (SDPA in fp16 measures
5.7e-4 on these shapes), and the scores and softmax state of the half pipelines add a few more."""

EXACT_TOL = 1e-5
"""PASA in exact mode (fp64) against the stock fp32 SDPA over a whole UNet forward: both compute exact
attention, so they differ by fp32 rounding (about D * 2**-24 per attention output, through 24
attentions and the network around them); measured 8.6e-7.  A 0.1% error in the softmax scale
already gives 5e-5 (checked below)."""

BACKEND_CLASSES = {
    "pasa": P.PASAAttnProcessor,
    "pasa-half": P.PASAAttnProcessor,
    "pasa-paper": P.PASAAttnProcessor,
    "pasa-paper-hybrid": P.PASAAttnProcessor,
    "fp32": P.FP32AttnProcessor,
    "naive-half": P.NaiveHalfAttnProcessor,
    "sdpa": P.SDPAAttnProcessor,
    "bf16": P.BF16AttnProcessor,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def attention_modules(model: torch.nn.Module) -> dict[str, Attention]:
    return {name: module for name, module in model.named_modules() if isinstance(module, Attention)}


def kinds_from_module_tree(model: torch.nn.Module) -> dict[str, str]:
    """Kind of every Attention module, from the block class that holds it and ``is_cross_attention``."""
    kinds = {}
    for name, block in model.named_modules():
        if isinstance(block, TemporalBasicTransformerBlock):
            place = "temporal"
        elif isinstance(block, BasicTransformerBlock):
            place = "spatial"
        else:
            continue
        for child_name, child in block.named_children():
            if isinstance(child, Attention):
                role = "cross" if child.is_cross_attention else "self"
                kinds[f"{name}.{child_name}"] = f"{place}-{role}"
    for name in attention_modules(model):
        kinds.setdefault(name, "other")
    return kinds


def unet_inputs(g: torch.Generator, num_frames: int = 2) -> dict[str, torch.Tensor]:
    """Random inputs of the tiny UNet for a CFG batch of 2: latents + image latents (8 channels at 16x16)."""
    return {
        "sample": torch.randn(2, num_frames, 8, 16, 16, generator=g),
        "timestep": torch.rand((), generator=g) * 10,
        "encoder_hidden_states": torch.randn(2, 1, 32, generator=g),
        "added_time_ids": torch.randn(2, 3, generator=g),
    }


def unet_forward(unet: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return unet(**inputs).sample




# ---------------------------------------------------------------------------------------------- selection


@pytest.mark.parametrize(
    "flags",
    [{}, {"temporal": False}, {"spatial": False}, {"cross": False}, {"spatial": False, "cross": False}],
    ids=["all", "spatial-only", "temporal-only", "self-only", "temporal-self-only"],
)
def test_apply_selects_modules_by_kind(pipe, flags):
    before = {name: module.processor for name, module in attention_modules(pipe.unet).items()}
    kinds = kinds_from_module_tree(pipe.unet)
    assert Counter(kinds.values()) == {"spatial-self": 6, "spatial-cross": 6, "temporal-self": 6, "temporal-cross": 6}

    spatial, temporal, cross = (flags.get(f, True) for f in ("spatial", "temporal", "cross"))
    wanted = {
        "spatial-self": spatial,
        "spatial-cross": spatial and cross,
        "temporal-self": temporal,
        "temporal-cross": temporal and cross,
    }
    summary = I.apply(pipe, "sdpa", **flags)

    for name, module in attention_modules(pipe.unet).items():
        if wanted[kinds[name]]:
            assert type(module.processor) is P.SDPAAttnProcessor, name
            assert module.processor.name == f"unet.{name}"
        else:
            assert module.processor is before[name], name
    assert summary["counts"] == {**dict.fromkeys(I.KINDS, 0), **Counter(kinds.values())}
    assert summary["installed"] == sum(wanted[kind] for kind in kinds.values())
    for kind, chosen in wanted.items():
        assert summary["processors"][kind] == ("SDPAAttnProcessor" if chosen else "AttnProcessor2_0")
    assert summary["processors"]["other"] is None
    assert all(type(m.processor) is AttnProcessor2_0 for m in attention_modules(pipe.vae).values())


@pytest.mark.parametrize("backend", sorted(BACKEND_CLASSES))
def test_apply_installs_each_backend(pipe, backend):
    options = {"beta": 0.875} if backend.startswith("pasa-paper") else {}  # beta: PASA's shift only
    summary = I.apply(pipe.unet, backend, **options)

    modules = attention_modules(pipe.unet)
    processors = [module.processor for module in modules.values()]
    assert all(type(p) is BACKEND_CLASSES[backend] for p in processors)
    assert len({id(p) for p in processors}) == len(modules) == summary["installed"]
    expected = {"pasa": ("hybrid", "exact"), "pasa-half": ("half", "exact"), "pasa-paper": ("half", "pasa"),
                "pasa-paper-hybrid": ("hybrid", "pasa")}
    if backend.startswith("pasa"):
        beta = 0.875 if backend.startswith("pasa-paper") else None
        assert {(p.precision, p.shift, p.beta) for p in processors} == {expected[backend] + (beta,)}
    if backend == "naive-half":
        assert {(p.precision, p.shift) for p in processors} == {("half", "none")}


def test_apply_on_vae_and_on_bare_unet2d():
    pipe = load_svd("tiny")
    vae_kinds = kinds_from_module_tree(pipe.vae)
    unet_before = {name: m.processor for name, m in attention_modules(pipe.unet).items()}

    summary = I.apply(pipe, "fp32", spatial=False, temporal=False, vae=True)

    assert list(vae_kinds.values()) == ["other", "other"]
    assert summary["counts"]["other"] == summary["installed"] == 2
    assert all(type(m.processor) is P.FP32AttnProcessor for m in attention_modules(pipe.vae).values())
    assert all(m.processor is unet_before[name] for name, m in attention_modules(pipe.unet).items())

    torch.manual_seed(0)
    unet2d = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=16,
        norm_num_groups=16,
    )
    kinds = kinds_from_module_tree(unet2d)
    summary = I.apply(unet2d, "pasa", precision="fp64")
    assert summary["counts"] == {**dict.fromkeys(I.KINDS, 0), **Counter(kinds.values())}
    assert summary["installed"] == len(kinds) > 0
    assert all(type(m.processor) is P.PASAAttnProcessor for m in attention_modules(unet2d).values())


# ---------------------------------------------------------------------------------------------- exactness


def test_pasa_exact_mode_reproduces_stock_processor(pipe, gen):
    unet = pipe.unet
    inputs = unet_inputs(gen)
    unet.set_attn_processor(AttnProcessor2_0())
    ref = unet_forward(unet, inputs)

    I.apply(unet, "pasa", precision="fp64")
    out = unet_forward(unet, inputs)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= EXACT_TOL
    summary = I.fallback_summary(unet)
    assert summary["calls"] == 24 and summary["fallbacks"] == {"single key": 12}

    class ScaleOffProcessor(P.PASAAttnProcessor):
        def attention(self, query, key, value, scale, attention_mask=None):
            return pasa_attention(query, key, value, scale=scale * 1.001, precision="fp64", layout="bnhd")

    unet.set_attn_processor(ScaleOffProcessor(precision="fp64"))
    assert rel_err(unet_forward(unet, inputs), ref) > EXACT_TOL


@pytest.mark.parametrize("backend", ["sdpa", "fp32"])
def test_fp32_model_backends_equal_stock_sdpa(pipe, backend, gen):
    """On fp32 tensors these run fp32 SDPA on the same strided views as the stock processor."""
    inputs = unet_inputs(gen)
    ref = unet_forward(pipe.unet, inputs)
    summary = I.apply(pipe.unet, backend)
    assert summary["model_dtype"] == summary["attention_dtype"] == "float32"
    torch.testing.assert_close(unet_forward(pipe.unet, inputs), ref, rtol=0, atol=0)
    assert I.fallback_summary(pipe.unet)["fallbacks"] == {}


@pytest.mark.parametrize("backend", ["pasa", "pasa-half", "pasa-paper", "pasa-paper-hybrid", "naive-half"])
def test_apply_casts_an_fp32_model_to_fp16_and_says_so(pipe, gen, backend):
    """The issue's probe: ``apply(load_svd("tiny"), "pasa")`` used to fall back to fp32 SDPA on every call
    (output equal to the fp32 reference bit for bit).  Now q, k, v are cast to fp16 and the op runs."""
    inputs = unet_inputs(gen)
    ref = unet_forward(pipe.unet, inputs)
    summary = I.apply(pipe.unet, backend)
    assert (summary["model_dtype"], summary["attention_dtype"]) == ("float32", "float16")
    assert summary["options"] == {}
    out = unet_forward(pipe.unet, inputs)
    assert out.dtype == torch.float32
    assert 0 < rel_err(out, ref) <= FP16_TOL  # fp16 rounding of q, k, v and attention; measured ~1e-4
    counters = I.fallback_summary(pipe.unet, strict=True)
    assert counters["fallbacks"] == {"single key": 12}  # the documented case only: no "dtype float32"
    assert counters["targeted_calls"] == 12 and counters["fallback_share"] == 0.5

    I.apply(pipe.unet, backend, dtype=torch.float16)  # the explicit option gives the same result
    torch.testing.assert_close(unet_forward(pipe.unet, inputs), out, rtol=0, atol=0)


@pytest.mark.parametrize("backend, attention_dtype", [("pasa", "bfloat16"), ("pasa-paper-hybrid", "bfloat16"),
                                                      ("pasa-half", "float16"), ("naive-half", "float16"),
                                                      ("sdpa", "bfloat16"), ("fp32", "float32")])
def test_apply_on_a_bf16_model_runs_what_the_backend_takes(pipe, backend, attention_dtype):
    """hybrid takes bf16 as it is; the half precisions need fp16 and get it."""
    summary = I.apply(pipe.unet.to(torch.bfloat16), backend)
    assert (summary["model_dtype"], summary["attention_dtype"]) == ("bfloat16", attention_dtype)


def test_bf16_backend_is_close_but_not_equal(pipe, gen):
    inputs = unet_inputs(gen)
    ref = unet_forward(pipe.unet, inputs)
    I.apply(pipe.unet, "bf16")
    err = rel_err(unet_forward(pipe.unet, inputs), ref)
    assert 0 < err <= 2.0**-6  # bf16 unit roundoff 2**-8, a few of them; measured 5.9e-4


def fp16_attention(dim: int, heads: int, g: torch.Generator, **kwargs) -> Attention:
    """An fp16 inference-mode ``Attention`` (no grad) with fresh random weights drawn from ``g``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(2**31, (), generator=g)))
        attn = Attention(query_dim=dim, heads=heads, dim_head=dim // heads, **kwargs)
        return attn.half().eval().requires_grad_(False)


def test_int8_processor_runs_one_key_block_in_the_default_precision(gen):
    """``precision="int8"``: a call whose keys are one block (temporal attention) is the counted "one key block"
    fallback, the default's 16-bit op bit for bit; from two blocks on the 8-bit op runs (no fallback)."""
    attn = fp16_attention(64, 1, gen)
    for tokens, fallbacks in ((64, {"one key block": 1}), (200, {})):
        x = torch.randn(2, tokens, 64, generator=gen).half()
        int8_processor, hybrid = P.PASAAttnProcessor(precision="int8"), P.PASAAttnProcessor()
        out = int8_processor(attn, x)
        assert int8_processor.fallbacks == fallbacks and int8_processor.calls == 1
        assert torch.equal(out, hybrid(attn, x)) == bool(fallbacks)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("head_dim", [16, 32, 64])
@pytest.mark.parametrize(
    "make", [P.PASAAttnProcessor, P.NaiveHalfAttnProcessor, lambda: P.PASAAttnProcessor("half", True),
             lambda: P.PASAAttnProcessor("half", "exact")],
    ids=["pasa", "naive-half", "pasa-paper", "pasa-half"],
)
def test_half_processors_match_fp32_on_one_module(head_dim, make, gen):
    attn = fp16_attention(64, 64 // head_dim, gen)
    x = torch.randn(2, 200, 64, generator=gen).half()
    ref = P.FP32AttnProcessor()(attn, x)
    processor = make()
    out = processor(attn, x)
    assert out.dtype == torch.float16 and out.shape == x.shape
    assert rel_err(out, ref) <= FP16_TOL
    assert processor.calls == 1 and processor.fallbacks == {}


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.float32])
def test_naive_half_overflows_where_pasa_does_not(gen, model_dtype):
    """Keys with a large common offset: raw q.k ~ 64 * 40**2 = 1.0e5 > 65504.

    An fp32 model reaches the half variants through ``dtype=torch.float16``."""
    attn = fp16_attention(64, 1, gen).to(model_dtype)
    with torch.no_grad():
        attn.to_q.weight.copy_(torch.eye(64))
        attn.to_k.weight.copy_(torch.eye(64))
    x = (40 + 0.1 * torch.randn(1, 256, 64, generator=gen)).to(model_dtype)
    ref = P.FP32AttnProcessor()(attn, x)
    assert torch.isfinite(ref).all()
    cast = {"dtype": torch.float16} if model_dtype == torch.float32 else {}

    naive = P.NaiveHalfAttnProcessor(**cast)(attn, x)
    assert not torch.isfinite(naive).all()
    pasa_processor = P.PASAAttnProcessor(**cast)
    pasa = pasa_processor(attn, x)
    assert pasa.dtype == model_dtype and pasa_processor.fallbacks == {}
    assert torch.isfinite(pasa).all()
    assert rel_err(pasa, ref) <= 2 * FP16_TOL  # scores of magnitude 1e4 after the shift; measured 2.3e-3


def test_training_through_pasa_processors_fails_at_the_forward_call(pipe, gen):
    """The op is forward-only: with grad enabled and trainable weights, the first PASA call raises."""
    I.apply(pipe.unet, "pasa")
    with pytest.raises(RuntimeError, match=r"^pasa_attention: the op has no backward .* requires grad"):
        pipe.unet(**unet_inputs(gen))
    I.apply(pipe.unet, "fp32")  # the SDPA backends train as the stock processor does
    pipe.unet(**unet_inputs(gen)).sample.sum().backward()


# ---------------------------------------------------------------------------------------------- fallbacks


def test_single_key_fallback_counted_and_logged_once(pipe, caplog, gen, monkeypatch):
    """Logged once per process: a second model with the same backend (as ``pasa compare`` installs one
    per sample) logs nothing more."""
    monkeypatch.setattr(P, "_WARNED", set())
    kinds = kinds_from_module_tree(pipe.unet)
    I.apply(pipe, "pasa", precision="fp64")
    with caplog.at_level(logging.WARNING, logger="pasa_diffusers"):
        unet_forward(pipe.unet, unet_inputs(gen))
        unet_forward(pipe.unet, unet_inputs(gen))
        I.restore(pipe)
        I.apply(pipe, "pasa", precision="fp64")
        unet_forward(pipe.unet, unet_inputs(gen))

    cross = sorted(f"unet.{name}" for name, kind in kinds.items() if kind.endswith("cross"))
    summary = I.fallback_summary(pipe)
    assert summary["processors"] == 24 and summary["backends"] == ["pasa"]
    assert summary["calls"] == 24
    assert summary["fallbacks"] == {"single key": 12} and summary["fallback_calls"] == 12
    assert summary["targeted_calls"] == 12 and summary["fallback_share"] == 0.5
    assert summary["modules"] == {"single key": cross}
    records = [r for r in caplog.records if r.name == "pasa_diffusers"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "single key" in message
    assert "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2;" in message  # the first one called


@pytest.mark.slow
@pytest.mark.parametrize("backend,options", [("sdpa", {}), ("pasa", {"precision": "fp64"})], ids=["sdpa", "pasa"])
def test_compiled_unet_traces_once_and_matches_eager(pipe, gen, backend, options):
    """``torch.compile(fullgraph=True)`` traces the processors once: new inputs do not recompile the
    UNet (the counters are eager-only, so no guard sits on them; a counter mutated in the compiled
    region recompiled the full-size UNet at every step, 12.9 s per step on the H200) and the compiled
    UNet gives eager's output."""
    from torch._dynamo.testing import CompileCounter

    I.apply(pipe, backend, **options)
    counter = CompileCounter()
    compiled = torch.compile(pipe.unet, backend=counter, fullgraph=True)
    try:
        for _ in range(3):
            inputs = unet_inputs(gen)
            with torch.no_grad():
                out = compiled(**inputs).sample
            torch.testing.assert_close(out, unet_forward(pipe.unet, inputs))
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
    assert I.fallback_summary(pipe)["calls"] == 3 * 24  # the eager calls only


@pytest.mark.parametrize("dim, heads", [(512, 1), (16, 2)], ids=["head-dim-512", "head-dim-8"])
def test_head_dim_out_of_range_is_an_error_not_a_fallback(dim, heads, gen):
    """A VAE-style attention (4-D input, group norm, residual) with D outside [16, 256]."""
    attn = fp16_attention(
        dim, heads, gen, norm_num_groups=8, residual_connection=True, _from_deprecated_attn_block=True
    )
    x = torch.randn(1, dim, 4, 4, generator=gen).half()
    processor = P.PASAAttnProcessor()
    processor.name = "vae.mid_block.attentions.0"
    with pytest.raises(ValueError, match=rf"^PASAAttnProcessor\(precision='hybrid'\) in vae.mid_block.attentions.0: "
                                         rf"pasa_attention: head dim {dim // heads} is (above|below) the supported"):
        processor(attn, x)
    assert processor.fallbacks == {}


def test_apply_refuses_a_head_dim_the_op_does_not_take_and_installs_nothing():
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8)  # two mid-block attentions: 1 head of dim 8
    before = dict(vae.attn_processors)
    with pytest.raises(ValueError, match=r"^apply: backend='pasa' cannot run encoder.mid_block.attentions.0 "
                                         r"\(head dim 8; the PASA op takes head dims 16..256\)"):
        I.apply(vae, "pasa")
    assert all(vae.attn_processors[key] is before[key] for key in before)
    assert I.apply(vae, "pasa", precision="fp64")["installed"] == 2  # the exact reference takes any head dim
    assert I.apply(vae, "sdpa")["installed"] == 2  # encoder and decoder


def test_attention_mask_fallback_matches_stock(gen):
    attn = fp16_attention(32, 2, gen)
    x = torch.randn(2, 24, 32, generator=gen).half()
    mask = (4 * torch.randn(2, 1, 24, generator=gen)).half()
    ref = AttnProcessor2_0()(attn, x, attention_mask=mask)
    assert rel_err(ref, AttnProcessor2_0()(attn, x)) > FP16_TOL  # the mask matters

    processor = P.PASAAttnProcessor()
    torch.testing.assert_close(processor(attn, x, attention_mask=mask), ref)
    assert processor.fallbacks == {"attention mask": 1}

    fp32 = P.FP32AttnProcessor()
    assert rel_err(fp32(attn, x, attention_mask=mask), ref) <= FP16_TOL
    assert fp32.calls == 1 and fp32.fallbacks == {}


@pytest.mark.parametrize(
    "precision, dtype, reason",
    [
        ("half", torch.float32, "dtype torch.float32"),
        ("half", torch.bfloat16, "dtype torch.bfloat16"),
        ("hybrid", torch.float32, "dtype torch.float32"),
        ("hybrid", torch.bfloat16, None),
        ("fp64", torch.float32, None),
    ],
)
def test_a_dtype_the_precision_does_not_take_is_an_error_not_a_fallback(precision, dtype, reason, gen):
    attn = fp16_attention(32, 2, gen).to(dtype)
    x = torch.randn(2, 40, 32, generator=gen).to(dtype)
    processor = P.PASAAttnProcessor(precision)
    if reason is not None:
        with pytest.raises(ValueError, match=rf"in an attention module: pasa_attention: {reason} is not supported "
                                             rf"for precision='{precision}'.* \(pass dtype= to cast"):
            processor(attn, x)
        assert processor.fallbacks == {}
        return
    out = processor(attn, x)
    assert out.dtype == dtype
    assert processor.calls == 1 and processor.fallbacks == {}
    ref = P.FP32AttnProcessor()(attn, x)
    tol = 2.0**-6 if dtype == torch.bfloat16 else 1e-6
    assert rel_err(out, ref) <= tol


def test_fallback_summary_counts_a_shared_processor_once(pipe, gen):
    shared = P.PASAAttnProcessor("fp64")
    pipe.unet.set_attn_processor(shared)
    unet_forward(pipe.unet, unet_inputs(gen))
    summary = I.fallback_summary(pipe.unet)
    assert summary["processors"] == 1
    assert summary["calls"] == shared.calls == 24
    assert summary["fallbacks"] == {"single key": 12}
    assert len(summary["modules"]["single key"]) == 24  # every module holding it


def test_strict_summary_refuses_a_backend_whose_calls_all_fell_back(pipe, gen):
    """Only the single-key cross-attentions are called: every call is a fallback, none ran PASA."""
    I.apply(pipe.unet, "pasa")
    assert I.fallback_summary(pipe.unet, strict=True)["fallback_share"] is None  # no call yet: nothing to refuse
    cross = pipe.unet.get_submodule("down_blocks.0.attentions.0.transformer_blocks.0.attn2")
    with torch.no_grad():
        cross(torch.randn(2, 64, 32, generator=gen), encoder_hidden_states=torch.randn(2, 1, 32, generator=gen))
    assert I.fallback_summary(pipe.unet)["fallbacks"] == {"single key": 1}
    with pytest.raises(I.AllCallsFellBackError, match=r"^backend pasa: the one attention call fell back "
                                                      r"\(single key: 1\); none ran the backend itself"):
        I.fallback_summary(pipe.unet, strict=True)


# ---------------------------------------------------------------------------------------------- restore


def test_restore_puts_back_the_same_objects(pipe):
    originals = {**pipe.unet.attn_processors, **{f"vae.{k}": v for k, v in pipe.vae.attn_processors.items()}}
    I.apply(pipe, "pasa", vae=True)
    I.apply(pipe, "fp32", spatial=False)
    assert all(type(p) is not AttnProcessor2_0 for p in pipe.unet.attn_processors.values())

    I.restore(pipe)
    restored = {**pipe.unet.attn_processors, **{f"vae.{k}": v for k, v in pipe.vae.attn_processors.items()}}
    assert restored.keys() == originals.keys()
    assert all(restored[key] is originals[key] for key in originals)
    with pytest.raises(ValueError, match="apply"):
        I.restore(pipe)


def test_restore_without_apply_raises(pipe):
    with pytest.raises(ValueError, match="restore"):
        I.restore(pipe.unet)
    with pytest.raises(ValueError, match="restore"):
        I.restore(pipe)


# ---------------------------------------------------------------------------------------------- bad arguments


def test_unknown_backend_lists_valid_ones_and_changes_nothing(pipe):
    before = pipe.unet.attn_processors
    with pytest.raises(ValueError, match=r"unknown backend='flash-attn'.*'pasa-paper-hybrid'"):
        I.apply(pipe, "flash-attn")
    after = pipe.unet.attn_processors
    assert all(after[key] is before[key] for key in before)
    with pytest.raises(ValueError, match="restore"):
        I.restore(pipe)


@pytest.mark.parametrize(
    "backend, options, match",
    [
        ("fp32", {"beta": 0.5}, "takes no options"),
        ("pasa-half", {"precision": "hybrid"}, "fixes"),
        ("pasa", {"precision": "fp4"}, r"^apply\(backend='pasa'\): unknown precision='fp4'"),
        ("pasa", {"shift": "bogus"}, r"^apply\(backend='pasa'\): unknown shift='bogus'; expected one of"),
        ("pasa", {"beta": 5.0}, r"^apply\(backend='pasa'\): beta must be a number in \(0, 1\), got beta=5.0"),
        ("pasa-paper", {"beta": True}, r"beta must be a number in \(0, 1\), got beta=True"),
        ("pasa", {"beta": 0.5}, r"^apply\(backend='pasa'\): beta=0.5 is the strength of PASA's shift, which "
                                r"shift='exact' does not read; pass shift='pasa' with it, or leave beta out$"),
        ("pasa-int8", {"beta": 0.5}, r"beta=0.5 is the strength of PASA's shift, which shift='exact' does not read"),
        ("pasa-half", {"dtype": torch.bfloat16},
         r"^apply: backend='pasa-half' \(precision='half'\) takes float16 attention inputs, got dtype=torch.bfloat16"),
        ("naive-half", {"dtype": torch.float32}, r"takes float16 attention inputs, got dtype=torch.float32"),
        ("fp32", {"dtype": "half"}, "dtype must be a floating torch.dtype"),
    ],
)
def test_bad_options_fail_at_install_time_and_install_nothing(pipe, backend, options, match):
    before = pipe.unet.attn_processors
    with pytest.raises(ValueError, match=match):
        I.apply(pipe, backend, **options)
    assert all(pipe.unet.attn_processors[key] is before[key] for key in before)


@pytest.mark.parametrize("options, match", [({"shift": "bogus"}, "unknown shift='bogus'"),
                                            ({"beta": 5.0}, "got beta=5.0"),
                                            ({"precision": "half", "dtype": torch.bfloat16},
                                             "precision='half' takes float16 inputs, got dtype=torch.bfloat16")])
def test_pasa_processor_checks_its_options_when_made(options, match):
    with pytest.raises(ValueError, match=rf"^PASAAttnProcessor: .*{match}"):
        P.PASAAttnProcessor(**options)


def test_models_without_attention_are_rejected(pipe):
    with pytest.raises(ValueError, match="Linear"):
        I.apply(torch.nn.Linear(4, 4))
    for fn in (I.apply, I.fallback_summary):  # one refusal for both, naming the function and the type
        with pytest.raises(ValueError, match=rf"^{fn.__name__}: expected a diffusers model with attention processors "
                                             r"or a pipeline, got object$"):
            fn(object())
        with pytest.raises(ValueError, match=rf"^{fn.__name__}: Linear has no attention modules$"):
            fn(torch.nn.Linear(4, 4))
    vae = AutoencoderKL(block_out_channels=(32,), norm_num_groups=8, mid_block_add_attention=False)
    with pytest.raises(ValueError, match="no attention modules"):
        I.apply(vae)
    with pytest.raises(ValueError, match="nothing selected"):
        I.apply(pipe, spatial=False, temporal=False)


def _fake_peer_modules(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Stand-ins for ``fa3_fwd_interface`` and ``sageattention`` that record each call (the packages need a
    CUDA GPU): FA3 returns ``(q, lse)``, SageAttention subtracts K's mean in place as the real one does."""
    import sys
    import types

    calls: list[dict] = []

    def flash_attn_func(q, k, v, **kwargs):
        calls.append({"peer": "fa3", "q": q, "k": k, "v": v, **kwargs})
        return (q.float() + 1).to(torch.bfloat16), None

    def sageattn(q, k, v, **kwargs):
        calls.append({"peer": "sage", "q": q, "k": k, "v": v, **kwargs})
        k.sub_(k.mean(dim=1 if kwargs["tensor_layout"] == "NHD" else 2, keepdim=True))
        return q * 2

    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    monkeypatch.setitem(sys.modules, "sageattention", types.SimpleNamespace(sageattn=sageattn))
    return calls


def test_the_peers_are_wrapped_once_for_the_processors_and_the_bench(monkeypatch):
    """``peers.PEERS`` (the processors) and ``peers.prepare`` (``bench/``) hand FA3 and SageAttention the same
    converted tensors and scale; the converted copies and SageAttention's own key are made once, up front."""
    from pasa_diffusers import peers

    calls = _fake_peer_modules(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, 16, generator=gen, dtype=torch.float16) for _ in range(3))  # (B, N, H, D)
    key_before = k.clone()
    out = peers.PEERS["fa3"](q, k, v, 0.25)
    assert out.dtype == torch.float16 and torch.equal(out, (q.bfloat16() + 1).half())
    assert calls[-1]["q"].dtype == torch.bfloat16 and calls[-1]["softmax_scale"] == 0.25
    peers.PEERS["fa3-fp8"](q, k, v, None)
    assert calls[-1]["q"].dtype == torch.float8_e4m3fn and calls[-1]["k_descale"].shape == (2, 4)
    assert torch.equal(peers.PEERS["sage"](q, k, v, 0.5), q * 2)
    assert calls[-1]["tensor_layout"] == "NHD" and calls[-1]["sm_scale"] == 0.5 and calls[-1]["k"] is not k
    assert torch.equal(k, key_before), "SageAttention centres its own copy of K, not the caller's"
    run = peers.prepare("fa3", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bhnd")
    made = len(calls)
    assert torch.equal(run(), q.bfloat16() + 1) and torch.equal(run(), q.bfloat16() + 1)
    assert len(calls) == made + 2 and calls[-1]["q"] is calls[-2]["q"], "the bf16 copies are made once"
    run = peers.prepare("sage", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bhnd")
    run()
    assert calls[-1]["tensor_layout"] == "HND" and calls[-1]["sm_scale"] is None
    with pytest.raises(ValueError, match=r"^peers.prepare: unknown peer='cudnn'"):
        peers.prepare("cudnn", q, k, v)


def test_every_fallback_is_decided_in_fallbacks_with_its_reason():
    """``fallbacks.call_reason`` (what a routed call carries) and ``fallbacks.processor_reason`` (what the
    processor's op cannot take) name every fallback; each reason is one of ``fallbacks.REASONS``."""
    from types import SimpleNamespace

    from pasa_diffusers import fallbacks

    key = torch.zeros(2, 300, 4, 32)  # (B, N, H, D)
    cp = SimpleNamespace(context_parallel_config=SimpleNamespace(ring_degree=2, ulysses_degree=1))
    one_rank = SimpleNamespace(context_parallel_config=SimpleNamespace(ring_degree=1, ulysses_degree=1))
    padding, per_query = torch.ones(2, 1, 1, 300, dtype=torch.bool), torch.ones(2, 1, 7, 300, dtype=torch.bool)
    cases = [  # (mask, dropout_p, is_causal, attention_kwargs, parallel_config) -> reason
        ((None, 0.0, False, None, None), None),
        ((None, 0.0, False, {"x": 1}, None), "attention kwargs"),
        ((None, 0.0, False, {"x": 1}, one_rank), "context parallel"),
        ((None, 0.0, True, None, None), "causal"),
        ((None, 0.1, False, None, None), "dropout"),
        ((None, 0.0, True, None, one_rank), "causal"),
        ((None, 0.0, True, None, cp), "context parallel"),
        ((per_query, 0.0, False, None, cp), "context parallel"),
        ((padding, 0.0, False, None, cp), None),
        ((per_query, 0.0, False, None, None), None),  # the processor decides on the mask
    ]
    for (mask, dropout_p, is_causal, kwargs, config), reason in cases:
        assert fallbacks.call_reason(key, mask, dropout_p, is_causal, kwargs, config) == reason, (mask, reason)
    pasa, int8, peer, sdpa = (P.PASAAttnProcessor(), P.PASAAttnProcessor(precision="int8"),
                              P.PeerAttnProcessor("flash"), P.SDPAAttnProcessor())
    bias = torch.randn(2, 1, 1, 300)
    one_key, one_block = torch.zeros(2, 1, 4, 32), torch.zeros(2, 128, 4, 32)
    assert [p.fallback_reason(None, one_key, None) for p in (pasa, int8, peer, sdpa)] == \
        ["single key", "single key", None, None]
    assert [p.fallback_reason(None, key, bias) for p in (pasa, int8, peer, sdpa)] == \
        ["attention mask", "attention mask", "attention mask", None]
    assert [p.fallback_reason(None, one_block, padding[..., :128]) for p in (pasa, int8, peer)] == \
        [None, "one key block", None]
    assert [p.fallback_reason(None, key, None) for p in (pasa, int8, peer, sdpa)] == [None] * 4
    assert set(fallbacks.PROCESSOR_REASONS) <= set(fallbacks.REASONS)
    assert all(set(p.fallback_cases) <= set(fallbacks.PROCESSOR_REASONS) for p in (pasa, int8, peer, sdpa))


@pytest.mark.parametrize("peer", ["cudnn", "efficient", "fa3", "fa3-fp8", "sage"])
def test_a_cuda_only_peer_on_cpu_tensors_is_one_clear_error(peer):
    """``apply(pipe, "cudnn")`` on a model left on the CPU: the first attention call names the backend and the
    device (was torch's "No viable backend" deep inside SDPA, or the peer's own import or kernel error)."""
    query = torch.randn(1, 8, 2, 32)
    with pytest.raises(ValueError, match=rf"^PeerAttnProcessor: backend '{peer}' runs on CUDA tensors only, and "
                                         r"this attention's query is on cpu"):
        P.PeerAttnProcessor(peer).attention(query, query, query, None)


def test_the_flash_peer_runs_on_cpu_tensors():
    query = torch.randn(1, 8, 2, 32)
    out = P.PeerAttnProcessor("flash").attention(query, query, query, None)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, query, query))).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-6)
