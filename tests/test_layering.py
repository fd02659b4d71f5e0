"""The layers of the project, read from the source: which module may import which.

Imports are read with ``ast`` (every ``import x`` and ``from x import y``, at any depth: inside
functions, under ``TYPE_CHECKING``), relative ones resolved to absolute module names.  A ``from x
import y`` imports the module ``x.y`` when the source tree has one; else, when the package ``x``
re-exports ``y`` (its ``__init__`` imports it, also lazily: the PEP 562 packages name their homes under
``TYPE_CHECKING``), the module ``y`` comes from; else ``x``.  The folders
``pipelines/`` and ``metrics/`` install as ``pasa_diffusers.pipelines`` and ``pasa_diffusers.metrics``
(``pyproject.toml``), and are read under those names.  Each rule reports every violating import by
file and line.

The layers: the library (``pasa_diffusers/`` but ``cli/``) never imports the applications
(``pasa_diffusers.pipelines``, ``pasa_diffusers.cli``); ``metrics`` never imports the op or the
kernels; the diagnosis (``pasa_diffusers/diagnose/``) never imports ``install`` or ``processors``;
inside ``kernels/`` imports go downward only (``dispatch`` -> kernel files -> shared helpers), and
outside it only ``ops`` reaches the kernels, through ``dispatch``.
"""
from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

KERNELS = "pasa_diffusers.kernels"
DISPATCH = f"{KERNELS}.dispatch"
KERNEL_FILES = {f"{KERNELS}.{name}" for name in ("portable", "packed", "hopper", "prepass", "int8", "hopper_int8")}
SIDEWAYS = {(f"{KERNELS}.int8", f"{KERNELS}.hopper_int8"), (f"{KERNELS}.hopper_int8", f"{KERNELS}.hopper")}
"""The kernel files' only sideways imports: the 8-bit path's launcher chooses its attention kernel (the Gluon
one or its own), and the Gluon int8 kernel reuses ``hopper.py``'s Gluon helpers (editing ``hopper.py`` to move
them would make the shipped sm_90 bundle stale)."""
HELPERS = {f"{KERNELS}.{name}" for name in ("common", "tuning")}
KERNEL_DEPENDENCIES = HELPERS | {"pasa_diffusers.rules", "pasa_diffusers.beta", "pasa_diffusers.variants",
                                 "pasa_diffusers.block_tally"}
"""What a kernel file may import of the project."""
APPLICATIONS = ("pasa_diffusers.pipelines", "pasa_diffusers.cli")
ENTRY_POINT = "pasa_diffusers.__main__"
"""``python -m pasa_diffusers``: the command line's entry point, part of the CLI though it sits in the package."""


@dataclass(frozen=True)
class Import:
    """One import statement: the absolute module it names, the names it takes (``from`` only), its line,
    and the names it binds (``as`` aliases; the names themselves without one)."""

    module: str
    names: tuple[str, ...]
    line: int
    bound: tuple[str, ...] = ()


def read_imports(source: str, module: str, *, is_package: bool = False) -> list[Import]:
    """Every import of ``source``, the code of ``module`` (a package's ``__init__`` when ``is_package``),
    in source order, with relative imports resolved against the package they sit in."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise ValueError(f"{module}: line {node.lineno} imports above the top-level package")
                anchor = ".".join(parts[:len(parts) - (node.level - 1)])
                base = f"{anchor}.{base}" if base else anchor
            found.append(Import(base, tuple(alias.name for alias in node.names), node.lineno,
                                tuple(alias.asname or alias.name for alias in node.names)))
    return sorted(found, key=lambda imp: imp.line)


def targets(imp: Import, modules: set[str], exports: dict[str, dict[str, str]]) -> list[str]:
    """The modules ``imp`` loads, in order, once each: for each name, the module ``x.y`` of ``modules``, or
    the module that package ``x`` re-exports it from (``exports``), or else ``x`` itself."""
    if not imp.names:
        return [imp.module]
    found = []
    for name in imp.names:
        submodule = f"{imp.module}.{name}"
        target = submodule if submodule in modules else exports.get(imp.module, {}).get(name, imp.module)
        if target not in found:
            found.append(target)
    return found


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _source_files() -> dict[str, tuple[Path, bool]]:
    """Every module of the installed package: ``name -> (file, is_package)``."""
    folders = {"pasa_diffusers": "pasa_diffusers",
               **tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]}
    files = {}
    for package, folder in folders.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            files[".".join((package, *(parts[:-1] if is_package else parts)))] = (path, is_package)
    return files


def _exports(files: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, str]]:
    """Per package: each name its ``__init__`` binds by a ``from`` import -> the module that name comes from."""
    modules = set(files)
    exports: dict[str, dict[str, str]] = {}
    for name, (path, is_package) in files.items():
        if is_package:
            for imp in read_imports(path.read_text(), name, is_package=True):
                for taken, bound in zip(imp.names, imp.bound):
                    home = targets(Import(imp.module, (taken,), imp.line), modules, {})[0]
                    exports.setdefault(name, {})[bound] = home
    return exports


FILES = _source_files()
MODULES = set(FILES)
EXPORTS = _exports(FILES)


@dataclass(frozen=True)
class Edge:
    """One import of the project's modules: who, where, what it loads."""

    source: str
    path: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.source} imports {self.target}"


