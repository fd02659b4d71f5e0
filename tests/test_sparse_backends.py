"""The sparse backends (issue 46, item 3): ``SparsePASAAttnProcessor`` on a video transformer's self-attention,
bound to a generation by ``pipelines.sparse.sparse_bound``, through ``install.apply``, ``video.generate`` and
``pasa generate``.

The processor's sparse call is checked against its meaning, computed independently: float64 SDPA in the model's
token order with the mask's element mask mapped back from the mask's order (``TokenOrder.inverse``), so a wrong
reorder, undo or mask shows.  Its tolerance is the dense rule of ``test_kernel_interpret.py`` (``K`` times the
error of the variant's reference on the same keys, the reference run with the block mask in the mask's order:
the processor rounds where that reference does), and the mask must matter: the dense output is far from the
masked golden.  Inputs are fresh draws (the ``gen`` seed, printed), keys with a bias (the sequence bias PASA's
shift removes).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pasa_diffusers import numerics, pasa_attention
from pasa_diffusers import reference as R
from pasa_diffusers.backends import BACKENDS, SELF_KIND
from pasa_diffusers.install import apply, module_kind
from pasa_diffusers.pipelines.names import COVERAGE_MASKS
from pasa_diffusers.processors import PASAAttnProcessor
from pasa_diffusers.sparse_processor import SparsePASAAttnProcessor
from pasa_diffusers.video_masks import MASK_KINDS, VideoTokens
from tests.test_kernel_interpret import K_BOUND, TINY

TOKENS = VideoTokens(3, 16, 16)
"""768 video tokens: six blocks of 128, each a 1x8x16 tile in the tile order (2 rows of the frame)."""
MASKS = {"tile-window": {"window": (0, 1, 1)}, "radial": {"spatial_window": 1}, "pooled": {"keep": 0.5}}
"""Parameters that drop blocks at ``TOKENS`` (each mask's density is checked below one)."""


def _processor(mask: str = "tile-window", *, step: int = 5, layer: int = 3, kind: str = SELF_KIND,
               **options) -> SparsePASAAttnProcessor:
    processor = SparsePASAAttnProcessor(mask=mask, **{**MASKS[mask], "dense_steps": 2, "dense_layers": 1, **options})
    processor.kind, processor.name = kind, "blocks.3.attn1"
    processor.bind(TOKENS, layer=layer, device="cpu")
    processor.at_step(step)
    return processor


def _qkv(gen: torch.Generator, n: int = TOKENS.n_tokens, heads: int = 2, d: int = 32):
    """(B, N, H, D) fp16, as diffusers' processors hold them; keys biased."""
    q = torch.randn(1, n, heads, d, generator=gen)
    k = torch.randn(1, n, heads, d, generator=gen) + 2.0 * torch.randn(d, generator=gen)
    v = torch.randn(1, n, heads, d, generator=gen)
    return q.half(), k.half(), v.half()


def _bhnd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


@pytest.mark.parametrize("order", ["tile", "model"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_a_sparse_call_is_the_masked_attention_in_the_models_order(mask, order, gen):
    processor = _processor(mask, order=order)
    q, k, v = _qkv(gen)
    out = processor.attention(q, k, v, None)
    assert processor.sparse_calls == 1 and processor.dense_calls == {}

    bound = processor.binding
    perm = bound.order.perm if bound.order is not None else torch.arange(TOKENS.n_tokens)
    inverse = torch.argsort(perm)
    qo, ko, vo = (_bhnd(x[:, perm]) for x in (q, k, v))
    block_mask = bound.build(qo, ko)
    element = block_mask.element_mask()[..., inverse, :][..., inverse]  # the mask in the model's order
    assert element.double().mean() < 0.9, "the mask keeps (almost) every pair: the check below would be weak"
    golden = F.scaled_dot_product_attention(*(_bhnd(x).double() for x in (q, k, v)), attn_mask=element)
    reference = R.exact_shift_reference(qo, ko, vo, precision="hybrid", block_mask=block_mask)[..., inverse, :]
    err, err_ref = numerics.rel_rmse(_bhnd(out), golden), numerics.rel_rmse(reference, golden)
    bound_ = K_BOUND["exact", "hybrid"] * err_ref + TINY
    assert torch.isfinite(out).all() and err <= bound_, f"{err:.3e} > {bound_:.3e}"
    dense = pasa_attention(q, k, v, layout="bnhd")
    assert numerics.rel_rmse(_bhnd(dense), golden) > 100 * bound_, "the mask did not change the attention"


@pytest.mark.gpu
@pytest.mark.parametrize("mask", list(MASKS))
def test_gpu_a_sparse_call_is_the_masked_attention_in_the_models_order(mask, gen):
    """The same on CUDA tensors: the portable kernel skipping the missing blocks, the mask built on the GPU."""
    processor = SparsePASAAttnProcessor(mask=mask, **MASKS[mask], dense_steps=0, dense_layers=0)
    processor.kind, processor.name = SELF_KIND, "blocks.3.attn1"
    processor.bind(TOKENS, layer=0, device="cuda")
    q, k, v = _qkv(gen)
    out = processor.attention(q.cuda(), k.cuda(), v.cuda(), None).cpu()
    bound = processor.binding
    perm, inverse = bound.order.perm.cpu(), bound.order.inverse.cpu()
    qo, ko, vo = (_bhnd(x[:, perm]) for x in (q, k, v))
    block_mask = bound.build(qo.cuda(), ko.cuda())
    element = block_mask.element_mask().cpu()[..., inverse, :][..., inverse]
    golden = F.scaled_dot_product_attention(*(_bhnd(x).double() for x in (q, k, v)), attn_mask=element)
    reference = R.exact_shift_reference(qo, ko, vo, precision="hybrid", block_mask=block_mask.to("cpu"))
    reference = reference[..., inverse, :]
    err, err_ref = numerics.rel_rmse(_bhnd(out), golden), numerics.rel_rmse(reference, golden)
    bound_ = K_BOUND["exact", "hybrid"] * err_ref + TINY
    assert processor.sparse_calls == 1 and torch.isfinite(out).all() and err <= bound_, f"{err:.3e} > {bound_:.3e}"


@pytest.mark.parametrize("step, layer, sparse", [(1, 3, False), (5, 0, False), (2, 1, True)],
                         ids=["dense-step", "dense-layer", "first-sparse"])
def test_the_schedule_runs_the_first_steps_and_layers_dense(step, layer, sparse, gen):
    processor = _processor(step=step, layer=layer)
    q, k, v = _qkv(gen)
    out = processor.attention(q, k, v, None)
    dense = PASAAttnProcessor().attention(q, k, v, None)
    assert torch.equal(out, dense) != sparse
    assert (processor.sparse_calls, processor.dense_calls) == ((1, {}) if sparse else (0, {"schedule": 1}))


def test_other_modules_and_the_one_key_block_fallback_run_dense(gen):
    q, k, v = _qkv(gen)
    cross = _processor(kind="video-cross")
    assert torch.equal(cross.attention(q, k, v, None), PASAAttnProcessor().attention(q, k, v, None))
    assert (cross.sparse_calls, cross.dense_calls) == (0, {})
    fp8 = _processor(precision="fp8")
    short = tuple(x[:, :100] for x in (q, k, v))
    assert fp8.fallback_reason(short[0], short[1], None) == "one key block"


def test_a_padded_prompt_after_the_video_stays_sparse(gen):
    """Text after the video (HunyuanVideo, Mochi) with its padding at the end: each batch element attends its kept
    keys with the mask's blocks over them: the masked golden with the padding removed too."""
    tokens = VideoTokens(3, 16, 16, text=20, text_at="last")
    processor = SparsePASAAttnProcessor(mask="tile-window", window=(0, 1, 1), dense_steps=0, dense_layers=0)
    processor.kind, processor.name = SELF_KIND, "transformer_blocks.0.attn"
    processor.bind(tokens, layer=0, device="cpu")
    q, k, v = (torch.cat([x, y]) for x, y in zip(_qkv(gen, tokens.n_tokens), _qkv(gen, tokens.n_tokens)))
    kept = torch.ones(2, 1, 1, tokens.n_tokens, dtype=torch.bool)
    kept[0, ..., -5:] = False
    kept[1, ..., -9:] = False
    out = processor.attention(q, k, v, None, kept)
    assert (processor.sparse_calls, processor.dense_calls) == (1, {})

    order = processor.binding.order
    qo, ko = (_bhnd(x[:, order.perm]) for x in (q, k))
    element = processor.binding.build(qo, ko).element_mask()[..., order.inverse, :][..., order.inverse]
    golden = F.scaled_dot_product_attention(*(_bhnd(x).double() for x in (q, k, v)), attn_mask=element & kept)
    references = []
    for b, n in enumerate((tokens.n_tokens - 5, tokens.n_tokens - 9)):
        qb = _bhnd(q[b:b + 1, order.perm])
        kb, vb = (_bhnd(x[b:b + 1, order.perm][:, :n]) for x in (k, v))
        mask = processor.binding.build(qb, kb).prefix(tokens.n_tokens, n)
        references.append(R.exact_shift_reference(qb, kb, vb, precision="hybrid", block_mask=mask))
    reference = torch.cat(references)[..., order.inverse, :]
    err, err_ref = numerics.rel_rmse(_bhnd(out), golden), numerics.rel_rmse(reference, golden)
    assert torch.isfinite(out).all() and err <= K_BOUND["exact", "hybrid"] * err_ref + TINY


@pytest.mark.parametrize("mask", ["radial", "pooled"])
def test_a_sequence_without_its_padded_text_is_a_prefix_of_the_grid(mask, gen):
    """Mochi drops a prompt's padded text tokens from the sequence (text last): the call is the bound sequence's
    first ``n`` tokens, run with the mask's blocks over them: the masked golden of that prefix."""
    tokens = VideoTokens(3, 16, 16, text=20, text_at="last")
    processor = SparsePASAAttnProcessor(mask=mask, **MASKS[mask], dense_steps=0, dense_layers=0)
    processor.kind, processor.name = SELF_KIND, "transformer_blocks.0.attn1"
    processor.bind(tokens, layer=0, device="cpu")
    n = tokens.n_tokens - 7
    q, k, v = _qkv(gen, n)
    out = processor.attention(q, k, v, None)
    perm, inverse = processor.binding.order.perm[:n], processor.binding.order.inverse[:n]
    qo, ko, vo = (_bhnd(x[:, perm]) for x in (q, k, v))
    block_mask = processor.binding.build(qo, ko)
    block_mask = block_mask if block_mask.kv_len == n else block_mask.prefix(n, n)
    element = block_mask.element_mask()[..., inverse, :][..., inverse]
    assert element.double().mean() < 0.9
    golden = F.scaled_dot_product_attention(*(_bhnd(x).double() for x in (q, k, v)), attn_mask=element)
    reference = R.exact_shift_reference(qo, ko, vo, precision="hybrid", block_mask=block_mask)[..., inverse, :]
    err, err_ref = numerics.rel_rmse(_bhnd(out), golden), numerics.rel_rmse(reference, golden)
    assert processor.sparse_calls == 1 and err <= K_BOUND["exact", "hybrid"] * err_ref + TINY
    with pytest.raises(ValueError, match=r"attends 767 queries to 767 keys, but it is bound to the 3x16x16 video "
                                         r"tokens \+ 20 text tokens \(788, or a prefix of them holding every video"):
        processor.attention(*(x[:, :767] for x in (q, k, v)), None)


def test_padding_that_is_not_a_prefix_runs_dense_and_is_counted(gen):
    processor = _processor()
    q, k, v = _qkv(gen)
    keep_all = torch.ones(1, 1, 1, TOKENS.n_tokens, dtype=torch.bool)
    processor.attention(q, k, v, None, keep_all)
    drop = keep_all.clone()
    drop[..., :3] = False  # the first video tokens: no prefix of the sequence
    out = processor.attention(q, k, v, None, drop)
    assert torch.equal(out, PASAAttnProcessor().attention(q, k, v, None, drop))
    assert (processor.sparse_calls, processor.dense_calls) == (1, {"key padding": 1})


def test_an_unbound_processor_and_another_grid_are_refused(gen):
    q, k, v = _qkv(gen)
    processor = _processor()
    processor.unbind()
    with pytest.raises(ValueError, match=r"SparsePASAAttnProcessor in blocks\.3\.attn1: not bound to a generation's "
                                         r"token grid.*sparse_bound"):
        processor.attention(q, k, v, None)
    short = tuple(x[:, :700] for x in _qkv(gen))
    with pytest.raises(ValueError, match=r"attends 700 queries to 700 keys, but it is bound to the 3x16x16 video "
                                         r"tokens \+ 0 text tokens \(768, or a prefix"):
        _processor().attention(*short, None)


@pytest.mark.parametrize("options, match", [
    ({"mask": "window"}, "SparsePASAAttnProcessor: MaskChoice: unknown kind='window'"),
    ({"order": "random"}, "SparsePASAAttnProcessor: order must be one of"),
    ({"dense_steps": -1}, "SparsePASAAttnProcessor: SparseSchedule: dense_steps must be an int >= 0"),
    ({"precision": "int4"}, "precision"),
], ids=["mask", "order", "dense-steps", "precision"])
def test_bad_options_name_the_argument(options, match):
    with pytest.raises(ValueError, match=match):
        SparsePASAAttnProcessor(**options)


def test_the_registry_and_the_names():
    assert tuple(COVERAGE_MASKS) == MASK_KINDS
    sparse = {name: entry for name, entry in BACKENDS.items() if entry.needs_kind is not None}
    assert list(sparse) == ["pasa-sparse", "pasa-fp8-sparse"]
    assert all(entry.needs_kind == SELF_KIND and module_kind(f"blocks.0.attn1.processor") == SELF_KIND
               for entry in sparse.values())
    assert [entry.variant.precision for entry in sparse.values()] == ["hybrid", "fp8"]


def test_apply_refuses_a_model_without_a_video_self_attention(pipe):
    with pytest.raises(ValueError, match=r"apply: backend='pasa-sparse' runs on a video transformer's self-attention "
                                         r"\(module kind 'video-self'\), and the modules selected have none"):
        apply(pipe, "pasa-sparse")


# --- a generation ----------------------------------------------------------------------------------------------
SIZE = {"num_frames": 9, "height": 256, "width": 256, "num_inference_steps": 3, "seed": 0, "progress": False}
"""tiny-wan at 3 latent frames of 16 x 16 tokens: 768 tokens, six blocks (classifier-free guidance: two calls per
step and layer)."""


@pytest.fixture(scope="module")
def tiny_wan():
    from pasa_diffusers.pipelines.video import load_video

    return load_video("tiny-wan")


@pytest.mark.slow
def test_a_generation_binds_counts_steps_and_releases(tiny_wan):
    from pasa_diffusers.pipelines.sparse import sparse_processors, sparse_summary
    from pasa_diffusers.pipelines.video import generate

    apply(tiny_wan, "pasa")
    dense = generate(tiny_wan, **SIZE)
    apply(tiny_wan, "pasa-sparse", mask="tile-window", window=(0, 1, 1), dense_steps=1, dense_layers=1)
    sparse = generate(tiny_wan, **SIZE)
    summary = sparse_summary(tiny_wan)
    assert summary["layers"] == 2 and summary["sparse_calls"] == 2 * 2 * 1  # steps 1-2, two passes, layer 1 only
    assert summary["dense_calls"] == {"schedule": 3 * 2 * 2 - 4}
    assert all(p.binding is None for p in sparse_processors(tiny_wan.transformer))
    assert "step" not in vars(tiny_wan.scheduler)
    assert torch.isfinite(torch.as_tensor(sparse)).all() and not (sparse == dense).all()
    apply(tiny_wan, "pasa-sparse", mask="tile-window", window=(9, 99, 99), dense_steps=0, dense_layers=0,
          order="model")
    assert (generate(tiny_wan, **SIZE) == dense).all(), "a mask that keeps every block runs as no mask"


@pytest.mark.slow
def test_the_command_runs_a_sparse_backend(tmp_path, capsys):
    from pasa_diffusers.cli import main

    argv = ["generate", "--model", "tiny-wan", "--height", "256", "--width", "256", "--steps", "2", "--formats",
            "gif", "--attention", "pasa-sparse", "--mask", "radial", "--spatial-window", "1", "--dense-steps", "1",
            "--dense-layers", "0", "--out", str(tmp_path)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert ("sparse: radial (spatial window 1, 1 sink frame(s)) (density 0.778) in tile order on 2 self-attention "
            "layers; 4 of 8 calls sparse, 4 dense (schedule: 4) (dense for the first 1 steps and 0 layers)") in lines


@pytest.mark.parametrize("argv, message", [
    (["--mask", "radial"], "--mask: set(s) the mask of a sparse backend (pasa-sparse, pasa-fp8-sparse), and "
                           "--attention pasa runs none"),
    (["--attention", "pasa-sparse", "--window", "1,1,1"], "--window: sets the tile-window mask, and the mask is "
                                                          "radial"),
], ids=["no-sparse-backend", "other-mask"])
def test_the_command_refuses_sparse_flags_that_change_nothing(argv, message, tmp_path, capsys):
    from pasa_diffusers.cli import main

    assert main(["generate", "--model", "tiny-wan", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pasa generate: error: ") and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_compare_scores_a_sparse_backend_against_the_fp32_reference(tmp_path, capsys):
    import json

    from pasa_diffusers.cli import main

    argv = ["compare", "--model", "tiny-wan", "--height", "256", "--width", "256", "--steps", "1", "--seeds", "0",
            "--backends", "pasa-sparse", "--mask", "tile-window", "--window", "0,1,1", "--dense-steps", "0",
            "--dense-layers", "0", "--out", str(tmp_path)]
    assert main(argv) == 0
    record = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert record["backend"] == "pasa-sparse" and record["sparse"]["mask"] == "tile-window (window 0,1,1)"
    assert record["sparse"]["sparse_calls"] == 2 * 2 and record["sparse"]["dense_calls"] == {}
    assert math.isfinite(record["psnr"]) and record["nonfinite_frames"] == 0
    assert ("pasa-sparse: block-sparse mask tile-window (window 0,1,1), density 0.556 on 4 of 4 self-attention "
            "calls (dense for the first 0 steps and 0 layers).") in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_compare_refuses_a_sparse_backend_for_svd_before_any_video(tmp_path, capsys):
    from pasa_diffusers.cli import main

    assert main(["compare", "--backends", "pasa,pasa-sparse", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--backends pasa,pasa-sparse: pasa-sparse mask(s) a video transformer's self-attention" in err
    assert not (tmp_path / "samples.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["tile-window", "pooled"])
def test_a_compiled_transformer_holds_a_dense_and_a_sparse_graph(mask, gen):
    """``torch.compile(fullgraph=True)`` of a routed transformer with the sparse backend: one graph for the dense
    steps and one for the sparse ones (the schedule is a bool per processor, not the step; the pooled mask is built
    in the graph, nothing read back), each eager's output."""
    from torch._dynamo.testing import CompileCounter

    from pasa_diffusers.pipelines.sparse import sparse_bound
    from pasa_diffusers.pipelines.video_dits import example_inputs, tiny_transformer

    model = tiny_transformer("wan")
    apply(model, "pasa-sparse", mask=mask, **MASKS[mask], dense_steps=1, dense_layers=0)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    try:
        with torch.no_grad(), sparse_bound(model, TOKENS) as bound:
            for step in range(3):
                for processor in bound:
                    processor.at_step(step)
                inputs = {**example_inputs("wan", model, gen),
                          "hidden_states": torch.randn(2, model.config.in_channels, 3, 32, 32, generator=gen)}
                torch.testing.assert_close(compiled(**inputs)[0], model(**inputs)[0])
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 2
