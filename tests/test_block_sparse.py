"""Block-sparse masks (issue 46): every exact reference against a dense masked float64 golden, the compact form's
constructors, the video masks and the coverage report.  CPU only, tiny shapes (blocks of 16)."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from pasa_diffusers import reference as R
from pasa_diffusers.block_sparse import BlockSparseMask
from pasa_diffusers.mask_coverage import coverage, coverage_table, plot_coverage, row_coverage
from pasa_diffusers.reference_int8 import int8_reference
from pasa_diffusers.video_masks import (TEXT_FIRST, TEXT_LAST, SparseSchedule, VideoTokens, pooled_mask, radial_mask,
                                        tile_order, tile_window_mask)

BLK = 16
SHAPE = dict(b=2, hq=4, hk=2, nq=45, nk=70, d=16)  # ragged: 45 = 2*16 + 13, 70 = 4*16 + 6; GQA 4 / 2


def _variants():
    """name -> f(q, k, v, mask, return_lse) for every exact reference (the key tile is the mask's block)."""
    kw = dict(block_m=BLK, block_n=BLK)
    return {
        "flash-hybrid": lambda q, k, v, m, lse: R.flash_reference(q, k, v, block_mask=m, return_lse=lse, **kw),
        "pasa-half": lambda q, k, v, m, lse: R.pasa_reference(q, k, v, block_mask=m, return_lse=lse, **kw),
        "pasa-hybrid": lambda q, k, v, m, lse: R.pasa_reference(q, k, v, precision="hybrid", block_mask=m,
                                                                return_lse=lse, **kw),
        "pasa-fp64": lambda q, k, v, m, lse: R.pasa_reference(q, k, v, precision="fp64", block_mask=m,
                                                              return_lse=lse, **kw),
        "exact-hybrid": lambda q, k, v, m, lse: R.exact_shift_reference(q, k, v, block_mask=m, return_lse=lse, **kw),
        "exact-half": lambda q, k, v, m, lse: R.exact_shift_reference(q, k, v, precision="half", block_mask=m,
                                                                      return_lse=lse, **kw),
        "smooth-k": lambda q, k, v, m, lse: R.smooth_k_reference(q, k, v, precision="hybrid", block_mask=m, **kw),
        "int8": lambda q, k, v, m, lse: int8_reference(q, k, v, block_n=BLK, block_mask=m, return_lse=lse),
        "int8-pv8": lambda q, k, v, m, lse: int8_reference(q, k, v, pv_bits=8, block_n=BLK, block_mask=m,
                                                           return_lse=lse),
    }


VARIANTS = _variants()
WITH_LSE = [n for n in VARIANTS if n != "smooth-k"]


def _inputs(kind: str, seed: int, dtype=torch.float16):
    """Fresh random q, k, v (B, H, N, D) of the input classes that matter for the shifts."""
    s = SHAPE
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s["b"], s["hq"], s["nq"], s["d"], generator=gen)
    k = torch.randn(s["b"], s["hk"], s["nk"], s["d"], generator=gen)
    v = torch.randn(s["b"], s["hk"], s["nk"], s["d"], generator=gen)
    if kind == "drift":  # a bias of K that moves between key blocks (PASA's case), and a common bias of q
        k = k + torch.linspace(0.0, 24.0, s["nk"])[:, None] * torch.rand(s["d"], generator=gen)
        q = q + 1.5
    elif kind == "outlier":  # a few keys far out
        k[:, :, torch.randint(0, s["nk"], (5,), generator=gen)] *= 30.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _nq_nk():
    return math.ceil(SHAPE["nq"] / BLK), math.ceil(SHAPE["nk"] / BLK)


def _mask(kind: str, seed: int) -> BlockSparseMask:
    """Random kept blocks with at least one empty query block: per (batch, head), shared, or per key head."""
    nq, nk = _nq_nk()
    gen = torch.Generator().manual_seed(seed)
    lead = {"per-head": (SHAPE["b"], SHAPE["hq"]), "shared": (1, 1), "key-heads": (1, SHAPE["hk"])}[kind]
    dense = torch.rand(lead + (nq, nk), generator=gen) < 0.5
    dense[..., 0, :] = False  # an empty query block
    dense[..., -1, -1] = True  # the ragged tail block visited
    return BlockSparseMask.from_dense(dense, SHAPE["nq"], SHAPE["nk"], block_q=BLK, block_k=BLK)


def _err(out: torch.Tensor, gold: torch.Tensor) -> float:
    return float((out.double() - gold).abs().max())


