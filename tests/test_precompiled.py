"""The shipped compiled kernels (``kernels/precompiled.py``): a bundle is written from a Triton cache,
seeded into an empty one where Triton's own file cache finds it, never where it cannot match, and the
shipped bundle is current with the kernel sources it was compiled from."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pasa_diffusers.kernels import precompiled  # noqa: E402

ARCH = "sm_90"


def _fake_cache(root: Path) -> Path:
    """A Triton cache as a compile leaves it: a kernel's metadata, binary, IR texts and group file, and a
    folder holding only an autotuner's timings."""
    kernel = root / "KERNELKEY"
    kernel.mkdir(parents=True)
    (kernel / "k.json").write_text('{"name": "k"}')
    (kernel / "k.cubin").write_bytes(b"\x7fELF binary")
    (kernel / "k.ttgir").write_text("ir")
    (kernel / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.json": str(kernel / "k.json")}}))
    tuned = root / "TUNEKEY"
    tuned.mkdir()
    (tuned / "k.autotune.json").write_text("{}")
    launcher = root / "LAUNCHERKEY"
    launcher.mkdir()
    (launcher / f"__triton_launcher{precompiled.MODULE_SUFFIX}").write_bytes(b"\x7fELF module")
    return root


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    """A bundle for ``ARCH`` made by the running Triton, installed as the package's bundle folder."""
    bundles = tmp_path / "bundles"
    manifest = precompiled.write_bundle(_fake_cache(tmp_path / "made"), bundles / ARCH, arch=ARCH, gpu="NVIDIA H200",
                                        provenance={"python": "3.x", "command": "test"})
    monkeypatch.setattr(precompiled, "BUNDLE_DIR", bundles)
    monkeypatch.delenv(precompiled.ENV, raising=False)
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    return bundles / ARCH, manifest, cache


def test_a_bundle_keeps_each_kernels_metadata_and_binary_only(bundle):
    folder, manifest, _ = bundle
    module = f"__triton_launcher{precompiled.MODULE_SUFFIX}"
    assert manifest["entries"] == {"KERNELKEY": ["k.cubin", "k.json"], "LAUNCHERKEY": [module]}
    assert sorted(p.name for p in (folder / "KERNELKEY").iterdir()) == ["k.cubin", "k.json"]
    assert not (folder / "TUNEKEY").exists()
    assert manifest["triton_key"] == precompiled.triton_key_digest()
    assert manifest["sources"] == precompiled.source_digests()
    assert json.loads((folder / precompiled.MANIFEST).read_text()) == manifest


def test_seeding_installs_what_tritons_file_cache_then_finds(bundle):
    from triton.runtime.cache import FileCacheManager

    folder, _, cache = bundle
    assert precompiled._seed(ARCH) == {"bundle": str(folder), "installed": 2, "present": 0}
    group = FileCacheManager("KERNELKEY").get_group("k.json")  # Triton's own lookup of a compiled kernel
    assert group == {"k.json": str(cache / "KERNELKEY" / "k.json"), "k.cubin": str(cache / "KERNELKEY" / "k.cubin")}
    assert (cache / "KERNELKEY" / "k.cubin").read_bytes() == b"\x7fELF binary"
    module = f"__triton_launcher{precompiled.MODULE_SUFFIX}"
    assert FileCacheManager("LAUNCHERKEY").get_file(module) == str(cache / "LAUNCHERKEY" / module)  # a launcher's
    assert not any(".tmp." in p.name for p in (cache / "KERNELKEY").iterdir())
    assert precompiled._seed(ARCH) == {"bundle": str(folder), "installed": 0, "present": 2}


def test_nothing_is_seeded_where_it_cannot_match_or_is_not_wanted(bundle, monkeypatch):
    folder, manifest, cache = bundle
    assert precompiled._seed("sm_80") == {"skipped": "no bundle for sm_80"}
    monkeypatch.setenv(precompiled.ENV, "0")
    assert precompiled._seed(ARCH) == {"skipped": "PASA_PRECOMPILED=0"}
    monkeypatch.delenv(precompiled.ENV)
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "my.remote:Cache")
    assert "TRITON_CACHE_MANAGER" in precompiled._seed(ARCH)["skipped"]
    monkeypatch.delenv("TRITON_CACHE_MANAGER")
    (folder / precompiled.MANIFEST).write_text(json.dumps({**manifest, "triton_key": "0" * 64}))
    assert "another Triton build" in precompiled._seed(ARCH)["skipped"]
    assert not cache.exists()


def test_an_unwritable_cache_is_a_warning(bundle, tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")  # no folder can be made under it, whoever runs the test
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocked / "cache"))
    with pytest.warns(UserWarning, match="could not copy the compiled sm_90 kernels"):
        assert "skipped" in precompiled._seed(ARCH)


def test_seed_cache_runs_once_per_device(bundle, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: calls.append(device) or (9, 0))
    monkeypatch.setattr(precompiled, "_SEEDED", {})
    first = precompiled.seed_cache(torch.device("cuda", 0))
    assert first["installed"] == 2
    assert precompiled.seed_cache(torch.device("cuda", 0)) is first and len(calls) == 1


def test_a_bundle_of_another_format_is_refused(bundle):
    folder, manifest, _ = bundle
    (folder / precompiled.MANIFEST).write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(ValueError, match="bundle format 99"):
        precompiled._seed(ARCH)


@pytest.mark.parametrize("folder", sorted(p for p in precompiled.BUNDLE_DIR.iterdir() if p.is_dir()),
                         ids=lambda p: p.name)
def test_the_shipped_bundles_are_whole_and_current(folder):
    """Each shipped bundle: named for its architecture, every entry's files present, and compiled from the kernel
    sources as they are now (a changed kernel file: rerun ``python -m bench.precompile`` on that GPU and
    commit its output, or the first video there compiles again)."""
    manifest = json.loads((folder / precompiled.MANIFEST).read_text())
    assert manifest["format"] == precompiled.FORMAT and manifest["arch"] == folder.name
    for key, names in manifest["entries"].items():
        assert sorted(p.name for p in (folder / key).iterdir()) == sorted(names)
        assert any(n.endswith(precompiled.BINARY_SUFFIXES) for n in names) or (len(names) == 1 and names[0].endswith(".so"))
    stale = {name for name, digest in precompiled.source_digests().items() if manifest["sources"].get(name) != digest}
    assert not stale, (f"{folder.name}: the bundled kernels were compiled from other versions of {sorted(stale)}; "
                       f"rerun python -m bench.precompile on an {manifest['arch']} GPU and commit its output here")
