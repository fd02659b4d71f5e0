"""The folder of one ``pasa compare`` run: its manifest, the append-only sample logs, resume, merging and the lock.

Layout of ``OUT``::

    run.json                   the manifest: what the run is (its settings, samples, backends, versions)
    samples.jsonl              one JSON object per finished (image, seed, backend), appended at once
    shards/rank-R-of-W.jsonl   the same, one file per rank of a torchrun run; merged into samples.jsonl
    videos/                    side-by-side GIFs (at the end: those of the worst samples)
    report.json, report.md, distributions.png, psnr_per_frame.png
                               written last, each to a temporary name first, then all renamed
    .lock                      the lock of the run in progress (``FolderLock``)

Rules:

- A record is appended as one line, flushed and fsynced before the next video starts, so a killed run
  loses at most the video in progress.  A last line cut short by a kill (no final newline) is ignored
  when read and cut off before the next append: its result is computed again.
- Any other damaged line (not a JSON record with every field of ``RECORD_FIELDS``, each of its type and in its
  range (``record_problem``: a ``null`` PSNR or a negative count is refused, not averaged), or a record of
  another run) stops the run before it writes anything (``DamagedLogError``, naming the file and the
  line): nothing in the folder is guessed at or silently dropped.
- Resuming is running the same command again: the records already in ``samples.jsonl`` or in a shard
  are skipped.  A folder holding another run's records (a different ``run.json``), or files but no
  ``run.json``, is refused (``MixedRunError``): results of two runs are never mixed.  A ``run.json``
  with no record yet is simply replaced by the new run's.
- One run per folder at a time: the run holds an exclusive ``flock`` on ``.lock`` (``FolderLock``;
  under torchrun rank 0 holds it for all its ranks); a second run is refused at once
  (``FolderInUseError``).  The kernel drops the lock when its process ends, even by ``kill -9``.
- The report of an earlier attempt stays until the new report replaces it; the report is written only
  once every record is in.
- ``merge_logs`` rewrites ``samples.jsonl`` (atomically) as the union of every log, in sample order,
  each (image, seed, backend) once, then deletes the shards.

Only the standard library and ``metrics.records`` are used here.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import socket
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, TextIO

from pasa_diffusers.metrics.records import dumps, write_atomic, write_json

__all__ = ["MANIFEST", "SAMPLES", "SHARDS", "VIDEOS", "LOCK", "KIND", "RECORD_FIELDS", "MixedRunError",
           "DamagedLogError", "FolderInUseError", "Key", "record_key", "record_problem", "read_log", "check_folder",
           "check_manifest",
           "prepare_folder", "done_records", "log_path", "LogWriter", "merge_logs", "FolderLock"]

MANIFEST = "run.json"
SAMPLES = "samples.jsonl"
SHARDS = "shards"
VIDEOS = "videos"
LOCK = ".lock"
KIND = "pasa compare"
FORMAT = 1

RECORD_FIELDS = ("image", "seed", "sample", "backend", "psnr", "ssim", "lpips", "temporal_psnr", "flicker", "frames",
                 "nonfinite_frames", "first_nonfinite", "identical_frames", "psnr_per_frame", "ssim_per_frame",
                 "fallbacks", "seconds", "rank")
"""The fields of a record of format ``FORMAT`` (``pasa_diffusers/pipelines/compare.py`` says what each holds)."""

Key = tuple[str, int, str]
"""``(image, seed, backend)``: one record."""


class MixedRunError(ValueError):
    """The output folder holds another run's results (or files that are not a run's)."""


class DamagedLogError(ValueError):
    """A line of a log that is not a record of this run; the message names the file, the line and the repair."""


class FolderInUseError(RuntimeError):
    """Another run holds the folder's lock."""


def record_key(record: dict[str, Any]) -> Key:
    """``(image, seed, backend)`` of a record of ``samples.jsonl``."""
    return record["image"], int(record["seed"]), record["backend"]


def _damaged(path: Path, number: int, what: str) -> DamagedLogError:
    return DamagedLogError(f"{path}, line {number}: {what}; delete that line (its result is computed again when "
                           "you rerun the command) or start over with a new --out")


