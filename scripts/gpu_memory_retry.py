"""After the GPU suite's shards: rerun alone, in one process, the tests that ran out of GPU memory beside them.

    python scripts/gpu_memory_retry.py OUT [extra pytest arguments]

The shards share one GPU, and a few tests (float64 goldens at SVD's 9216 keys, more than 65535 batch-heads) need
several GiB at once: when their peaks meet, one of them fails with ``torch.OutOfMemoryError`` although it passes
alone.  This reads the shards' logs ``OUT/gpu_suite_<i>.log`` (the ``-rf`` summary lines ``FAILED <id> - <error>``
that :mod:`gpu_shard` writes), reruns the ids whose error says the GPU ran out of memory with
:func:`gpu_shard.run_shard` into ``OUT/gpu_suite_memory.log``, and prints one line: how many reran and their
counts (no rerun where a shard was cut short, e.g. by the suite's deadline).  Exit status: 0 when every failure
was out of memory, every shard ran all its tests, and the rerun passed; else 1 (a failure of any other kind, or one
without its summary line, stands as it is and is not rerun).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from gpu_shard import run_shard

MEMORY_ERRORS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
"""Words of a failure's summary line that say the GPU's memory ran out (torch's allocator, cuBLAS's workspace)."""
SUMMARY = re.compile(r"^FAILED (\S+)(?: - (.*))?$")


def failures(logs: list[str]) -> tuple[list[str], list[str]]:
    """The failed test ids of the shard logs' texts ``logs``, split into ``(out of memory, any other error)``."""
    memory: set[str] = set()
    other: set[str] = set()
    for text in logs:
        for line in text.splitlines():
            found = SUMMARY.match(line)
            if found:
                nodeid, error = found.group(1), found.group(2) or ""
                (memory if any(word in error for word in MEMORY_ERRORS) else other).add(nodeid)
    return sorted(memory - other), sorted(other)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    out = Path(argv[0])
    logs = [log.read_text() for log in sorted(out.glob("gpu_suite_[0-9]*.log"))]
    if not logs:
        print(f"{__file__}: no shard logs gpu_suite_<i>.log in {out}", file=sys.stderr)
        return 2
    memory, other = failures(logs)
    last_lines = [text.strip().splitlines()[-1] for text in logs]
    counted = sum(int(found.group(1)) for line in last_lines if (found := re.match(r"(\d+) failed", line)))
    cut_short = any("not run" in line or "no tests ran" in line for line in last_lines)
    status = 1 if other or cut_short or counted != len(memory) + len(other) else 0
    if memory and cut_short:
        print(f"out of GPU memory beside the other shards: {len(memory)}, not rerun (shards were cut short)")
    elif memory:
        retry = out / "gpu_suite_memory.log"
        retry.unlink(missing_ok=True)
        status |= run_shard(memory, retry, argv[1:])
        print(f"out of GPU memory beside the other shards, {len(memory)} rerun alone: "
              f"{retry.read_text().strip().splitlines()[-1]}")
    return status


if __name__ == "__main__":
    sys.exit(main())