@pytest.mark.parametrize("input_kind", ["random", "drift", "outlier"])
@pytest.mark.parametrize("mask_kind", ["per-head", "shared", "key-heads"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_with_mask_matches_masked_golden(name, mask_kind, input_kind):
    seed = zlib.crc32(f"{name}-{mask_kind}-{input_kind}".encode()) % 10_000
    q, k, v = _inputs(input_kind, seed)
    mask = _mask(mask_kind, seed)
    f = VARIANTS[name]
    lse_too = name in WITH_LSE
    gold, gold_lse = R.golden_attention(q, k, v, block_mask=mask, return_lse=True)
    dense_gold = R.golden_attention(q, k, v)
    dense = f(q, k, v, None, False)
    got = f(q, k, v, mask, lse_too)
    out, lse = got if lse_too else (got, None)
    assert torch.isfinite(out).all()
    # the tolerance is the variant's own dense error on the same inputs
    tol = 4.0 * _err(dense, dense_gold) + 1e-6
    assert _err(out, gold) <= tol, (name, _err(out, gold), tol)
    empty = ~mask.kept_blocks(SHAPE["b"], SHAPE["hq"]).any(-1).repeat_interleave(BLK, -1)[..., :SHAPE["nq"]]
    assert empty.any()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    if lse_too:
        assert torch.isneginf(lse[empty]).all() and torch.isneginf(gold_lse[empty]).all()
        _, dense_lse = f(q, k, v, None, True)
        lse_tol = 4.0 * float((dense_lse.double() - R.golden_attention(q, k, v, return_lse=True)[1]).abs().max())
        assert float((lse[~empty].double() - gold_lse[~empty]).abs().max()) <= lse_tol + 1e-6


@pytest.mark.parametrize("name", list(VARIANTS))
def test_all_kept_mask_is_bit_identical(name):
    q, k, v = _inputs("drift", 7)
    f = VARIANTS[name]
    lse_too = name in WITH_LSE
    full = BlockSparseMask.full(SHAPE["nq"], SHAPE["nk"], batch=SHAPE["b"], heads=SHAPE["hq"], block_q=BLK,
                                block_k=BLK)
    a, b = f(q, k, v, None, lse_too), f(q, k, v, full, lse_too)
    for x, y in zip(a, b) if lse_too else ((a, b),):
        assert torch.equal(x, y)


def test_golden_all_kept_is_bit_identical():
    q, k, v = _inputs("random", 3)
    full = BlockSparseMask.full(SHAPE["nq"], SHAPE["nk"], block_q=BLK, block_k=BLK)
    for x, y in zip(R.golden_attention(q, k, v, return_lse=True),
                    R.golden_attention(q, k, v, return_lse=True, block_mask=full)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["flash-hybrid", "pasa-half", "pasa-hybrid", "exact-half", "int8"])
def test_skipping_blocks_equals_attending_the_kept_keys_only(name):
    """A query block that keeps blocks {0, 2, 3} of four full ones computes, bit for bit, what the variant computes
    on those keys alone: PASA's block count is the visited blocks' (j = 1, 2, 3), not the block index.  The 8-bit
    spec within one ulp of the output: its fp32 state is not the same in the two calls (their LSEs are 1.9e-6
    apart), so equal output bits would be the fp16 rounding's luck, not a property."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 1, BLK, 16, generator=gen).half()
    k = (torch.randn(1, 1, 4 * BLK, 16, generator=gen) + torch.linspace(0, 20, 4 * BLK)[:, None]).half()
    v = torch.randn(1, 1, 4 * BLK, 16, generator=gen).half()
    keep = torch.tensor([[True, False, True, True]])
    mask = BlockSparseMask.from_dense(keep, BLK, 4 * BLK, block_q=BLK, block_k=BLK)
    idx = torch.cat([torch.arange(b * BLK, (b + 1) * BLK) for b in (0, 2, 3)])
    f = VARIANTS[name]
    got, want = f(q, k, v, mask, False), f(q, k[:, :, idx], v[:, :, idx], None, False)
    if name == "int8":
        torch.testing.assert_close(got, want, rtol=2.0 ** -10, atol=2.0 ** -24)
    else:
        assert torch.equal(got, want)


def test_mask_that_covers_the_mass_gives_a_small_error_and_one_that_misses_it_a_large_one():
    """Planted locality: query block i attends to key block i."""
    n, d = 4 * BLK, 16
    gen = torch.Generator().manual_seed(5)
    centres = 4.0 * torch.randn(4, d, generator=gen)
    q = (centres.repeat_interleave(BLK, 0) + 0.3 * torch.randn(n, d, generator=gen))[None, None]
    k = (centres.repeat_interleave(BLK, 0) + 0.3 * torch.randn(n, d, generator=gen))[None, None]
    v = torch.randn(1, 1, n, d, generator=gen)
    q, k, v = q.half(), k.half(), v.half()
    diag = BlockSparseMask.from_dense(torch.eye(4, dtype=torch.bool), n, n, block_q=BLK, block_k=BLK)
    off = BlockSparseMask.from_dense(torch.eye(4, dtype=torch.bool).roll(1, 1), n, n, block_q=BLK, block_k=BLK)
    gold = R.golden_attention(q, k, v)
    good = R.pasa_reference(q, k, v, block_n=BLK, block_mask=diag)
    bad = R.pasa_reference(q, k, v, block_n=BLK, block_mask=off)
    assert _err(good, gold) < 0.05 < _err(bad, gold)
    assert float(coverage(q, k, diag)) > 0.99 > 0.01 > float(coverage(q, k, off))
    dyn = pooled_mask(q, k, mass=0.9, block_q=BLK, block_k=BLK)
    assert dyn.density <= 0.5 and float(coverage(q, k, dyn)) > 0.99


# --- the compact form -----------------------------------------------------------------------------------------
def test_dense_compact_flex_round_trips():
    gen = torch.Generator().manual_seed(2)
    dense = torch.rand(2, 3, 3, 5, generator=gen) < 0.4
    dense[0, 0, 1] = False
    m = BlockSparseMask.from_dense(dense, 45, 70, block_q=BLK, block_k=BLK)
    assert torch.equal(m.dense_blocks(), dense)
    assert m.kv_counts.dtype == m.kv_indices.dtype == torch.int32
    assert m.kv_counts.shape == (2, 3, 3) and m.kv_indices.shape == (2, 3, 3, 5)
    for row, count, indices in zip(dense.reshape(-1, 5), m.kv_counts.flatten(), m.kv_indices.reshape(-1, 5)):
        assert indices[:count].tolist() == torch.nonzero(row).flatten().tolist()
    elems = m.element_mask()
    assert elems.shape == (2, 3, 45, 70)
    assert torch.equal(elems[..., ::BLK, ::BLK], dense) and torch.equal(elems[..., 44, 69], dense[..., 2, 4])
    assert m.density == pytest.approx(float(elems.float().mean()))
    pytest.importorskip("torch.nn.attention.flex_attention")
    back = BlockSparseMask.from_flex(m.to_flex())
    assert torch.equal(back.dense_blocks(), dense) and (back.q_len, back.kv_len) == (45, 70)


def test_full_mask_density_and_shape():
    m = BlockSparseMask.full(300, 200)
    assert (m.n_q_blocks, m.n_k_blocks, m.density) == (3, 2, 1.0)


@pytest.mark.parametrize("change, match", [
    (dict(kv_counts=torch.tensor([[[5]]], dtype=torch.int32)), "kv_counts must lie"),
    (dict(kv_indices=torch.tensor([[[[1, 0]]]], dtype=torch.int32)), "ascending"),
    (dict(kv_indices=torch.tensor([[[[0, 7]]]], dtype=torch.int32)), "out of range"),
    (dict(kv_counts=torch.tensor([[[2]]], dtype=torch.int64)), "int32"),
    (dict(q_len=40), "block grid"),
    (dict(block_k=0), "block_k must be a positive int"),
])
def test_validate_names_the_field(change, match):
    fields = dict(kv_counts=torch.tensor([[[2]]], dtype=torch.int32),
                  kv_indices=torch.tensor([[[[0, 1]]]], dtype=torch.int32), q_len=10, kv_len=20, block_q=16,
                  block_k=16)
    with pytest.raises(ValueError, match=match):
        BlockSparseMask(**{**fields, **change})


def test_from_dense_errors():
    with pytest.raises(ValueError, match="bool"):
        BlockSparseMask.from_dense(torch.ones(2, 2), 32, 32, block_q=BLK, block_k=BLK)
    with pytest.raises(ValueError, match="block grid"):
        BlockSparseMask.from_dense(torch.ones(2, 3, dtype=torch.bool), 32, 32, block_q=BLK, block_k=BLK)


@pytest.mark.parametrize("q_shape, k_shape, kwargs, match", [
    ((2, 4, 40, 8), (2, 2, 70, 8), {}, "q_len=45"),
    ((3, 4, 45, 8), (3, 2, 70, 8), {}, "batch 2"),
    ((2, 6, 45, 8), (2, 3, 70, 8), {}, "heads 4"),
    ((2, 4, 45, 8), (2, 2, 70, 8), dict(block_n=32), "block_n=32"),
])
def test_check_call_names_the_argument(q_shape, k_shape, kwargs, match):
    mask = _mask("per-head", 1)
    with pytest.raises(ValueError, match=match):
        mask.check_call(torch.empty(q_shape), torch.empty(k_shape), "f", **kwargs)


def test_check_call_device_and_reference_block():
    mask = _mask("shared", 1)
    with pytest.raises(ValueError, match="on cpu but q is on meta"):
        mask.check_call(torch.empty(2, 4, 45, 8, device="meta"), torch.empty(2, 2, 70, 8, device="meta"))
    q, k, v = _inputs("random", 1)
    with pytest.raises(ValueError, match="flash_reference: block_mask.block_k=16 differs from the key block"):
        R.flash_reference(q, k, v, block_n=32, block_mask=mask)


# --- video masks ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text_at", [TEXT_FIRST, TEXT_LAST])
def test_tile_order_is_a_permutation_of_compact_tiles(text_at):
    tokens = VideoTokens(frames=4, height=8, width=8, text=16, text_at=text_at)
    order = tile_order(tokens, (2, 4, 2), block=BLK)
    x = torch.randn(1, 1, tokens.n_tokens, 3)
    assert torch.equal(order.undo(order.apply(x)), x)
    xyz, is_text = tokens.coords()
    xyz, is_text = xyz[order.perm], is_text[order.perm]
    assert torch.equal(is_text, tokens.coords()[1])  # text stays in place
    video = xyz[~is_text].view(-1, BLK, 3)  # every block of video tokens one 2x4x2 tile
    assert torch.equal(video.amax(1) - video.amin(1), torch.tensor([1, 3, 1]).expand(video.shape[0], 3))


def test_tile_window_mask_keeps_every_pair_in_the_window_and_text_dense():
    tokens = VideoTokens(frames=3, height=6, width=5, text=7)
    window = (1, 2, 1)
    for order in (None, tile_order(tokens, (1, 4, 4), block=BLK)):
        mask = tile_window_mask(tokens, window, order=order, block=BLK)
        xyz, is_text = tokens.coords()
        if order is not None:
            xyz, is_text = xyz[order.perm], is_text[order.perm]
        near = ((xyz[:, None] - xyz[None]).abs() <= torch.tensor(window)).all(-1)
        need = near | is_text[:, None] | is_text[None]
        assert (mask.element_mask()[0, 0] | ~need).all()
        assert mask.density < 1.0
    far = tile_window_mask(VideoTokens(8, 8, 8), (0, 1, 1), block=BLK)
    assert far.density < 0.3


def test_radial_mask_decays_with_temporal_distance():
    tokens = VideoTokens(frames=8, height=8, width=8, text=16)
    mask = radial_mask(tokens, spatial_window=4, sink_frames=1, block=BLK)
    keep = mask.dense_blocks()[0, 0]
    per_frame = 64 // BLK  # four blocks per frame, after one text block
    kept_at = [keep[1 + 4 * per_frame: 1 + 5 * per_frame, 1 + f * per_frame: 1 + (f + 1) * per_frame].sum()
               for f in range(8)]  # queries of frame 4 against keys of each frame
    assert kept_at[0] == per_frame ** 2  # the sink
    assert kept_at[4] >= kept_at[5] >= kept_at[6] and kept_at[4] > kept_at[7]
    assert keep[0].all() and keep[:, 0].all()  # text dense


def test_pooled_mask_mass_is_monotone_and_devices_follow_q():
    q, k, _ = _inputs("random", 9, torch.float32)
    masks = [pooled_mask(q, k, mass=m, block_q=BLK, block_k=BLK) for m in (0.3, 0.6, 0.9, 1.0)]
    dens = [m.dense_blocks() for m in masks]
    assert all((a <= b).all() for a, b in zip(dens, dens[1:]))
    covs = [float(coverage(q, k, m).mean()) for m in masks]
    assert covs == sorted(covs) and covs[0] < covs[-1]
    assert masks[0].kv_counts.shape == (SHAPE["b"], SHAPE["hq"], _nq_nk()[0])
    assert (masks[0].kv_counts >= 1).all()


def test_sparse_schedule():
    s = SparseSchedule(dense_steps=2, dense_layers=1)
    mask = BlockSparseMask.full(32, 32, block_q=BLK, block_k=BLK)
    assert s.mask_for(1, 5, mask) is None and s.mask_for(2, 0, mask) is None and s.mask_for(2, 1, mask) is mask
    with pytest.raises(ValueError, match="dense_steps"):
        SparseSchedule(dense_steps=-1)


# --- coverage -------------------------------------------------------------------------------------------------
def test_coverage_full_empty_and_monotone(tmp_path):
    q, k, _ = _inputs("drift", 4, torch.float32)
    nq, nk = _nq_nk()
    full = BlockSparseMask.full(SHAPE["nq"], SHAPE["nk"], block_q=BLK, block_k=BLK)
    empty = BlockSparseMask.from_dense(torch.zeros(nq, nk, dtype=torch.bool), SHAPE["nq"], SHAPE["nk"],
                                       block_q=BLK, block_k=BLK)
    assert torch.allclose(coverage(q, k, full), torch.ones(SHAPE["b"], SHAPE["hq"], dtype=torch.float64))
    assert torch.equal(coverage(q, k, empty), torch.zeros(SHAPE["b"], SHAPE["hq"], dtype=torch.float64))
    dense = torch.zeros(nq, nk, dtype=torch.bool)
    previous = torch.zeros(SHAPE["b"], SHAPE["hq"], 20, dtype=torch.float64)
    for j in range(nk):  # growing nested masks: coverage never decreases, per sampled row
        dense[:, j] = True
        grown = BlockSparseMask.from_dense(dense.clone(), SHAPE["nq"], SHAPE["nk"], block_q=BLK, block_k=BLK)
        rows_cov, rows = row_coverage(q, k, grown, sample_rows=20, seed=3)
        assert rows.numel() == 20 and (rows_cov >= previous - 1e-12).all()
        previous = rows_cov
    mask = _mask("per-head", 2)
    table = coverage_table({"block.0": (q, k), "block.1": (q, k)}, mask, sample_rows=10)
    assert len(table) == 2 * SHAPE["hq"] and all(0.0 <= r["worst"] <= r["coverage"] <= 1.0 for r in table)
    assert plot_coverage(table, tmp_path / "coverage.png").stat().st_size > 0


def test_the_docs_python_blocks_run():
    """docs/SPARSE.md's python blocks run as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "SPARSE.md").read_text()
    blocks = [b.split("\n```", 1)[0] for b in text.split("```python\n")[1:]]
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/SPARSE.md", "exec"), {})


def test_a_prefix_keeps_the_blocks_over_the_first_queries_and_keys():
    dense = torch.tensor([[True, False, True, True], [False, True, False, True]])
    mask = BlockSparseMask.from_dense(dense, 200, 400)
    short = mask.prefix(200, 300)
    assert (short.q_len, short.kv_len, short.n_k_blocks) == (200, 300, 3)
    assert torch.equal(short.dense_blocks()[0, 0], dense[:, :3])
    assert torch.equal(short.element_mask(), mask.element_mask()[..., :300])
    assert torch.equal(mask.prefix(100, 257).element_mask(), mask.element_mask()[..., :100, :257])
    with pytest.raises(ValueError, match=r"prefix: kv_len must be an int in \[1, 400\], got kv_len=401"):
        mask.prefix(200, 401)
    with pytest.raises(ValueError, match=r"prefix: q_len must be an int in \[1, 200\], got q_len=0"):
        mask.prefix(0, 400)


def test_the_kept_share_is_read_with_the_counts():
    """``kept_share``: the share of the block pairs kept, read where ``keeps_all`` is, kept by ``to``; ``None``
    where nothing is read (``from_checked``, ``select``)."""
    blocks = torch.zeros(2, 3, 4, 5, dtype=torch.bool)
    blocks[..., 0] = True
    blocks[0, 0, :, 1:3] = True
    mask = BlockSparseMask.from_dense(blocks, 500, 600)
    assert mask.kept_share == pytest.approx((2 * 3 * 4 + 4 * 2) / (2 * 3 * 4 * 5))
    assert mask.to("cpu").kept_share == mask.kept_share
    assert BlockSparseMask.full(500, 600).kept_share == 1.0
    assert mask.select((0, 1), (0, 2)).kept_share is None
    assert BlockSparseMask.from_dense(blocks, 500, 600, validate=False).kept_share is None


def test_a_mask_built_without_validation_is_the_validated_one():
    """``from_dense(validate=False)`` (the pooled mask's: nothing read back) makes the same compact form; only
    ``keeps_all`` is not known (``False``)."""
    blocks = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(3)) < 0.5
    blocks[..., 0, :] = True
    checked = BlockSparseMask.from_dense(blocks, 500, 600)
    built = BlockSparseMask.from_dense(blocks, 500, 600, validate=False)
    assert torch.equal(built.kv_counts, checked.kv_counts) and torch.equal(built.kv_indices, checked.kv_indices)
    assert (built.q_len, built.kv_len, built.keeps_all) == (500, 600, False)
    built.validate()
