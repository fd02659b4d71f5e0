"""A stand-in for a jitted kernel, shared by the CPU tests of the Gluon kernels' host wrappers."""
from __future__ import annotations

__all__ = ["LaunchRecorder"]


class LaunchRecorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **meta)`` records the launch instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((grid, args, meta))
