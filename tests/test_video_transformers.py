"""``apply`` on diffusers' video transformers: their own processors, attention routed to the backend.

Every family (``pipelines.video_dits``: Wan, HunyuanVideo, LTX-Video, CogVideoX, Mochi, tiny random
configs) is checked against a float64 golden: the stock model run in float64.  Tolerance rule: the
backend's error is at most ``K x`` the error of the reference of the same precision, the stock model
in fp32 for the unrounded op (``precision="fp64"``), SDPA on fp16 copies for the default (the
processors cast the fp32 model's q, k, v to fp16 for both).  ``K = 2``: both round the attention
output to the same dtype once; the rest of the model is the same code.
"""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from pasa_diffusers import masks
from pasa_diffusers import install as I
from pasa_diffusers import processors as P
from pasa_diffusers import routing
from pasa_diffusers.pipelines.video_dits import (FAMILIES, FULL_SIZE, LATENTS, VIDEO_SIZES, example_inputs,
                                                 full_size_inputs, full_size_transformer, tiny_transformer,
                                                 video_tokens)

K = 2.0
TINY = 1e-12

MASKED_OTHER = {"hunyuan-video": {"attention mask": 1}}
"""Documented fallbacks per family: HunyuanVideo's text refiner attends with a query x key mask."""


def _rel(out: torch.Tensor, gold: torch.Tensor) -> float:
    return ((out.double() - gold).norm() / gold.norm()).item()


def _forward(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def _golden(family: str, inputs) -> torch.Tensor:
    model = tiny_transformer(family).double()
    doubled = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    return _forward(model, doubled)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_attention_call_goes_through_the_backend(family, gen):
    model = tiny_transformer(family)
    inputs = example_inputs(family, model, gen)
    stock = _forward(model, inputs)
    gold = _golden(family, inputs)

    summary = I.apply(model, "pasa", precision="fp64")
    out = _forward(model, inputs)
    counters = I.fallback_summary(model)
    assert summary["installed"] == len(I.attention_processors(model)) > 0
    assert counters["calls"] >= summary["installed"]
    assert counters["fallbacks"] == MASKED_OTHER.get(family, {})
    video = [names for kind, names in summary["processors"].items() if kind.startswith("video") and names]
    assert video and all(" via " in names for names in video), summary["processors"]  # the model's own bodies
    assert torch.isfinite(out).all()
    assert _rel(out, gold) <= K * _rel(stock, gold) + TINY

    I.restore(model)
    assert torch.equal(_forward(model, inputs), stock)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_backend_within_the_bound_of_sdpa_in_the_same_precision(family, gen):
    model = tiny_transformer(family)
    inputs = example_inputs(family, model, gen)
    gold = _golden(family, inputs)
    summary = I.apply(model, "sdpa", dtype=torch.float16)
    sdpa = _forward(model, inputs)
    sdpa_calls = I.fallback_summary(model)["calls"]
    I.apply(model, "pasa")
    out = _forward(model, inputs)
    assert summary["attention_dtype"] == "float16"
    assert I.fallback_summary(model)["calls"] == sdpa_calls
    assert _rel(out, gold) <= K * _rel(sdpa, gold) + TINY


def test_routed_processor_keeps_the_stock_signature_and_state():
    model = tiny_transformer("wan")
    key, stock = next(iter(I.attention_processors(model).items()))
    I.apply(model, "pasa")
    installed = I.attention_processors(model)[key]
    assert isinstance(installed, routing.RoutedAttnProcessor) and isinstance(installed, type(stock))
    assert installed.stock is stock and isinstance(installed.counted, P.PASAAttnProcessor)
    assert inspect.signature(installed.__call__) == inspect.signature(stock.__call__)
    I.apply(model, "sdpa")  # a second apply routes the stock processor again, not the routed one
    again = I.attention_processors(model)[key]
    assert again.stock is stock and isinstance(again.counted, P.SDPAAttnProcessor)
    I.restore(model)
    assert I.attention_processors(model)[key] is stock


def test_a_deep_copy_of_a_routed_model_counts_its_own_calls(gen):
    """``copy.deepcopy`` of a routed model: the copy's bodies are bound to the copy's counters, not the original's."""
    import copy

    model = tiny_transformer("wan")
    I.apply(model, "sdpa")
    inputs = example_inputs("wan", model, gen)
    twin = copy.deepcopy(model)
    _forward(twin, inputs)
    assert I.fallback_summary(twin)["calls"] > 0
    assert I.fallback_summary(model)["calls"] == 0
    torch.testing.assert_close(_forward(model, inputs), _forward(twin, inputs))


def test_a_processor_without_an_attention_call_to_route_is_refused():
    class Opaque:
        def __call__(self, attn, hidden_states, **kwargs):
            return hidden_states

    assert "calls neither diffusers' dispatch_attention_fn nor F.scaled_dot_product_attention" in (
        routing.routable_reason(Opaque()))
    with pytest.raises(ValueError, match=r"^routed: Opaque calls neither"):
        routing.routed(Opaque(), P.SDPAAttnProcessor())


def test_video_kinds_select_by_flag():
    model = tiny_transformer("wan")
    summary = I.apply(model, "pasa", cross=False)
    assert summary["counts"]["video-self"] == 2 and summary["counts"]["video-cross"] == 2
    assert summary["installed"] == 2
    with pytest.raises(ValueError, match=r"nothing selected \(spatial=True, temporal=True, video=False"):
        I.apply(tiny_transformer("wan"), "pasa", video=False)


def _bnhd(gen, b, n, h, d):
    return torch.randn(b, n, h, d, generator=gen).half()


@pytest.mark.parametrize("mask_kind", ["bool", "additive-inf", "additive-10000"])
def test_key_padding_mask_runs_the_op_on_the_kept_keys(mask_kind, gen):
    """A mask that only removes keys (HunyuanVideo's joint attention, LTX-Video's cross-attention) is
    computed by the op on each batch element's kept keys: equal to the op on those keys, and within the
    hybrid bound of SDPA fp32 with the mask."""
    q, k, v = _bnhd(gen, 2, 40, 2, 32), _bnhd(gen, 2, 30, 2, 32), _bnhd(gen, 2, 30, 2, 32)
    keep = torch.ones(2, 30, dtype=torch.bool)
    keep[0, 25:] = False
    keep[1, ::3] = False
    mask = {"bool": keep, "additive-inf": torch.where(keep, 0.0, float("-inf")),
            "additive-10000": (1.0 - keep.float()) * -10000.0}[mask_kind][:, None, None, :].expand(2, 2, 1, 30)
    processor = P.PASAAttnProcessor(precision="fp64")
    assert processor.fallback_reason(q, k, mask) is None
    out = processor.attend(q, k, v, None, mask)
    for b in range(2):
        alone = processor.attention(q[b:b + 1], k[b:b + 1, keep[b]], v[b:b + 1, keep[b]], None)
        assert torch.equal(out[b:b + 1], alone)
    masked = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2),
        attn_mask=keep[:, None, None, :]).transpose(1, 2)
    assert _rel(out, masked) < 1e-12
    assert processor.fallbacks == {}


