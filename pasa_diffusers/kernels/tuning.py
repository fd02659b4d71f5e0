"""What the kernels' launch configurations share: tile extents, shape buckets, the sm_90 shared-memory
limit, and the autotuner with its shipped tables and on-disk cache.  Each kernel file keeps its own
config pool and pruning beside its kernel.

How an autotuned launch gets its config (:class:`TableAutotuner`, Triton's ``Autotuner`` with one step
in front, through ``compat.HookedAutotuner``), for a tuning key (the key arguments' values, then the dtype
of each tensor argument, in argument order: Triton's own key, ``HookedAutotuner.tuning_key``) met for the
first time in the process:

1. the shipped table of this GPU: ``tuned/<gpu>.json`` beside this file, ``<gpu>`` the normalised
   ``torch.cuda.get_device_name`` (:func:`table_name`: ``"NVIDIA H200"`` -> ``nvidia-h200``), written by
   ``python -m tools.tune_table``.  An entry for the key whose config is one the kernel's pool and prune
   allow for this call is put in the autotuner's cache: the kernel runs it without benchmarking, only
   its compilation remains (and no losing config is compiled).  An entry the pool or the prune rejects
   is ignored with a one-time warning, and the key autotunes;
2. a prune that leaves one config: that config, unbenchmarked (Triton 3.8 does so itself, 3.6
   benchmarks it);
3. otherwise Triton's autotuner as before: the timings of an earlier process from Triton's cache
   directory (``cache_results=True``: keyed by the Triton version, the GPU target, the kernel source,
   the key and the configs), else every pruned config compiled and benchmarked.

``PASA_TUNED`` (read when a key is first met) chooses the tables: unset or ``1``, the shipped ones; ``0``,
none (for re-tuning, and what ``tools.tune_table`` sets); a ``.json`` path, that table (a folder: its
``<gpu>.json``), e.g. a table just written by ``tools.tune_table`` before it is committed.

Under ``TRITON_INTERPRET=1`` the launchers run one fixed config; inside :func:`interpreter_autotuning`
they autotune (timed by the wall clock), so that a CPU test can write, load and use a table.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import triton

from ..compat import HookedAutotuner, kernel_name

__all__ = ["SMEM_LIMIT", "TABLE_DIR", "TableAutotuner", "autotuned", "autotuners", "bucket", "config_of",
           "forget", "interpreter_autotuning", "interpreter_autotunes", "load_table", "pow2_tile", "table_name",
           "table_payload"]

SMEM_LIMIT = 232448
"""Bytes of shared memory one block may use on sm_90."""

TABLE_DIR = Path(__file__).with_name("tuned")
"""The shipped tables, one ``<table_name(gpu)>.json`` per GPU (package data)."""

TABLE_FORMAT = 1
"""The table files' ``format``: what :func:`load_table` reads and :func:`table_payload` writes."""

ENV = "PASA_TUNED"

INTERPRETER_TABLE = "triton-interpreter"
"""The table name of CPU tensors (Triton's interpreter): tables a CPU test writes; none is shipped."""


def table_name(gpu: str) -> str:
    """A GPU's name as a table's file stem: lower case, each run of other characters than letters and
    digits one ``-`` (``"NVIDIA H200"`` -> ``"nvidia-h200"``, ``"NVIDIA A100-SXM4-80GB"`` ->
    ``"nvidia-a100-sxm4-80gb"``)."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")


def device_gpu(device: torch.device) -> str:
    """The name a table of ``device`` is made for: the CUDA device's name, or the interpreter's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else INTERPRETER_TABLE


# ---- the tables ----------------------------------------------------------------------------------

_WARNED: set[tuple] = set()
"""What has been warned about (each once per process)."""


def _warn_once(what: tuple, message: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"{message} (warned once per process)", UserWarning, stacklevel=4)


def config_of(spec: dict) -> triton.Config:
    """The ``triton.Config`` of a table entry's ``config``: ``{"kwargs": {...}, "num_warps": w,
    "num_stages": s}`` (and ``num_ctas``, ``maxnreg`` where they are not 1 and None)."""
    extra = {k: spec[k] for k in ("num_ctas", "maxnreg") if k in spec}
    return triton.Config(dict(spec["kwargs"]), num_warps=int(spec["num_warps"]), num_stages=int(spec["num_stages"]),
                         **extra)


