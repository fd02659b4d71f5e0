"""A stand-in for a jitted kernel, shared by the CPU tests of the Gluon kernels' host wrappers."""
from __future__ import annotations

__all__ = ["LaunchRecorder", "launch_signature"]


class LaunchRecorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **meta)`` records the launch instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((grid, args, meta))


def launch_signature(grid: tuple, args: tuple, meta: dict) -> tuple:
    """What two builds of one launch share: the grid, the constexprs and options, each argument's type (the TMA
    descriptors are new objects each time)."""
    return grid, meta, [type(a) for a in args]