def edges() -> Iterator[Edge]:
    for name, (path, is_package) in sorted(FILES.items()):
        for imp in read_imports(path.read_text(), name, is_package=is_package):
            for target in targets(imp, MODULES, EXPORTS):
                yield Edge(name, path, imp.line, target)


EDGES = list(edges())


def is_library(module: str) -> bool:
    return not any(within(module, app) for app in (*APPLICATIONS, "pasa_diffusers.metrics")) and module != ENTRY_POINT


def _report(violations: list[Edge], rule: str) -> str:
    return f"{len(violations)} import(s) break the rule: {rule}\n" + "\n".join(map(str, violations))


# ------------------------------------------------------------------------------------------- the reader


SYNTHETIC = '''\
import os, numpy as np
from typing import TYPE_CHECKING
from . import rules
from .. import beta
from .kernels import dispatch, not_a_module
from ..pipelines.svd import load_svd

if TYPE_CHECKING:
    from .processors import SDPAAttnProcessor


def run():
    import torch.nn.functional as F
    from .. import cli

    class Inner:
        def method(self):
            from ..metrics.records import write_json
'''


def test_the_reader_sees_every_import_with_relative_ones_resolved():
    got = read_imports(SYNTHETIC, "pasa_diffusers.diagnose.collect")
    assert [(imp.module, imp.names, imp.line) for imp in got] == [
        ("os", (), 1),
        ("numpy", (), 1),
        ("typing", ("TYPE_CHECKING",), 2),
        ("pasa_diffusers.diagnose", ("rules",), 3),
        ("pasa_diffusers", ("beta",), 4),
        ("pasa_diffusers.diagnose.kernels", ("dispatch", "not_a_module"), 5),
        ("pasa_diffusers.pipelines.svd", ("load_svd",), 6),
        ("pasa_diffusers.diagnose.processors", ("SDPAAttnProcessor",), 9),
        ("torch.nn.functional", (), 13),
        ("pasa_diffusers", ("cli",), 14),
        ("pasa_diffusers.metrics.records", ("write_json",), 18),
    ]


def test_the_reader_resolves_a_package_init_against_itself():
    got = read_imports("from . import dispatch\nfrom .. import rules as op_rules, beta\n", KERNELS, is_package=True)
    assert [(imp.module, imp.names, imp.bound) for imp in got] == [
        (KERNELS, ("dispatch",), ("dispatch",)), ("pasa_diffusers", ("rules", "beta"), ("op_rules", "beta"))]
    with pytest.raises(ValueError, match="above the top-level package"):
        read_imports("from .. import x\n", "pasa_diffusers.rules")


def test_targets_are_submodules_or_the_homes_of_re_exported_names():
    modules = {"pasa_diffusers", "pasa_diffusers.rules", "pasa_diffusers.install", KERNELS, DISPATCH}
    exports = {"pasa_diffusers": {"apply": "pasa_diffusers.install"}}
    assert targets(Import("pasa_diffusers", ("rules",), 1), modules, exports) == ["pasa_diffusers.rules"]
    assert targets(Import(KERNELS, ("dispatch", "helper"), 1), modules, exports) == [DISPATCH, KERNELS]
    assert targets(Import("pasa_diffusers.rules", ("FP16_MAX", "SHIFT_BLOCK"), 1), modules, exports) == \
        ["pasa_diffusers.rules"]
    assert targets(Import("pasa_diffusers", ("apply", "rules"), 1), modules, exports) == \
        ["pasa_diffusers.install", "pasa_diffusers.rules"]
    assert targets(Import("torch", (), 1), modules, exports) == ["torch"]


