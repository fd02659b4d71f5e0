"""``pasa_attention``'s options and errors (the kernel itself: ``test_kernel_interpret.py``)."""
from __future__ import annotations

import pytest
import torch

from pasa_diffusers import pasa_attention
from pasa_diffusers.reference import exact_shift_reference


def _qkv(gen, dtype=torch.float16):
    return tuple((torch.randn(1, 2, 40, 32, generator=gen) + 2).to(dtype) for _ in range(3))


def test_default_is_the_exact_shift_in_hybrid(gen):
    q, k, v = _qkv(gen)
    out = pasa_attention(q, k, v)
    torch.testing.assert_close(out, pasa_attention(q, k, v, shift="exact", precision="hybrid"), rtol=0, atol=0)
    torch.testing.assert_close(out.float(), exact_shift_reference(q, k, v).float(), rtol=0, atol=2e-3)


@pytest.mark.parametrize("options, match", [
    ({"scale": True}, r"scale must be a positive finite number, got scale=True"),
    ({"scale": -1.0}, r"scale must be a positive finite number, got scale=-1.0"),
    ({"shift": "bogus"}, r"unknown shift='bogus'"),
    ({"beta": 5.0}, r"beta must be a number in \(0, 1\), got beta=5.0"),
    ({"beta": 0.5}, r"beta=0.5 is the strength of PASA's shift, which shift='exact' does not read; pass "
                    r"shift='pasa' with it, or leave beta out$"),
    ({"beta": 0.5, "shift": False}, r"beta=0.5 is the strength of PASA's shift, which shift='none' does not read"),
    ({"precision": "fp4"}, r"unknown precision='fp4'"),
    ({"layout": "nhd"}, r"unknown layout='nhd'"),
])
def test_bad_options_name_the_argument(options, match, gen):
    with pytest.raises(ValueError, match=r"^pasa_attention: " + match):
        pasa_attention(*_qkv(gen), **options)


def test_forward_only_with_grad(gen):
    q, k, v = _qkv(gen)
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"^pasa_attention: the op has no backward"):
        pasa_attention(q, k, v)
    with torch.no_grad():
        assert torch.isfinite(pasa_attention(q, k, v)).all()


def test_a_call_signature_is_checked_once(gen, monkeypatch):
    """A repeated call signature (options, shapes, strides, dtypes, devices) skips the checks it already passed;
    a change of any of them is checked again, an option's type included (``scale=True`` after ``scale=1``), and
    the gradient every call."""
    from pasa_diffusers import ops

    checked = []
    check = ops._check_signature
    monkeypatch.setattr(ops, "_check_signature", lambda *args: checked.append(args[1].shape) or check(*args))
    monkeypatch.setattr(ops, "_CHECKED", set())
    q, k, v = _qkv(gen)
    pasa_attention(q, k, v)
    pasa_attention(q.clone(), k.clone(), v.clone())
    assert len(checked) == 1
    pasa_attention(q, k, v, scale=1)
    pasa_attention(q[:, :1], k[:, :1], v[:, :1])
    pasa_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)
    assert len(checked) == 4
    with pytest.raises(ValueError, match=r"^pasa_attention: scale must be a positive finite number, got scale=True"):
        pasa_attention(q, k, v, scale=True)
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"^pasa_attention: the op has no backward"):
        pasa_attention(q, k, v)


def test_half_needs_float16(gen):
    with pytest.raises(ValueError, match=r"dtype torch.bfloat16 is not supported for precision='half'"):
        pasa_attention(*_qkv(gen, torch.bfloat16), precision="half")


@pytest.mark.parametrize("q_shape, kv_shape", [((0, 2, 40, 32), (0, 2, 40, 32)), ((1, 2, 0, 32), (1, 2, 40, 32)),
                                              ((0, 2, 40, 32), (0, 2, 0, 32))],
                         ids=["batch-0", "no-queries", "batch-0-no-keys"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_empty_output_is_an_empty_tensor_as_sdpa(q_shape, kv_shape, layout, gen):
    """No batch or no queries: nothing to compute, an empty output of q's shape and dtype, as SDPA returns."""
    q = torch.randn(*q_shape, generator=gen).half()
    k, v = (torch.randn(*kv_shape, generator=gen).half() for _ in range(2))
    expected = torch.nn.functional.scaled_dot_product_attention(*(t.float() for t in (q, k, v)))
    if layout == "bnhd":
        q, k, v, expected = (t.transpose(1, 2) for t in (q, k, v, expected))
    out = pasa_attention(q, k, v, layout=layout)
    assert out.shape == q.shape == expected.shape and out.dtype == torch.float16 and out.numel() == 0


def test_queries_without_keys_are_an_error(gen):
    q = torch.randn(1, 2, 40, 32, generator=gen).half()
    empty = torch.randn(1, 2, 0, 32, generator=gen).half()
    with pytest.raises(ValueError, match=r"^pasa_attention: k and v hold no keys \(k.shape=\(1, 2, 0, 32\)\): softmax"):
        pasa_attention(q, empty, empty)


def test_a_device_the_op_does_not_run_on_is_named():
    q = torch.empty(1, 2, 40, 32, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match=r"^pasa_attention: q is on meta; the op runs on CUDA tensors .* and CPU "
                                         r"tensors \(the exact reference"):
        pasa_attention(q, q, q)
