"""Triton and Gluon kernels of the attention op, layered one way: ``dispatch`` -> kernel files -> helpers.

- ``dispatch.py``: the router (``plan``, ``forward``): which kernel and pre-pass run a call, and why not
  the others, for every variant (8-bit included); what ``pasa_diffusers.ops`` calls.  It owns what is
  counted per call (``block_tally``'s counter, passed to the 8-bit pre-pass);
- kernel files, each with its launch wrapper, configs and ``ENTRY`` (``dispatch.TABLE`` lists them):
  ``portable.py`` (FlashAttention-2's loop, every 16-bit variant), ``packed.py`` (the exact shift on short
  one-block sequences), ``hopper.py`` (the exact shift on sm_90 in Gluon, FA3's structure), ``int8.py`` (the
  exact shift in 8 bits: the portable attention kernel on the codes), ``hopper_int8.py`` (the 8-bit
  attention on sm_90 in Gluon, ``hopper.py``'s structure);
- the pre-passes the router runs: ``prepass.py`` (the keys centred or shifted once per head) and
  ``quantize.py`` (q, k, v to the 8-bit codes; the portable 8-bit kernel shares two of its jitted helpers);
- ``call.py``: the call object (``Call``), the plan (``Plan``) and the entry type (``Kernel``);
- shared helpers: ``common.py`` (rounding, products, the exact centre, host grid and stride helpers,
  ``INTERPRET``), ``gluon_common.py`` (what both Gluon kernels share: Gluon's names, warpgroup geometry,
  registers, TMA descriptors, the jitted softmax and ring pieces), ``tuning.py`` (tile extents, buckets,
  the shared-memory limit, the autotuner with its shipped tables and on-disk cache), ``launch.py`` (launches that
  call the compiled kernel kept per launch key, skipping Triton's argument binding on repeats).

Kernel files import only the layers below them (pre-passes, ``call``, helpers) and the spec constants
(``pasa_diffusers.rules``); never each other,
and they keep no state of the package's (the router passes them tensors and flags).
Importing a kernel module imports ``triton``; for CPU tensors set ``TRITON_INTERPRET=1`` before that.
"""
