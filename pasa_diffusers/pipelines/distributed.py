"""Sharding an evaluation over the processes of a torchrun launch (one per GPU, or several on the CPU).

``torchrun --standalone --nproc-per-node N --no-python pasa compare ...`` starts N copies of the
command with ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` set; ``session`` joins them in a
``torch.distributed`` process group (NCCL on CUDA, each rank on ``cuda:LOCAL_RANK``; gloo on the CPU).
Over several machines it is the same command with torchrun's rendezvous options (``--nnodes``,
``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``) and an output folder on a filesystem every machine
shares.  The group only synchronises (barriers, and ``Dist.share`` for rank 0's word on the folder's lock):
the results travel through files (``runlog``).

Without ``WORLD_SIZE`` (or with 1) ``session`` is a single process and never imports
``torch.distributed``.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Dist", "session", "BARRIER_TIMEOUT"]

T = TypeVar("T")

BARRIER_TIMEOUT = datetime.timedelta(hours=12)
"""How long a rank waits for the others at a barrier (ranks may finish their shards far apart)."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the launch: ``rank`` of ``world_size``, and the device it runs on."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prepares the folder, merges the shards and writes the report."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait until every rank reaches this point (a no-op for a single process)."""
        if self.world_size > 1:
            import torch.distributed

            torch.distributed.barrier()

    def share(self, value: T) -> T:
        """Rank 0's ``value``, on every rank (every rank calls it; ``value`` itself for a single process)."""
        if self.world_size == 1:
            return value
        import torch.distributed

        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of ``items``: every ``world_size``-th one from position ``rank``."""
        return list(items[self.rank::self.world_size])


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        raise RuntimeError(f"distributed.session: WORLD_SIZE is set but {name} is missing or not an integer "
                           "(start the command with torchrun)") from None


@contextlib.contextmanager
def session(device: str) -> Iterator[Dist]:
    """This process's ``Dist`` for ``device`` (``cpu`` or ``cuda``), in a process group under torchrun.

    Under torchrun a CUDA ``device`` must carry no index: each rank takes ``cuda:LOCAL_RANK``.  The
    process group is destroyed when the block ends.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        yield Dist(device=device)
        return
    import torch
    import torch.distributed as dist

    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    chosen = torch.device(device)
    if chosen.type == "cuda":
        if chosen.index is not None:
            raise ValueError(f"--device {device}: under torchrun each rank runs on cuda:LOCAL_RANK; pass --device cuda")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"--device cuda: LOCAL_RANK {local_rank} but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s); lower --nproc-per-node")
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
        dist.init_process_group("nccl", timeout=BARRIER_TIMEOUT, device_id=torch.device(device))
    else:
        dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
    try:
        yield Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device)
    finally:
        dist.destroy_process_group()