def _config_spec(cfg: triton.Config) -> dict:
    spec: dict[str, Any] = {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.num_ctas != 1:
        spec["num_ctas"] = cfg.num_ctas
    if cfg.maxnreg is not None:
        spec["maxnreg"] = cfg.maxnreg
    return spec


def load_table(path: str | os.PathLike) -> dict:
    """A table file, checked: ``{"gpu", "triton", "source", "entries": [{"kernel", "key", "dtypes",
    "config", ...}]}``; ``ValueError`` naming the file and what is wrong."""
    path = Path(path)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"tuned table {path}: cannot be read as JSON ({e})") from e
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
        raise ValueError(f"tuned table {path}: expected a JSON object with format={TABLE_FORMAT}")
    entries = table.get("entries")
    if not isinstance(table.get("gpu"), str) or not isinstance(entries, list):
        raise ValueError(f"tuned table {path}: expected 'gpu' (a string) and 'entries' (a list)")
    for i, entry in enumerate(entries):
        try:
            ok = (isinstance(entry["kernel"], str) and isinstance(entry["key"], dict)
                  and isinstance(entry["dtypes"], list) and config_of(entry["config"]) is not None)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"tuned table {path}: entry {i} needs 'kernel' (a string), 'key' (an object), "
                             f"'dtypes' (a list) and 'config' ({{'kwargs', 'num_warps', 'num_stages'}}), got {entry!r}")
    return table


_TABLES: dict[tuple[str, str], dict | None] = {}
"""(PASA_TUNED, GPU name) -> the table that applies (None: none), loaded once."""


def _table_path(setting: str, gpu: str) -> Path | None:
    if setting in ("", "1"):
        path = TABLE_DIR / f"{table_name(gpu)}.json"
        return path if path.is_file() else None
    path = Path(setting)
    if path.is_dir():
        path = path / f"{table_name(gpu)}.json"
        return path if path.is_file() else None
    if not path.is_file():
        raise ValueError(f"{ENV}={setting!r}: no such file or folder; {ENV}=0 turns the shipped tables off, a path "
                         f"names a table (a .json file, or a folder of <gpu>.json tables)")
    return path


def active_table(device: torch.device) -> dict | None:
    """The table that serves launches on ``device`` under the current ``PASA_TUNED`` (module docstring), or
    ``None``.  A table that cannot be read, or is made for another GPU, is ignored with a one-time warning."""
    setting, gpu = os.environ.get(ENV, "1").strip(), device_gpu(device)
    if setting == "0":
        return None
    if (setting, gpu) not in _TABLES:
        table, path = None, _table_path(setting, gpu)
        if path is not None:
            try:
                table = load_table(path)
            except ValueError as e:
                _warn_once(("unreadable", str(path)), f"pasa_diffusers: {e}; autotuning instead")
            else:
                if table_name(table["gpu"]) != table_name(gpu):
                    _warn_once(("gpu", str(path), gpu), f"pasa_diffusers: tuned table {path} is made for "
                               f"{table['gpu']!r}, not this {gpu!r}; ignored, autotuning instead")
                    table = None
                else:
                    table = {**table, "path": str(path)}
        _TABLES[setting, gpu] = table
    return _TABLES[setting, gpu]


# ---- the autotuner -------------------------------------------------------------------------------

_INTERPRETER_AUTOTUNING = [False]


def interpreter_autotunes() -> bool:
    """Whether the launchers autotune under Triton's interpreter (inside :func:`interpreter_autotuning`)."""
    return _INTERPRETER_AUTOTUNING[0]


@contextlib.contextmanager
def interpreter_autotuning() -> Iterator[None]:
    """Inside: the launchers autotune under ``TRITON_INTERPRET=1`` too (configs timed by the wall clock,
    the tables applied) instead of running their fixed interpreter config."""
    before, _INTERPRETER_AUTOTUNING[0] = _INTERPRETER_AUTOTUNING[0], True
    try:
        yield
    finally:
        _INTERPRETER_AUTOTUNING[0] = before


