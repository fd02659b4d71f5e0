"""CUDA-graph capture of an attention call, shared by the GPU tests that replay one."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["replay_on"]


def replay_on(attend: Callable[[], torch.Tensor], static: Sequence[torch.Tensor],
              fresh: Sequence[torch.Tensor]) -> torch.Tensor:
    """Capture ``attend()`` (reading the tensors ``static``) in a CUDA graph after two warm-up calls on a side
    stream (autotuning stays out of the capture), copy ``fresh`` into ``static``, replay, and return the captured
    output: what the graph computed from ``fresh``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            attend()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attend()
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    return captured
