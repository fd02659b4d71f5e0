"""Build tools, apart from the benchmarks: each run as ``python -m tools.<name>`` from the repository root,
each writing ``<name>.md`` and ``<name>.json`` into ``--out`` (with ``bench.harness``'s header).

- ``tune_table``: the autotuned kernels' picks on this GPU, the table ``pasa_diffusers/kernels/tuned/``
  ships (``kernels/tuning.py`` reads it);
- ``compile_sm90``: the Gluon Hopper kernel compiled for sm_90 on a CPU (triton 3.6): warp
  specialisation, wgmma, TMA, spills, the key loop;
- ``compile_int8``: the 8-bit kernels compiled for sm_90 the same way (dense and with a block mask);
- ``compile_portable``: the portable 16-bit kernel compiled for sm_90 the same way, every key path dense and
  with a block mask.
"""