def _wall_clock_bench(kernel_call: Callable[[], Any], quantiles=None) -> list[float]:
    """The interpreter's benchmark (no GPU events, nothing to warm up): one call's wall time in ms (its
    timings say nothing about a GPU; they exercise the autotuner)."""
    start = time.perf_counter()
    kernel_call()
    ms = (time.perf_counter() - start) * 1e3
    return [ms, ms, ms]


class TableAutotuner(HookedAutotuner):
    """Triton's autotuner (through ``compat.HookedAutotuner``) that first takes the shipped table's config for a
    new key (module docstring): its prune leaves only that config, and the one config left is not timed
    (Triton 3.6 and 3.8; ``tests/test_tuned_configs.py`` checks that the key is Triton's).  Records, per key
    met: where its config came from (``sources``: ``"table"``, ``"one config"``, ``"benchmarked"``, ``"disk
    cache"``) and the benchmarked timings (``timings``, ms); ``bench_calls`` counts the configs benchmarked;
    ``last_key`` is the latest key met for the first time.  The table is read where Triton prunes
    (:meth:`choose`), which it does on a key's first launch only: a launch of a known key costs what Triton's
    own does."""

    def __init__(self, name: str, kernel, configs: list[triton.Config], key: list[str], prune: Callable, *,
                 do_bench: Callable | None = None, cache_results: bool = True):
        super().__init__(kernel, configs, key, prune, do_bench=do_bench, cache_results=cache_results)
        missing = [k for k in self.key_names if k not in self.param_names]
        if missing:
            raise ValueError(f"autotuned({name!r}): key {missing} names no argument of the kernel")
        self.name = name
        self.bench_calls = 0
        self.sources: dict[tuple, str] = {}
        self.timings: dict[tuple, dict[triton.Config, float]] = {}
        self.last_key: tuple | None = None
        self._index: dict[str, dict[tuple, dict]] = {}
        self._new_key: tuple | None = None
        self._benched = 0
        self._skip_bench = False

    def split_key(self, key: tuple) -> tuple[dict, list[str]]:
        """A tuning key as a table writes it: the key arguments by name, and the dtypes."""
        names = self.key_names
        return dict(zip(names, key[:len(names)])), list(key[len(names):])

    def before_launch(self) -> None:
        self._new_key, self._skip_bench = None, False

    def after_launch(self) -> None:
        key = self._new_key
        if key is not None and key not in self.sources:
            self.sources[key] = "benchmarked" if self.bench_calls > self._benched else "disk cache"

    def choose(self, pruned: list[triton.Config], kwargs: dict) -> list[triton.Config]:
        """The configs Triton may time for a key met for the first time: Triton calls this only after
        its in-memory cache missed (3.6 and 3.8), so launches of known keys pay nothing here.  The
        table's config for the key (if the pool and the prune allow it for this call), else the pruned
        pool; where one config is left, Triton's timing of it is skipped (3.8 skips it itself)."""
        named = self.launch_args()
        key = self.tuning_key(tuple(named.values()), kwargs)
        self.last_key, self._new_key, self._benched = key, key, self.bench_calls
        device = next(a.device for a in named.values() if isinstance(a, torch.Tensor))
        table = active_table(device)
        entry = self._entry(table, key) if table is not None else None
        if entry is not None:
            cfg = config_of(entry["config"])
            if cfg in pruned:
                self.sources[key], self._skip_bench = "table", True
                return [pruned[pruned.index(cfg)]]
            where = "is not in the kernel's config pool" if cfg not in self.pool else \
                "is in the pool, but its prune rejects it for this call"
            _warn_once(("entry", table["path"], self.name, key),
                       f"pasa_diffusers: tuned table {table['path']}: the {self.name} entry for key "
                       f"{entry['key']} {entry['dtypes']} has config {_config_text(cfg)}, which {where} "
                       f"(allowed: {'; '.join(_config_text(c) for c in pruned)}); ignored, autotuning this key")
        if len(pruned) == 1:
            self.sources[key], self._skip_bench = "one config", True
        return pruned

    def _entry(self, table: dict, key: tuple) -> dict | None:
        """The table's entry for this kernel and key, or ``None``."""
        path = table["path"]
        if path not in self._index:
            index = {}
            names = self.key_names
            for entry in table["entries"]:
                if entry["kernel"] != self.name:
                    continue
                if sorted(entry["key"]) != sorted(names):
                    _warn_once(("names", path, self.name), f"pasa_diffusers: tuned table {path}: {self.name} "
                               f"entries are keyed by {sorted(entry['key'])}, the kernel by {sorted(names)}; "
                               "those entries are ignored")
                    continue
                index[tuple([entry["key"][k] for k in names] + list(entry["dtypes"]))] = entry
            self._index[path] = index
        return self._index[path].get(key)

    def should_time(self, config: triton.Config) -> bool:
        if self._skip_bench:  # the one config left (Triton 3.6 would time it): nothing to compare
            return False
        self.bench_calls += 1
        return True

    def timed(self, config: triton.Config, ms: float) -> None:
        self.timings.setdefault(self.last_key, {})[config] = ms

    def forget(self) -> None:
        """Empty the in-memory cache and the records (the next launch of each key chooses again)."""
        self.bench_calls = 0
        self.forget_choices()
        self.sources.clear()
        self.timings.clear()
        self._index.clear()
        self.last_key = None


