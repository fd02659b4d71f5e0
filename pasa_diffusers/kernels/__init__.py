"""Triton kernels, one per file, each with its launch wrapper beside it.

- ``pasa_fwd.py``: fused forward attention, PASA or plain FlashAttention, half or hybrid precision
  (``pasa_forward`` is what ``pasa_diffusers.ops`` calls);
- ``shift_k.py``: PASA's key shift as a once-per-head pre-pass.

Importing a kernel module imports ``triton``; for CPU tensors set ``TRITON_INTERPRET=1`` before that.
"""