def test_a_key_padding_mask_is_read_once_per_version(monkeypatch, gen):
    """Every layer gets the same mask: its kept keys are read (a wait for the GPU) at the first call only, read
    again after an in-place change (its version), and at every call for an inference tensor; each answer is
    the mask's own."""
    reads = []
    read = masks._read_kept_keys
    monkeypatch.setattr(masks, "_read_kept_keys", lambda *args: reads.append(args[0]) or read(*args))
    q, k, v = _bnhd(gen, 2, 40, 2, 32), _bnhd(gen, 2, 30, 2, 32), _bnhd(gen, 2, 30, 2, 32)
    keep = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    keep[0, ..., 20:] = False
    processor = P.PASAAttnProcessor(precision="fp64")

    def masked_sdpa(mask):
        return torch.nn.functional.scaled_dot_product_attention(
            q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2),
            attn_mask=mask).transpose(1, 2)

    first = [processor.attend(q, k, v, None, keep) for _ in range(3)]
    assert len(reads) == 1 and all(torch.equal(out, first[0]) for out in first)
    assert _rel(first[0], masked_sdpa(keep)) < 1e-12
    keep[1, ..., :5] = False
    changed = processor.attend(q, k, v, None, keep)
    assert len(reads) == 2 and _rel(changed, masked_sdpa(keep)) < 1e-12
    with torch.inference_mode():
        frozen = keep.clone()
        outs = [processor.attend(q, k, v, None, frozen) for _ in range(2)]
    assert len(reads) >= 4 and all(_rel(out, masked_sdpa(keep)) < 1e-12 for out in outs)
    assert processor.fallbacks == {}


