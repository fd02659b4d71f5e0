"""What the kernels' launch configurations share: tile extents, shape buckets, the sm_90 shared-memory
limit and the autotuner with its on-disk cache.  Each kernel file keeps its own config pool and pruning
beside its kernel.

Autotuning results persist across processes (``cache_results=True``): Triton stores each tuning key's
timings in its cache directory (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), keyed by the Triton
version, the GPU target (e.g. ``cuda:90``), the kernel source, the key and the config pool, so a process
that meets a shape bucket another process already tuned on this machine loads the winner instead of
benchmarking every config again.
"""
from __future__ import annotations

from collections.abc import Callable

import triton

__all__ = ["SMEM_LIMIT", "autotuned", "bucket", "pow2_tile"]

SMEM_LIMIT = 232448
"""Bytes of shared memory one block may use on sm_90."""


def autotuned(kernel, configs: list[triton.Config], key: list[str], prune: Callable) -> triton.runtime.Autotuner:
    """``kernel`` under Triton's autotuner over ``configs``, chosen per value of the arguments named in
    ``key``, pruned by ``prune(configs, named_args, **kwargs)`` before compiling; results cached on disk."""
    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": prune},
                           cache_results=True)(kernel)


def pow2_tile(n: int) -> int:
    """The smallest power of two >= max(n, 16): a tile extent that covers n."""
    return max(16, triton.next_power_of_2(n))


def bucket(n: int) -> int:
    """Autotune bucket of a sequence length: a power of two in [16, 16384]."""
    return min(max(16, triton.next_power_of_2(n)), 16384)
