"""Packaging: installing the project adds one import package, ``pasa_diffusers``, with every subpackage."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_source_package_is_installed_under_pasa_diffusers():
    """The folders are the packages: every package with an ``__init__.py`` under ``pasa_diffusers/`` is listed, and
    no package is installed from a folder of another name (no ``package-dir`` remap)."""
    config = _setuptools()
    assert "package-dir" not in config
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "pasa_diffusers").rglob("__init__.py")}
    assert set(config["packages"]) == found
    assert all(name == "pasa_diffusers" or name.startswith("pasa_diffusers.") for name in config["packages"])



def _requirement(name: str) -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [r for r in project["dependencies"] if r.split(";")[0].strip().startswith(name)]
    assert len(found) == 1, f"pyproject.toml names {name} {len(found)} times"
    return found[0].split(";")[0].strip()


def test_the_pins_hold_the_versions_compat_was_read_from_and_the_ones_installed():
    """pyproject.toml states the releases the code is tested with: the diffusers and Triton releases whose
    private API ``compat.py`` calls fall inside the pins, and so do the torch, diffusers and Triton installed."""
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.version import Version

    from pasa_diffusers import compat

    pins = {name: Requirement(_requirement(name)).specifier for name in ("torch", "diffusers", "triton")}
    assert Version(compat.DIFFUSERS_VERSION) in pins["diffusers"]
    assert all(Version(v) in pins["triton"] for v in compat.TRITON_VERSIONS)
    for name, specifier in pins.items():
        installed = Version(Version(version(name)).base_version)  # 2.14.1+cu130 -> 2.14.1
        assert installed in specifier, f"{name} {installed} is installed, outside the pin {specifier}"
    assert not any(Version(v) in pins["diffusers"] for v in ("0.32", "0.41.0", "0.43.0")), \
        "the diffusers pin must not claim releases the private API was not read from"