@pytest.mark.parametrize("mask", [
    torch.randn(2, 1, 1, 30),                                       # a bias, not a padding
    torch.ones(2, 1, 40, 30, dtype=torch.bool).tril(),              # per query
    torch.zeros(2, 1, 1, 30, dtype=torch.bool),                     # no key kept
], ids=["bias", "per-query", "nothing-kept"])
def test_other_masks_fall_back_to_sdpa(mask, gen):
    q, k = _bnhd(gen, 2, 40, 2, 32), _bnhd(gen, 2, 30, 2, 32)
    assert masks.key_padding(mask, 2, 30) is None
    assert P.PASAAttnProcessor().fallback_reason(q, k, mask) == "attention mask"


def test_peers_are_backends_and_a_missing_package_is_named(gen):
    """FA3 (bf16, fp8) and SageAttention are backends when their packages are installed; without them
    ``apply`` says which package to install, in one line, before touching the model."""
    from pasa_diffusers import backends

    model = tiny_transformer("wan")
    before = I.attention_processors(model)
    for name, (module, package) in [(b.name, b.requires) for b in backends.BACKENDS.values() if b.requires]:
        reason = backends.missing(name)
        if reason is None:
            continue
        assert reason == (f"backend {name!r} needs the {package} package (module {module}), which is not "
                          f"installed: pip install {package}")
        with pytest.raises(ValueError, match=rf"^apply: backend '{name}' needs the {package} package"):
            I.apply(model, name)
        assert I.attention_processors(model) == before


def test_an_sdpa_backend_peer_routes_like_the_others(gen):
    model = tiny_transformer("ltx-video")
    inputs = example_inputs("ltx-video", model, gen)
    stock = _forward(model, inputs)
    I.apply(model, "flash")  # SDPA's flash backend, which the CPU build of torch has too
    out = _forward(model, inputs)
    counters = I.fallback_summary(model)
    # its text mask removes padded keys: the peer runs on each sample's kept keys, no fallback
    assert counters["backends"] == ["flash"] and counters["fallbacks"] == {} and counters["calls"] > 0
    gold = _golden("ltx-video", inputs)
    assert _rel(out, gold) <= K * _rel(stock, gold) + TINY


# ---- full-size configs, on the meta device (no memory, no arithmetic) --------------------------------------

PARAMETERS = {
    "wan2.1-1.3b": 1.42e9,    # published "1.3B"; its fp32 checkpoint of 5.68 GB holds 1.42B (a size from memory)
    "wan2.1-14b": 14.3e9,     # "14B"
    "cogvideox-5b": 5.57e9,   # "5B"
    "hunyuan-video": 12.8e9,  # "13B" (the paper: "over 13 billion"); its bf16 checkpoint of 25.6 GB holds 12.8B
    "ltx-video": 1.92e9,      # "2B" (ltx-video-2b-v0.9)
    "mochi-1": 10.0e9,        # "10B" (genmo: "a 10 billion parameter diffusion model")
}
"""Parameters of each released transformer, as ``FULL_SIZE``'s docstring states them (3 digits; the checkpoint sizes
and quotes beside them are from memory, not checked offline)."""

VIDEO_TOKENS = {
    ("wan2.1-1.3b", "480p"): 32_760, ("wan2.1-1.3b", "720p"): 75_600,
    ("wan2.1-14b", "480p"): 32_760, ("wan2.1-14b", "720p"): 75_600,
    ("cogvideox-5b", "480x720x49"): 17_550,
    ("hunyuan-video", "720p"): 118_800, ("hunyuan-video", "540p"): 67_320,
    ("ltx-video", "512x704x161"): 7_392,
    ("mochi-1", "480x848x19"): 6_360, ("mochi-1", "480x848x163"): 44_520,
}
"""Video tokens of every size, as ``VIDEO_SIZES``'s docstring and bench.dit's table state them."""


def test_every_full_size_model_and_size_is_documented():
    assert set(PARAMETERS) == set(FULL_SIZE)
    assert set(VIDEO_TOKENS) == {(name, size) for name, (_, _, family) in FULL_SIZE.items()
                                 for size in VIDEO_SIZES[family]}


