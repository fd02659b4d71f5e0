"""The folder of one ``pasa compare`` run: its manifest, the append-only sample logs, resume and merging.

Layout of ``OUT``::

    run.json                   the manifest: what the run is (its settings, samples, backends, versions)
    samples.jsonl              one JSON object per finished (image, seed, backend), appended at once
    shards/rank-R-of-W.jsonl   the same, one file per rank of a torchrun run; merged into samples.jsonl
    videos/                    side-by-side GIFs (at the end: those of the worst samples)
    report.json, report.md, distributions.png, psnr_per_frame.png
                               written last, each atomically, report.json the very last

Rules:

- A record is appended as one line, flushed and fsynced before the next video starts, so a killed run
  loses at most the video in progress.  A line cut short by a kill (no final newline) is ignored when
  read and cut off before the next append.
- Resuming is running the same command again: the records already in ``samples.jsonl`` or in a shard
  are skipped.  A folder holding another run (a different ``run.json``), or files but no ``run.json``,
  is refused (``MixedRunError``): results of two runs are never mixed.
- The report files of an earlier attempt are deleted when a run starts, so an interrupted run never
  leaves a complete-looking report beside newer samples; the report is written only once every
  record is in.
- ``merge_logs`` rewrites ``samples.jsonl`` (atomically) as the union of every log, in sample order,
  each (image, seed, backend) once, then deletes the shards.

Only the standard library and ``metrics.records`` are used here.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from pasa_diffusers.metrics.records import dumps, write_atomic, write_json

__all__ = ["MANIFEST", "SAMPLES", "SHARDS", "VIDEOS", "REPORT_FILES", "KIND", "MixedRunError", "Key", "record_key",
           "read_log", "check_folder", "prepare_folder", "done_records", "log_path", "LogWriter", "merge_logs"]

MANIFEST = "run.json"
SAMPLES = "samples.jsonl"
SHARDS = "shards"
VIDEOS = "videos"
REPORT_FILES = ("report.json", "report.md", "distributions.png", "psnr_per_frame.png")
"""Written by the report at the end; deleted when a run (or a resume) starts."""
KIND = "pasa compare"
FORMAT = 1

Key = tuple[str, int, str]
"""``(image, seed, backend)``: one record."""


class MixedRunError(ValueError):
    """The output folder holds another run's results (or files that are not a run's)."""


def record_key(record: dict[str, Any]) -> Key:
    """``(image, seed, backend)`` of a record of ``samples.jsonl``."""
    return record["image"], int(record["seed"]), record["backend"]


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of one log file; a last line without its newline (cut by a kill) is left out."""
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, line in enumerate(lines[:-1], start=1):  # lines[-1] is b"" or an unfinished line
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON record ({exc}); the file is damaged") from exc
    return records


def _logs(out: Path) -> list[Path]:
    return [out / SAMPLES, *sorted((out / SHARDS).glob("rank-*.jsonl"))]


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_folder(out: str | os.PathLike, run: dict[str, Any]) -> bool:
    """Whether ``out`` already holds this ``run`` (a resume); ``False`` for a new or empty folder.

    Raises ``MixedRunError`` when ``out`` holds another run, naming each setting that differs, or files
    without a ``run.json``.  Reads only.
    """
    out = Path(out)
    if not out.exists() or not any(out.iterdir()):
        return False
    manifest_path = out / MANIFEST
    if not manifest_path.is_file():
        raise MixedRunError(f"--out {out}: the folder is not empty and holds no {MANIFEST} of a pasa compare run; "
                            "choose an empty or new folder")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise MixedRunError(f"--out {out}: {MANIFEST} is not valid JSON ({exc}); choose another folder") from exc
    if manifest.get("kind") != KIND or manifest.get("format") != FORMAT:
        raise MixedRunError(f"--out {out}: {MANIFEST} is not a pasa compare run of format {FORMAT}")
    there = manifest.get("run", {})
    if there == json.loads(dumps(run)):
        return True
    here = json.loads(dumps(run))
    changed = [f"{key} {_show(there.get(key))} there, {_show(here.get(key))} now"
               for key in sorted(set(there) | set(here)) if there.get(key) != here.get(key)]
    raise MixedRunError(f"--out {out} holds another run ({'; '.join(changed)}); a resume needs the same "
                        "settings: choose another --out, or delete the folder to start over")


def prepare_folder(out: str | os.PathLike, run: dict[str, Any], command: str) -> None:
    """Create ``out``, write its manifest if it has none, and delete the report files of an earlier attempt."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MANIFEST).is_file():
        write_json(out / MANIFEST, {"kind": KIND, "format": FORMAT, "command": command, "run": run})
    for name in REPORT_FILES:
        (out / name).unlink(missing_ok=True)


def done_records(out: str | os.PathLike) -> dict[Key, dict[str, Any]]:
    """Every record already logged in ``out`` (``samples.jsonl``, then the shards), the first of each key."""
    done: dict[Key, dict[str, Any]] = {}
    for path in _logs(Path(out)):
        for record in read_log(path):
            done.setdefault(record_key(record), record)
    return done


def log_path(out: str | os.PathLike, rank: int, world_size: int) -> Path:
    """Where a rank appends: ``samples.jsonl`` for a single process, ``shards/rank-R-of-W.jsonl`` otherwise."""
    out = Path(out)
    return out / SAMPLES if world_size == 1 else out / SHARDS / f"rank-{rank}-of-{world_size}.jsonl"


class LogWriter:
    """Appends records to one log file, one line each, flushed and fsynced at once.

    Opening cuts off an unfinished last line (left by a killed run), so the next record starts on a
    line of its own.  Use as a context manager.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = None

    def __enter__(self) -> LogWriter:
        if self.path.is_file():
            data = self.path.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep < len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(keep)
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` as one JSON line and push it to the disk."""
        if self._file is None:
            raise RuntimeError("LogWriter.append: use the writer in a with block")
        self._file.write(dumps(record, indent=None) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def merge_logs(out: str | os.PathLike, order: Sequence[Key]) -> list[dict[str, Any]]:
    """Rewrite ``samples.jsonl`` as every logged record in ``order`` (each once) and delete the shards.

    Returns the records.  A logged record whose key is not in ``order`` raises ``ValueError`` (the
    folder was mixed by hand); keys of ``order`` without a record are simply absent from the result.
    """
    out = Path(out)
    done = done_records(out)
    position = {key: i for i, key in enumerate(order)}
    stray = [key for key in done if key not in position]
    if stray:
        raise ValueError(f"merge_logs: {out} holds records that are not part of this run, e.g. {stray[0]}")
    records = sorted(done.values(), key=lambda record: position[record_key(record)])
    write_atomic(out / SAMPLES, "".join(dumps(record, indent=None) + "\n" for record in records))
    for shard in _logs(out)[1:]:
        shard.unlink()
    shards = out / SHARDS
    if shards.is_dir() and not any(shards.iterdir()):
        shards.rmdir()
    return records

