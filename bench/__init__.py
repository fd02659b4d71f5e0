"""The benchmark suite: one entry point per question, each run as ``python -m bench.<name>`` from the
repository root, each writing ``<name>.md`` and ``<name>.json`` into ``--out``.

- ``attention``: forward attention time per backend (SDPA, FlashAttention-3, SageAttention, our variants)
  at SVD's and the video DiTs' shapes, in one table;
- ``accuracy``: error against a float64 golden on the input classes of ``numerics.input_classes``;
- ``temporal``: temporal attention (many short sequences) against the copy bandwidth, in rounds;
- ``overhead``: host time per call of the public op;
- ``unet``: one denoising step of the full-size SVD UNet per attention backend;
- ``dit``: one forward of a full-size video transformer (Wan 2.1, CogVideoX) per attention backend;
- ``video``: the wall time of one generated video per backend;
- ``cold_start``: the first video on a fresh machine, without and with ``pasa warmup`` first;
- ``accumulation``: how the tensor cores accumulate, and what that does to attention;
- ``hopper``: the Gluon Hopper kernel's configs, correctness then time.

``harness`` holds what they share: shapes, methods, the timer, rates, the header and the writer.  The build
tools (the tuned table, the sm_90 compile reports) are in ``tools/``.
"""