@pytest.mark.parametrize("name", list(FULL_SIZE))
def test_full_size_model_builds_on_meta_with_the_documented_parameter_count(name):
    model = full_size_transformer(name, device="meta", dtype=torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert abs(count / PARAMETERS[name] - 1) < 0.01, f"{name}: {count:,} parameters"


@contextlib.contextmanager
def _meta_forward_allowed(monkeypatch):
    """Two things diffusers' Mochi does that the meta device refuses: ``torch.autocast("meta")`` around its RoPE
    (made a no-op) and ``torch.nonzero`` of its text mask, per sample (every token is kept: the meta kernel may
    assume so)."""
    autocast = torch.autocast

    def no_meta_autocast(device_type, *args, **kwargs):
        return contextlib.nullcontext() if device_type == "meta" else autocast(device_type, *args, **kwargs)

    monkeypatch.setattr(torch, "autocast", no_meta_autocast)
    with torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
        yield


def _attention_lengths(model, inputs) -> set[tuple[int, int | None]]:
    """(query tokens, encoder tokens or None) of every attention module's call in one forward of ``model``."""
    seen: set[tuple[int, int | None]] = set()

    def record(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        encoder = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
        seen.add((hidden.shape[1], None if encoder is None else encoder.shape[1]))

    hooks = [model.get_submodule(key.removesuffix(".processor")).register_forward_pre_hook(record, with_kwargs=True)
             for key in I.attention_processors(model)]
    try:
        with torch.no_grad():
            out = model(**inputs)[0]
    finally:
        for hook in hooks:
            hook.remove()
    assert out.shape == inputs["hidden_states"].shape and out.is_meta  # the prediction has the latents' shape
    return seen


@pytest.mark.parametrize("name, size", list(VIDEO_TOKENS))
def test_full_size_inputs_run_a_meta_forward_at_the_documented_tokens(name, size, monkeypatch):
    """The inputs ``bench.dit`` gives each model run its forward (on the meta device: shapes and dtypes only), and
    its attention sees the documented tokens: video queries attending to the pipeline's text tokens (cross- or
    joint attention), every call's lengths of video, text or both joined."""
    family = FULL_SIZE[name][2]
    latent = LATENTS[family]
    model = full_size_transformer(name, device="meta", dtype=torch.bfloat16)
    inputs = full_size_inputs(name, model, size)
    video, text = video_tokens(name, size), latent.text_tokens
    assert video == VIDEO_TOKENS[name, size]
    assert inputs["hidden_states"].shape[0] == inputs["encoder_hidden_states"].shape[0] == latent.batch
    assert inputs["encoder_hidden_states"].shape[1] == text
    assert inputs["hidden_states"].dtype == torch.bfloat16
    with _meta_forward_allowed(monkeypatch):
        seen = _attention_lengths(model, inputs)
    assert (video, text) in seen, seen
    assert {n for pair in seen for n in pair if n is not None} <= {video, text, video + text}, seen


def test_full_size_inputs_refuse_a_size_or_frame_count_the_pipeline_does_not_take():
    model = full_size_transformer("ltx-video", device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^ltx-video: unknown resolution='480p'; expected one of \('512x704x161',\)"):
        full_size_inputs("ltx-video", model, "480p")
    with pytest.raises(ValueError, match=r"^ltx-video: frames=120 is not 8k \+ 1"):
        full_size_inputs("ltx-video", model, frames=120)
    assert full_size_inputs("ltx-video", model, frames=81)["num_frames"] == 11


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("backend,options", [("sdpa", {}), ("pasa", {"precision": "fp64"})], ids=["sdpa", "pasa"])
def test_compiled_transformer_traces_once_and_matches_eager(family, backend, options, gen):
    """``torch.compile(fullgraph=True)`` of a routed transformer: one graph (the routed bodies hold no
    per-call Python state that dynamo cannot trace), no recompile on new inputs, eager's output (masked calls
    run SDPA with their mask when compiled: ``masks.mask_reason``)."""
    from torch._dynamo.testing import CompileCounter

    model = tiny_transformer(family)
    I.apply(model, backend, **options)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    try:
        for _ in range(2):
            inputs = example_inputs(family, model, gen)
            torch.testing.assert_close(_forward(compiled, inputs), _forward(model, inputs))
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
