"""Triton and Gluon kernels of the attention op, layered one way: ``dispatch`` -> kernel files -> helpers.

- ``dispatch.py``: the router (``plan``, ``forward``): which kernel and pre-pass run a call, and why not
  the others; what ``pasa_diffusers.ops`` calls;
- kernel files, each with its launch wrapper and configs: ``portable.py`` (FlashAttention-2's loop,
  every variant), ``packed.py`` (the exact shift on short one-block sequences), ``hopper.py`` (the
  exact shift on sm_90 in Gluon, FA3's structure), ``prepass.py`` (the keys centred or shifted once per
  head), ``int8.py`` (the exact shift in 8 bits: its pre-pass and portable attention kernel),
  ``hopper_int8.py`` (the 8-bit attention on sm_90 in Gluon, ``hopper.py``'s structure);
- shared helpers: ``common.py`` (rounding, products, the exact centre, ``INTERPRET``), ``tuning.py``
  (tile extents, buckets, the autotuner with its shipped tables and on-disk cache).

Kernel files import only the helpers, ``rules``, ``beta`` and ``variants``; never each other.
Importing a kernel module imports ``triton``; for CPU tensors set ``TRITON_INTERPRET=1`` before that.
"""