def _parse(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """The record a line holds, or ``None`` and why it is not one."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"not a JSON record: {exc.msg}: column {exc.colno}"
    except UnicodeDecodeError as exc:
        return None, f"not text ({exc.reason} at byte {exc.start})"
    if not isinstance(record, dict):
        return None, f"not a JSON object but {type(record).__name__}"
    missing = [name for name in RECORD_FIELDS if name not in record]
    if missing:
        return None, f"a record without {', '.join(missing)}"
    if not (isinstance(record["image"], str) and isinstance(record["backend"], str)
            and type(record["seed"]) is int):
        return None, "image, backend and seed must be two strings and an integer"
    problem = record_problem(record)
    if problem is not None:
        return None, problem
    return record, ""


def _is_count(value: Any, top: int | None = None) -> bool:
    return type(value) is int and value >= 0 and (top is None or value <= top)


def _is_number(value: Any, lo: float = -math.inf, hi: float = math.inf) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and lo <= value <= hi


SCORE_SLACK = 1e-5
"""How far past its range a score may lie: scores are computed from float32 frames (an SSIM of identical frames
comes out 1 + 2**-23)."""


def _score_problem(name: str, value: Any, *, infinite: bool, lo: float = 0.0, hi: float = math.inf) -> str | None:
    """Why ``value`` is not a score of ``name``: null, a finite number in ``[lo, hi]`` (within ``SCORE_SLACK``), or
    (``infinite``) "inf"."""
    if value is None or (infinite and value == "inf") or _is_number(value, lo - SCORE_SLACK, hi + SCORE_SLACK):
        return None
    accepted = f"a number in [{lo:g}, {hi:g}]" if math.isfinite(hi) else f"a number >= {lo:g}"
    infinity = ', "inf"' if infinite else ""
    return f"{name} is {_show(value)}; expected {accepted}{infinity} or null"


def _per_frame_problem(record: dict[str, Any], name: str, frames: int, **accepted: Any) -> str | None:
    values = record[f"{name}_per_frame"]
    if not isinstance(values, list) or len(values) != frames:
        return f"{name}_per_frame is {_show(values)}; expected a list of {frames} values (frames)"
    for i, value in enumerate(values):
        problem = _score_problem(f"{name}_per_frame[{i}]", value, **accepted)
        if problem is not None:
            return problem
    mean = record[name]
    scored = [v for v in values if v is not None]
    if (mean is None) != (not scored):
        return (f"{name} is {_show(mean)}, but {len(scored)} of {frames} frames have a value in {name}_per_frame: "
                f"{name} is null exactly when no frame has one")
    return None


def _fallbacks_problem(fallbacks: Any) -> str | None:
    if not (isinstance(fallbacks, dict) and _is_count(fallbacks.get("calls"))
            and _is_count(fallbacks.get("fallback_calls"), fallbacks.get("calls"))):
        return (f"fallbacks is {_show(fallbacks)}; expected calls and fallback_calls, counts with fallback_calls <= "
                "calls")
    reasons = fallbacks.get("reasons")
    if not (isinstance(reasons, dict) and all(_is_count(n) for n in reasons.values())):
        return f"fallbacks.reasons is {_show(reasons)}; expected counts of calls by reason"
    blocks = fallbacks.get("int8_blocks", {"blocks": 0, "in_16_bits": 0})
    if not (isinstance(blocks, dict) and _is_count(blocks.get("blocks"))
            and _is_count(blocks.get("in_16_bits"), blocks.get("blocks"))):
        return (f"fallbacks.int8_blocks is {_show(blocks)}; expected blocks and in_16_bits, counts with in_16_bits <= "
                "blocks")
    return None


def record_problem(record: dict[str, Any]) -> str | None:
    """Why a record holding every field of ``RECORD_FIELDS`` is not one ``pasa compare`` writes, naming the field,
    or ``None``: each value of its type and in its range (scores in the JSON convention of ``records``: a number,
    ``"inf"`` where a score can be infinite, ``null`` for none), and the counts consistent with ``frames`` (a
    ``null`` PSNR drops the sample from every mean; ``-3`` non-finite frames reaches the verdict)."""
    frames = record["frames"]
    if not (_is_count(frames) and frames >= 1):
        return f"frames is {_show(frames)}; expected an integer >= 1"
    for name in ("nonfinite_frames", "identical_frames"):
        if not _is_count(record[name], frames):
            return f"{name} is {_show(record[name])}; expected an integer in [0, {frames}] (frames)"
    first = record["first_nonfinite"]
    if (first is None) != (record["nonfinite_frames"] == 0) or not (first is None or _is_count(first, frames - 1)):
        return (f"first_nonfinite is {_show(first)}; expected null with no non-finite frame, else a frame index in "
                f"[0, {frames - 1}] ({record['nonfinite_frames']} non-finite)")
    if not _is_count(record["seed"]) or not _is_count(record["rank"]):
        return "seed and rank must be integers >= 0"
    if not isinstance(record["sample"], str):
        return f"sample is {_show(record['sample'])}; expected a string"
    problem = (_per_frame_problem(record, "psnr", frames, infinite=True)
               or _score_problem("psnr", record["psnr"], infinite=True)
               or _per_frame_problem(record, "ssim", frames, infinite=False, lo=-1.0, hi=1.0)
               or _score_problem("ssim", record["ssim"], infinite=False, lo=-1.0, hi=1.0)
               or _score_problem("lpips", record["lpips"], infinite=False)
               or _score_problem("temporal_psnr", record["temporal_psnr"], infinite=True)
               or _score_problem("flicker", record["flicker"], infinite=True))
    if problem is not None:
        return problem
    if not _is_number(record["seconds"], 0.0):
        return f"seconds is {_show(record['seconds'])}; expected a finite number >= 0"
    return _fallbacks_problem(record["fallbacks"])


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of one log file; a last line without its newline (cut by a kill) is left out.

    Raises ``DamagedLogError`` naming the file and the line for any other line that is not a record.
    """
    return [record for _, record in _numbered_records(Path(path))]


def _numbered_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    found = []
    for number, line in enumerate(lines[:-1], start=1):  # lines[-1] is b"" or an unfinished line
        record, why = _parse(line)
        if record is None:
            raise _damaged(path, number, f"damaged ({why})")
        found.append((number, record))
    return found


def _logs(out: Path) -> list[Path]:
    return [out / SAMPLES, *sorted((out / SHARDS).glob("rank-*.jsonl"))]


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _read_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of ``out``; ``None`` for a new folder or one holding nothing but the lock file."""
    if not out.is_dir() or all(entry.name == LOCK for entry in out.iterdir()):
        return None
    manifest_path = out / MANIFEST
    if not manifest_path.is_file():
        raise MixedRunError(f"--out {out}: the folder is not empty and holds no {MANIFEST} of a pasa compare run; "
                            "choose an empty or new folder")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise MixedRunError(f"--out {out}: {MANIFEST} is not valid JSON ({exc}); choose another folder") from exc
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND or manifest.get("format") != FORMAT:
        raise MixedRunError(f"--out {out}: {MANIFEST} is not a pasa compare run of format {FORMAT}")
    return manifest


def _another_run(out: Path, there: dict[str, Any], here: dict[str, Any]) -> MixedRunError:
    changed = [f"{key} {_show(there.get(key))} there, {_show(here.get(key))} now"
               for key in sorted(set(there) | set(here)) if there.get(key) != here.get(key)]
    threads = ""
    if "cpu_threads" in there and there.get("cpu_threads") != here.get("cpu_threads"):
        threads = (f"; torch's CPU thread count sets the last bits of every video: resume it with "
                   f"OMP_NUM_THREADS={there['cpu_threads']} before the same command (each torchrun process runs one "
                   "thread)")
    return MixedRunError(f"--out {out} holds another run ({'; '.join(changed)}); a resume needs the same "
                         f"settings{threads}; or choose another --out, or delete the folder to start over")


def check_folder(out: str | os.PathLike, run: dict[str, Any]) -> bool:
    """Whether ``out`` already holds this ``run`` (a resume); ``False`` for a new or empty folder, or one
    whose ``run.json`` has no record yet (the new run replaces it).

    Raises ``MixedRunError`` when ``out`` holds another run's records, naming each setting that differs,
    or files without a ``run.json``; ``DamagedLogError`` for a damaged log line.  Reads only.
    """
    out = Path(out)
    manifest = _read_manifest(out)
    if manifest is None:
        return False
    there, here = manifest.get("run", {}), json.loads(dumps(run))
    if there == here:
        return True
    if not done_records(out):
        return False
    raise _another_run(out, there, here)


def check_manifest(out: str | os.PathLike, run: dict[str, Any]) -> None:
    """Raise ``MixedRunError`` unless ``out``'s manifest is ``run`` (under torchrun: each rank's run is rank 0's)."""
    out = Path(out)
    there = (_read_manifest(out) or {}).get("run", {})
    here = json.loads(dumps(run))
    if there != here:
        raise _another_run(out, there, here)


def prepare_folder(out: str | os.PathLike, run: dict[str, Any], command: str) -> None:
    """Create ``out`` and write its manifest, unless it already holds this run's (a resume keeps its command)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(out)
    if manifest is None or manifest.get("run") != json.loads(dumps(run)):
        write_json(out / MANIFEST, {"kind": KIND, "format": FORMAT, "command": command, "run": run})


def done_records(out: str | os.PathLike, keys: Collection[Key] | None = None) -> dict[Key, dict[str, Any]]:
    """Every record already logged in ``out`` (``samples.jsonl``, then the shards), the first of each key.

    With ``keys``, a record whose key is not one of them raises ``DamagedLogError`` (the folder was mixed
    by hand), as does a damaged line.
    """
    done: dict[Key, dict[str, Any]] = {}
    for path in _logs(Path(out)):
        for number, record in _numbered_records(path):
            key = record_key(record)
            if keys is not None and key not in keys:
                raise _damaged(path, number, f"a record of {key}, which is not part of this run")
            done.setdefault(key, record)
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

    Returns the records.  A logged record whose key is not in ``order`` raises ``DamagedLogError``; keys
    of ``order`` without a record are simply absent from the result.
    """
    out = Path(out)
    position = {key: i for i, key in enumerate(order)}
    done = done_records(out, position)
    records = sorted(done.values(), key=lambda record: position[record_key(record)])
    write_atomic(out / SAMPLES, "".join(dumps(record, indent=None) + "\n" for record in records))
    for shard in _logs(out)[1:]:
        shard.unlink()
    shards = out / SHARDS
    if shards.is_dir() and not any(shards.iterdir()):
        shards.rmdir()
    return records


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the file now at ``path``."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


class FolderLock:
    """One run per folder: an exclusive, non-blocking ``flock`` on ``OUT/.lock`` from ``acquire`` to ``release``.

    The lock belongs to the open file, so the kernel drops it when the process ends in any way (``kill
    -9`` included): it never stays stuck.  The file holds the holder's pid and host, for the message of
    the run that is refused; it stays in the folder (``check_folder`` ignores it).  Use as a context
    manager (``release`` on exit); ``acquire`` creates the folder and may be called again.

    ``name`` and ``holder`` make another lock of the folder and say who holds it in the refusal: ``pasa generate``
    locks ``OUT/.BACKEND.lock`` ("another pasa generate is writing the pasa video into this folder"), so two runs
    of one backend never write the same files at once, and runs of two backends share the folder.  ``remove``
    deletes the file on release (``pasa generate`` leaves nothing in its folder but the video); ``acquire`` then
    checks that the file it locked is still the one at its path, so a process that opened it just before it was
    removed does not hold a lock of its own beside the next holder's.
    """

    def __init__(self, out: str | os.PathLike, *, name: str = LOCK,
                 holder: str = "another pasa compare is running into this folder", remove: bool = False) -> None:
        self.out = Path(out)
        self.name, self.holder, self.remove = name, holder, remove
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``FolderInUseError`` at once if another process holds it."""
        if self._fd is not None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / self.name
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise FolderInUseError(f"--out {self.out}: {self.holder} (pid and host {holder}); wait for it to end, "
                                       "or choose another --out") from None
            if _same_file(fd, path):
                break
            os.close(fd)  # locked a file its holder removed on release (``remove``): lock the one now at ``path``
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (a no-op if it is not held); with ``remove``, delete its file first, while still holding it."""
        if self._fd is not None:
            if self.remove:
                (self.out / self.name).unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
