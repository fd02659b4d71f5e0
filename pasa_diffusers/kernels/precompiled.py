"""Compiled kernels shipped for known GPU architectures: a fresh machine's first video without compiling.

Triton compiles each kernel specialisation on its first launch and keeps the binary in its cache
directory (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), one folder per compile key: a hash of the
kernel's source, its specialisation and options, the GPU target and the whole Triton installation
(``triton.runtime.cache.triton_key``: Triton's Python files and ``libtriton``).  On a fresh machine the
default's first SVD video compiles about ten of them and builds their launchers, 6-8 s
(``bench.cold_start``).

A bundle, ``compiled/<arch>/`` (``sm_90``: the compute capability the binaries are compiled for, which
is all of the compile key that depends on the GPU, so one bundle serves every GPU of the architecture:
H100, H200, GH200), holds such cache entries made on such a GPU by ``python -m bench.precompile``: per
kernel the metadata JSON and the binary (the IR texts Triton also keeps are left out; it needs neither
to launch), the launchers Triton built for them with the host's C compiler, and ``manifest.json`` with
the Triton version and key they were made with.  On the first launch on a CUDA device in a process,
:func:`seed_cache` copies the entries the cache lacks into it, only when the running Triton's key is the
manifest's (another Triton build would never hit them).  Triton then finds them as its own: a key that a
shipped entry does not match compiles as always, so a bundle can only save time, never change what runs.

``PASA_PRECOMPILED=0`` turns seeding off; a custom ``TRITON_CACHE_MANAGER`` (a remote cache, say) is left
alone.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import threading
import warnings
from pathlib import Path

import torch


BUNDLE_DIR = Path(__file__).with_name("compiled")
"""The shipped bundles, one folder per GPU."""

ENV = "PASA_PRECOMPILED"
"""``0``: never seed Triton's cache from a bundle."""

FORMAT = 1
MANIFEST = "manifest.json"
BINARY_SUFFIXES = (".cubin", ".hsaco")
"""The files of an entry a launch reads besides its metadata JSON (CUDA's and AMD's binaries)."""
MODULE_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
"""A compiled launcher's file name ends so (``.cpython-312-x86_64-linux-gnu.so``)."""

KERNEL_SOURCES = ("kernels/common.py", "kernels/hopper.py", "kernels/packed.py", "kernels/prepass.py", "rules.py")
"""The package files (relative to ``pasa_diffusers/``) whose text the bundled kernels are compiled from:
their Triton functions and the constants they read.  A bundle records their sha256; when one changes,
the bundle's entries no longer match any compile key (harmless, but the first video compiles again),
and ``tests/test_precompiled.py`` says so: rerun ``python -m bench.precompile`` on that GPU."""

_SEEDED: dict[int | None, dict] = {}
"""What :func:`seed_cache` did, per CUDA device index (the per-call check)."""
_LOCK = threading.Lock()


def triton_key_digest() -> str:
    """sha256 of ``triton.runtime.cache.triton_key()``: which Triton installation compiled an entry."""
    from triton.runtime.cache import triton_key

    return hashlib.sha256(triton_key().encode()).hexdigest()


def cache_dir() -> Path | None:
    """Triton's cache directory, or None where a custom cache manager stores kernels elsewhere."""
    from triton import knobs

    if os.environ.get("TRITON_CACHE_MANAGER"):
        return None
    return Path(knobs.cache.dir)


def arch_name(capability: tuple[int, int]) -> str:
    """A bundle's folder name for a compute capability: ``(9, 0)`` -> ``"sm_90"``."""
    return f"sm_{capability[0]}{capability[1]}"


def bundle_path(arch: str) -> Path:
    return BUNDLE_DIR / arch


def source_digests() -> dict[str, str]:
    """sha256 of each of :data:`KERNEL_SOURCES` as installed now."""
    package = Path(__file__).resolve().parents[1]
    return {name: hashlib.sha256((package / name).read_bytes()).hexdigest() for name in KERNEL_SOURCES}


