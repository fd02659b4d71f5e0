"""Triton kernels, one per file, each with its launch wrapper beside it.

- ``pasa_fwd.py``: fused forward attention (the exact shift, PASA or plain FlashAttention; half or
  hybrid precision): ``pasa_forward`` is what ``pasa_diffusers.ops`` calls;
- ``packed_fwd.py``: the exact shift for short one-block sequences (temporal attention), several whole
  sequences per program in one pass; ``pasa_forward`` dispatches to it;
- ``centre_k.py``: the exact shift's key-centring pre-pass; ``shift_k.py``: PASA's key-shift pre-pass;
- ``attn_fwd_tma.py``: the default variant with TMA tensor descriptors for sm_90 (issue 16; checked
  and timed by ``bench/bench_hopper.py``, not yet dispatched by the op);
- ``attn_fwd_gluon.py``: the same variant by hand in Gluon (Triton 3.6): FA3's warp-specialised
  structure (a TMA producer, consumer warpgroups with async wgmma); compiled for sm_90 by
  ``bench/gluon_compile_check.py``, not yet run on a GPU (``bench/bench_gluon.py``: issue 16);
- ``common.py``: the helpers they share; ``configs.py``: autotune pools, pruning, tuning cache.

Importing a kernel module imports ``triton``; for CPU tensors set ``TRITON_INTERPRET=1`` before that.
"""