def _config_text(cfg: triton.Config) -> str:
    return " ".join([*(f"{k}={v}" for k, v in cfg.kwargs.items()), f"num_warps={cfg.num_warps}",
                     f"num_stages={cfg.num_stages}"])


_AUTOTUNERS: dict[str, TableAutotuner] = {}


def autotuners() -> dict[str, TableAutotuner]:
    """Every autotuned kernel by its table name (``portable.shift``, ``portable.tiled``, ``packed``, ...)."""
    return dict(_AUTOTUNERS)


def forget() -> None:
    """Forget every autotuner's choices and the loaded tables (tests, ``tools.tune_table``); the one-time
    warnings stay given."""
    for tuner in _AUTOTUNERS.values():
        tuner.forget()
    _TABLES.clear()


def autotuned(kernel, configs: list[triton.Config], key: list[str], prune: Callable, *,
              name: str | None = None) -> TableAutotuner:
    """``kernel`` under :class:`TableAutotuner` over ``configs``, chosen per value of the arguments named in
    ``key``, pruned by ``prune(configs, named_args, **kwargs)`` before compiling; results cached on disk.
    ``name`` (default: the kernel's) is its name in the tables, one per autotuner."""
    name = name or kernel_name(kernel)
    if name in _AUTOTUNERS:
        raise ValueError(f"autotuned: name={name!r} is taken; give each autotuner of a kernel its own name")
    from .common import INTERPRET

    tuner = TableAutotuner(name, kernel, configs, key, prune, do_bench=_wall_clock_bench if INTERPRET else None)
    _AUTOTUNERS[name] = tuner
    return tuner


def table_payload(gpu: str, source: dict, shapes: dict[tuple[str, tuple], list[str]] | None = None) -> dict:
    """The table of what every autotuner benchmarked in this process (its cache, the keys whose
    ``sources`` is ``"benchmarked"``): format, ``gpu``, ``triton``, ``source`` (command, date, ...) and one
    entry per (kernel, key): ``key`` (by name), ``dtypes``, ``config``, ``ms`` (its time) and
    ``timings_ms`` (every benchmarked config's), ``shapes`` (``shapes[name, key]``: what met the key)."""
    entries = []
    for name, tuner in sorted(_AUTOTUNERS.items()):
        for key, cfg in tuner.choices.items():
            if tuner.sources.get(key) != "benchmarked":
                continue
            named, dtypes = tuner.split_key(key)
            timings = tuner.timings.get(key, {})
            entries.append({"kernel": name, "key": named, "dtypes": dtypes, "config": _config_spec(cfg),
                            "ms": timings.get(cfg), "timings_ms": {_config_text(c): t for c, t in timings.items()},
                            "shapes": (shapes or {}).get((name, key), [])})
    return {"format": TABLE_FORMAT, "gpu": gpu, "triton": triton.__version__, "source": source, "entries": entries}


def pow2_tile(n: int) -> int:
    """The smallest power of two >= max(n, 16): a tile extent that covers n."""
    return max(16, triton.next_power_of_2(n))


def bucket(n: int) -> int:
    """Autotune bucket of a sequence length: a power of two in [16, 16384]."""
    return min(max(16, triton.next_power_of_2(n)), 16384)