def _entry_files(entry: Path) -> list[str] | None:
    """The files of one cache entry to ship: a kernel's metadata JSON and binary, or the one extension
    module of a launcher Triton built with the host's C compiler (``runtime/build.py``: keyed by its
    source and the platform, so it only ever loads where it was built); None for anything else (an
    autotuner's timings)."""
    names = [p.name for p in entry.iterdir() if p.is_file() and not p.name.startswith("__grp__")]
    metadata = [n for n in names if n.endswith(".json") and not n.endswith(".autotune.json")]
    binaries = [n for n in names if n.endswith(BINARY_SUFFIXES)]
    if len(metadata) == 1 and len(binaries) == 1:
        return sorted(metadata + binaries)
    if len(names) == 1 and names[0].endswith(MODULE_SUFFIX):
        return names
    return None


def write_bundle(source: Path, out: Path, *, arch: str, gpu: str, provenance: dict) -> dict:
    """Copy the compiled kernels of the Triton cache folder ``source`` (one that only the kernels to ship
    were compiled into) to the bundle folder ``out``; return its manifest (also written there).  ``arch``:
    what the kernels were compiled for; ``gpu``: the GPU they were made on."""
    import triton

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    entries = {}
    for entry in sorted(p for p in source.iterdir() if p.is_dir()):
        files = _entry_files(entry)
        if files is None:
            continue
        (out / entry.name).mkdir()
        for name in files:
            shutil.copyfile(entry / name, out / entry.name / name)
        entries[entry.name] = files
    manifest = {"format": FORMAT, "arch": arch, "gpu": gpu, "triton": triton.__version__, "triton_key": triton_key_digest(),
                "sources": source_digests(), **provenance, "entries": entries}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _read_manifest(bundle: Path) -> dict | None:
    path = bundle / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: bundle format {manifest.get('format')!r}, this package reads {FORMAT}")
    return manifest


def _install_entry(bundle: Path, key: str, names: list[str], cache: Path) -> bool:
    """Copy one entry into ``cache/key`` as Triton's file cache writes one (each file to a temporary name,
    then renamed; a kernel's group file, which makes it visible, last).  False if Triton already has it."""
    metadata = [n for n in names if n.endswith(".json")]
    dst = cache / key
    done = dst / f"__grp__{metadata[0]}" if metadata else dst / names[0]
    if done.exists():
        return False
    dst.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in names:
        tmp = dst / f"{name}.tmp.pid_{os.getpid()}"
        shutil.copyfile(bundle / key / name, tmp)
        os.replace(tmp, dst / name)
        paths[name] = str(dst / name)
    if metadata:
        tmp = dst / f"{done.name}.tmp.pid_{os.getpid()}"
        tmp.write_text(json.dumps({"child_paths": paths}))
        os.replace(tmp, done)
    return True


def seed_cache(device: torch.device) -> dict:
    """Once per process and device: copy the bundle of ``device``'s architecture into Triton's cache where its
    Triton key is the running one's.  Returns what happened: ``{"bundle", "installed", "present"}`` or
    ``{"skipped": reason}``; an unwritable cache is a warning (the kernels then compile as always)."""
    done = _SEEDED.get(device.index)
    if done is not None:
        return done
    with _LOCK:
        if device.index not in _SEEDED:
            _SEEDED[device.index] = _seed(arch_name(torch.cuda.get_device_capability(device)))
        return _SEEDED[device.index]


def _seed(arch: str) -> dict:
    if os.environ.get(ENV) == "0":
        return {"skipped": f"{ENV}=0"}
    bundle = bundle_path(arch)
    manifest = _read_manifest(bundle)
    if manifest is None:
        return {"skipped": f"no bundle for {arch}"}
    import triton

    if manifest["triton"] != triton.__version__ or manifest["triton_key"] != triton_key_digest():
        return {"skipped": f"the bundle was compiled by another Triton build ({manifest['triton']}, "
                           f"{manifest.get('python', '?')}) than this one ({triton.__version__})"}
    cache = cache_dir()
    if cache is None:
        return {"skipped": "TRITON_CACHE_MANAGER is set: the kernels are cached elsewhere"}
    try:
        installed = sum(_install_entry(bundle, key, names, cache) for key, names in manifest["entries"].items())
    except OSError as e:
        warnings.warn(f"pasa_diffusers: could not copy the compiled {arch} kernels into Triton's cache {cache} "
                      f"({e}); they compile on first use", UserWarning, stacklevel=3)
        return {"skipped": str(e)}
    return {"bundle": str(bundle), "installed": installed, "present": len(manifest["entries"]) - installed}