def test_the_lazy_packages_re_exports_are_seen():
    assert EXPORTS["pasa_diffusers"]["PASAAttnProcessor"] == "pasa_diffusers.processors"
    assert EXPORTS["pasa_diffusers"]["apply"] == "pasa_diffusers.install"
    assert EXPORTS["pasa_diffusers.diagnose"]["recording"] == "pasa_diffusers.diagnose.collect"
    assert EXPORTS["pasa_diffusers.pipelines"]["load_svd"] == "pasa_diffusers.pipelines.svd"


def test_the_tree_is_read_under_its_installed_names():
    assert {"pasa_diffusers.cli.common", "pasa_diffusers.pipelines.svd", "pasa_diffusers.metrics.report",
            "pasa_diffusers.diagnose.stats", "pasa_diffusers.rules", ENTRY_POINT} <= MODULES
    assert not any(name.startswith(("pipelines", "metrics")) for name in MODULES)
    # the rules below have something to read: the package imports itself in hundreds of places
    assert sum(edge.target.startswith("pasa_diffusers") for edge in EDGES) > 100


# -------------------------------------------------------------------------------------------- the rules


def test_the_library_never_imports_the_applications():
    bad = [e for e in EDGES if is_library(e.source) and any(within(e.target, app) for app in APPLICATIONS)]
    assert not bad, _report(bad, "the library (pasa_diffusers/ but cli/) never imports pipelines or cli")


def test_metrics_never_imports_the_op_or_the_kernels():
    bad = [e for e in EDGES if within(e.source, "pasa_diffusers.metrics")
           and (within(e.target, "pasa_diffusers.ops") or within(e.target, KERNELS))]
    assert not bad, _report(bad, "metrics never imports pasa_diffusers.ops nor pasa_diffusers.kernels")


def test_the_diagnosis_never_imports_install_or_processors():
    bad = [e for e in EDGES if within(e.source, "pasa_diffusers.diagnose")
           and (within(e.target, "pasa_diffusers.install") or within(e.target, "pasa_diffusers.processors"))]
    assert not bad, _report(bad, "pasa_diffusers/diagnose/ imports neither install nor processors")


def test_kernels_holds_only_the_known_layers():
    known = {KERNELS, DISPATCH, *KERNEL_FILES, *HELPERS}
    unknown = sorted(name for name in MODULES if within(name, KERNELS) and name not in known)
    assert not unknown, f"modules of kernels/ in no layer (dispatch, kernel file, helper): {unknown}"


def _kernel_rule(source: str, target: str) -> bool:
    """Whether ``source`` (a module of kernels/) may import ``target`` (a module of the project)."""
    if source in (KERNELS, DISPATCH):
        return target in KERNEL_FILES | KERNEL_DEPENDENCIES | ({DISPATCH} if source == KERNELS else set())
    if source in KERNEL_FILES:
        return target in KERNEL_DEPENDENCIES or (source, target) in SIDEWAYS
    return target in KERNEL_DEPENDENCIES and target != source  # a helper: the other helper, rules, beta, variants


def test_kernel_imports_go_downward_only():
    bad = [e for e in EDGES if within(e.source, KERNELS) and e.target.startswith("pasa_diffusers")
           and not _kernel_rule(e.source, e.target)]
    assert not bad, _report(bad, "dispatch -> kernel files (portable, packed, hopper, prepass) -> helpers (common, "
                                 "tuning) and rules, beta, variants; never sideways or up")


def test_outside_kernels_only_ops_reaches_them_through_dispatch():
    bad = [e for e in EDGES if within(e.target, KERNELS) and not within(e.source, KERNELS)
           and not (e.source == "pasa_diffusers.ops" and e.target == DISPATCH)]
    assert not bad, _report(bad, "outside kernels/ only pasa_diffusers.ops imports the kernels, and only dispatch")
