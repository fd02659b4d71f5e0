"""One shard of the GPU suite: pytest over a list of test ids, rerun in a fresh process after a lost CUDA context.

    python scripts/gpu_shard.py IDS_FILE LOG [extra pytest arguments]

A kernel that touches an illegal address kills its process's CUDA context, and every CUDA call after it fails:
one broken test would be reported as hundreds.  ``tests/conftest.py`` probes the GPU after each ``gpu`` test and
stops the session with :data:`LOST` in its reason when the probe fails; each test's outcome is appended to the
file named by ``PASA_TEST_OUTCOMES``.  This driver reruns the ids that have no outcome yet in a new process,
as long as the last one stopped for a lost context and made progress, and ends the log with one line: the
counts over all runs, as pytest writes them, and the restarts.  Exit status: 0 if nothing failed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

LOST = "CUDA context lost"
"""The marker ``tests/conftest.py`` puts in the stop reason when the GPU probe after a test fails."""
OUTCOMES_VARIABLE = "PASA_TEST_OUTCOMES"
SLOWEST = 15
"""Each run's log lists its slowest tests (pytest ``--durations``): where a shard's time goes."""


def outcomes(path: Path) -> dict[str, str]:
    """Each test id's outcome from the lines ``nodeid<TAB>outcome`` (a failed setup, call or teardown makes it
    ``failed``; otherwise the call's outcome, or ``skipped``)."""
    found: dict[str, str] = {}
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        nodeid, outcome = line.rsplit("\t", 1)
        if found.get(nodeid) != "failed":
            found[nodeid] = outcome
    return found


def run_shard(ids: list[str], log: Path, pytest_args: list[str]) -> int:
    """Run ``ids`` (restarting after a lost CUDA context), append pytest's output to ``log``, then the summary
    line; return 0 if no test failed."""
    start = time.perf_counter()
    restarts = 0
    with tempfile.TemporaryDirectory() as scratch, log.open("a") as out:
        record = Path(scratch) / "outcomes.tsv"
        env = {**os.environ, OUTCOMES_VARIABLE: str(record)}
        remaining = list(ids)
        while remaining:
            before = len(remaining)
            out.flush()
            start_of_run = out.tell()
            subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rf",
                            f"--durations={SLOWEST}", *pytest_args,
                            *remaining], env=env, stdout=out, stderr=subprocess.STDOUT)
            with log.open() as written:
                written.seek(start_of_run)
                lost = LOST in written.read()
            done = outcomes(record)
            remaining = [nodeid for nodeid in ids if nodeid not in done]
            if not remaining or not lost or len(remaining) == before:
                break
            restarts += 1
            out.write(f"\n{__file__}: {LOST}; rerunning the {len(remaining)} tests left in a new process\n")
        counts = Counter(outcomes(record).values())
        counts["not run"] = len(remaining)
        parts = [f"{counts[name]} {name}" for name in ("failed", "passed", "skipped", "not run") if counts[name]]
        line = (f"{', '.join(parts) or 'no tests ran'} in {time.perf_counter() - start:.0f}s "
                f"({restarts} restarts after a lost CUDA context)")
        out.write(f"\n{line}\n")
    return 1 if counts["failed"] or counts["not run"] else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    ids = [line for line in Path(argv[0]).read_text().splitlines() if line.strip()]
    return run_shard(ids, Path(argv[1]), argv[2:])


if __name__ == "__main__":
    sys.exit(main())
