"""The Hopper kernel of the default variant (``kernels/attn_fwd_tma.py``: TMA descriptors) through the
interpreter on the CPU.  Its GPU check and timing is ``bench/bench_hopper.py`` (not yet dispatched by
``pasa_attention``: issue 16).  Bound: FlashAttention's rule, ``err(kernel) <= 2 err(reference)``
with the reference ``exact_shift_reference("hybrid")`` (see ``test_kernel_interpret.py``)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pasa_diffusers import numerics  # noqa: E402
from pasa_diffusers.kernels import attn_fwd_tma  # noqa: E402
from pasa_diffusers.reference import exact_shift_reference, golden_attention  # noqa: E402

pytestmark = pytest.mark.skipif(not attn_fwd_tma.INTERPRET, reason="kernels built for the GPU; set TRITON_INTERPRET=1")


@pytest.mark.parametrize("shape", [(1, 4, 2, 200, 150, 64), (2, 2, 2, 70, 300, 40), (1, 2, 1, 129, 128, 128)],
                         ids=["gqa,ragged", "d40,3-blocks", "one-block,d128"])
def test_matches_golden_within_reference_bound(shape, gen):
    b, hq, hk, nq, nk, d = shape
    q = (torch.randn(b, hq, nq, d, generator=gen) + 3).half()
    k = (torch.randn(b, hk, nk, d, generator=gen) + 3).half()
    v = torch.randn(b, hk, nk, d, generator=gen).half()
    out = attn_fwd_tma.exact_attention_tma(q, k, v)
    assert torch.isfinite(out).all()
    gold = golden_attention(q, k, v)
    err, err_ref = numerics.rel_rmse(out, gold), numerics.rel_rmse(exact_shift_reference(q, k, v), gold)
    assert err <= 2.0 * err_ref + 1e-6, f"{err:.3e} > 2 x reference {err_ref:.3e}"


def test_rejects_a_layout_the_copy_engine_cannot_read(gen):
    q = torch.randn(1, 2, 64, 40, generator=gen).half()[..., :36]  # rows of 80 bytes: not a multiple of 16
    with pytest.raises(ValueError, match="q"):
        attn_fwd_tma.exact_attention_tma(q, q, q)
