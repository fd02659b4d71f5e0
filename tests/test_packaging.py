"""Packaging: installing the project adds one import package, ``pasa_diffusers``, with every subpackage."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_source_package_is_installed_under_pasa_diffusers():
    config = _setuptools()
    folders = {"pasa_diffusers": "pasa_diffusers", **config["package-dir"]}
    found = set()
    for package, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert set(config["packages"]) == found
    assert all(name == "pasa_diffusers" or name.startswith("pasa_diffusers.") for name in config["packages"])

