"""The layers of the project, read from the source: every import goes down, and no module imports itself back.

``LAYERS`` declares the layers once, from the top (the command line) to the ground (the spec constants).  Each
layer holds one or more *units*, each a module or a package (a package's modules are its unit, unless a longer
name gives one of them a unit of its own).  The rules, with no exceptions:

- every module of the installed package is in exactly one unit;
- an import goes to a unit in a lower layer, or stays inside its own unit: never up, and never sideways to
  another unit of the same layer (the units of one layer are independent);
- a kernel file (the layer under the router, ``kernels/dispatch.py``) imports only the kernel helpers below it
  and the spec constants (``rules``, ``shift_matrix``);
- no module reaches itself through imports: cycles are found by a graph search (strongly connected
  components) over every import of every module, at module level and inside functions, methods and
  ``TYPE_CHECKING`` blocks alike, so that also a circle inside one unit fails.

Imports are read with ``ast``, relative ones resolved to absolute module names.  A ``from x import y``
imports the module ``x.y`` when the source tree has one; else, when the package ``x`` re-exports ``y`` (its
``__init__`` imports it, also lazily: the PEP 562 packages name their homes under ``TYPE_CHECKING``), the
module ``y`` comes from; else ``x``.  Imports made by ``importlib`` at run time (the lazy packages' ``__getattr__``) are seen through the
``TYPE_CHECKING`` imports that name them.  Each rule reports every violating import by file and line.
"""
from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "pasa_diffusers"
KERNELS = f"{PACKAGE}.kernels"

def _declares_entry(path: Path) -> bool:
    """Whether a module ends with a kernel entry: a top-level ``ENTRY = ...`` (the kernel files of ``dispatch.TABLE``)."""
    return any(isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "ENTRY" for target in node.targets)
               for node in ast.parse(path.read_text()).body)


ENTRY_FILES = tuple(f"{KERNELS}.{path.stem}" for path in sorted((ROOT / PACKAGE / "kernels").glob("*.py"))
                    if _declares_entry(path))
"""The kernel files, read from the source: each module of ``kernels/`` that declares its ``ENTRY`` (a new kernel
file joins its layer without an edit here; ``test_the_router_table_holds_one_entry_per_kernel_file`` checks
that the router's table holds exactly these)."""

LAYERS: tuple[tuple[str, ...], ...] = (
    # the applications
    (f"{PACKAGE}.__main__",),
    (f"{PACKAGE}.cli",),
    (f"{PACKAGE}.pipelines",),
    (f"{PACKAGE}.metrics",),
    # the library, per model: the package's face, context-parallel setup, installing
    (f"{PACKAGE}.__init__",),
    (f"{PACKAGE}.parallel",),
    (f"{PACKAGE}.install",),
    # the library, per call
    (f"{PACKAGE}.routing",),
    (f"{PACKAGE}.sharded_attention",),
    (f"{PACKAGE}.sparse_processor",),
    (f"{PACKAGE}.processors",),
    (f"{PACKAGE}.fallbacks", f"{PACKAGE}.peers"),
    (f"{PACKAGE}.masks",),
    # the op and its spec in PyTorch; beside them the numerical study and the overflow diagnosis (which records
    # through its own processors: it needs neither the op nor ours)
    # (and the block-sparse masks of video DiTs and their coverage report: issue 46)
    (f"{PACKAGE}.ops", f"{PACKAGE}.numerics", f"{PACKAGE}.diagnose", f"{PACKAGE}.video_masks",
     f"{PACKAGE}.mask_coverage"),
    (f"{PACKAGE}.reference",),
    (f"{PACKAGE}.reference_int8",),
    # the kernels: router -> kernel files (the entries of ``dispatch.TABLE``; beside them the 8-bit block tally
    # the router counts into: a kernel file cannot reach it, sideways) -> the pre-passes the router runs (the
    # 8-bit kernels share the quantizer's jitted helpers) -> the call object and the entry type every kernel
    # file fills in -> shared kernel helpers
    (f"{KERNELS}.__init__",),
    (f"{KERNELS}.dispatch",),
    (*ENTRY_FILES, f"{KERNELS}.block_tally"),
    (f"{KERNELS}.prepass", f"{KERNELS}.quantize"),
    (f"{KERNELS}.call",),
    (f"{KERNELS}.gluon_common",),
    (f"{KERNELS}.tuning",),
    (f"{KERNELS}.common", f"{KERNELS}.launch"),
    # the spec: constants, names and the few helpers every layer may read
    (f"{PACKAGE}.shift_matrix", f"{PACKAGE}.backends", f"{PACKAGE}.attention_modules", f"{PACKAGE}.files",
     f"{PACKAGE}.block_sparse"),
    (f"{PACKAGE}.rules",),
    (f"{PACKAGE}.variants", f"{PACKAGE}.compat", f"{PACKAGE}.env", f"{PACKAGE}.cpu_math"),
)
"""The layers, from the top; each a tuple of independent units: a module, a package with its modules, or
``PACKAGE.__init__``, a package's own module alone (the top-level package's face)."""


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
    at any depth, in source order, with relative imports resolved against the package they sit in."""
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
    files = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
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


@dataclass(frozen=True)
class Edge:
    """One import of a project module by a project module: who, where, what it loads."""

    source: str
    path: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def project_edges(files: dict[str, tuple[Path, bool]]) -> list[Edge]:
    """Every import of a module of ``files`` by a module of ``files`` (a module importing itself left out)."""
    modules, exports = set(files), _exports(files)
    found = []
    for name, (path, is_package) in sorted(files.items()):
        for imp in read_imports(path.read_text(), name, is_package=is_package):
            for target in targets(imp, modules, exports):
                if target in modules and target != name:
                    found.append(Edge(name, str(path.relative_to(ROOT)), imp.line, target))
    return found


# ------------------------------------------------------------------------------------------------ the rules


def in_unit(module: str, unit: str) -> bool:
    """Whether ``unit`` holds ``module``: ``X.__init__`` holds the package module ``X`` alone, any other unit
    itself and its submodules."""
    if unit.endswith(".__init__"):
        return module == unit.removesuffix(".__init__")
    return within(module, unit)


def unit_of(module: str, layers: Iterable[Iterable[str]] = LAYERS) -> tuple[int, str] | None:
    """``(layer index from the top, unit)`` of ``module``: the longest unit name that holds it; ``None``
    where no unit does."""
    best = None
    for index, layer in enumerate(layers):
        for unit in layer:
            if in_unit(module, unit) and (best is None or len(unit) > len(best[1])):
                best = (index, unit)
    return best


def layer_violations(edges: Iterable[Edge], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Every edge that goes up a layer or sideways between two units of one layer, explained (an edge from or
    to a module in no unit is ``test_every_module_is_in_exactly_one_unit``'s to report)."""
    bad = []
    for edge in edges:
        source, target = unit_of(edge.source, layers), unit_of(edge.target, layers)
        if source is None or target is None:
            continue
        (source_layer, source_unit), (target_layer, target_unit) = source, target
        if source_unit == target_unit or target_layer > source_layer:
            continue
        how = "sideways (same layer)" if target_layer == source_layer else \
            f"up ({source_unit} is layer {source_layer}, {target_unit} layer {target_layer})"
        bad.append(f"{edge}: {how}")
    return bad


def cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """The import cycles: every strongly connected component of more than one module (Tarjan's algorithm,
    iterative), each sorted, the list sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def cycle_report(found: list[list[str]], edges: Iterable[Edge]) -> str:
    """Each cycle with the imports that tie it (file and line)."""
    edges = list(edges)
    lines = []
    for component in found:
        members = set(component)
        lines.append(" <-> ".join(component))
        lines += [f"    {edge}" for edge in edges if edge.source in members and edge.target in members]
    return "\n".join(lines)


FILES = _source_files()
MODULES = set(FILES)
EDGES = project_edges(FILES)


def test_every_module_is_in_exactly_one_unit():
    named = [unit for layer in LAYERS for unit in layer]
    assert len(named) == len(set(named)), "a unit is named twice in LAYERS"
    empty = sorted(unit for unit in named if not any(in_unit(module, unit) for module in MODULES))
    assert not empty, f"units that hold no module: {empty}"
    homeless = sorted(module for module in MODULES if unit_of(module) is None)
    assert not homeless, f"modules in no layer (add them to LAYERS): {homeless}"


def test_every_import_goes_down_a_layer():
    bad = layer_violations(EDGES)
    assert not bad, f"{len(bad)} import(s) go up or sideways:\n" + "\n".join(bad)


KERNEL_FILES = LAYERS[[f"{KERNELS}.dispatch" in layer for layer in LAYERS].index(True) + 1]
"""The kernel files: the layer right under the router (with the router's 8-bit block tally beside them)."""
SPEC_CONSTANTS = (f"{PACKAGE}.rules", f"{PACKAGE}.shift_matrix")
"""What a kernel file may read outside ``kernels/``: the op's rules and the shift's constants (not the variants'
names, not the global tallies: those are the router's)."""
KERNEL_REACH = (*SPEC_CONSTANTS, f"{PACKAGE}.variants", f"{PACKAGE}.compat", f"{PACKAGE}.block_sparse")
"""What any module of ``kernels/`` (the router included) may read outside it: the spec constants, the variants'
names, the version shims and the block-sparse mask the call carries (``call.Call.block_mask``); nothing of the
library above (the tally the router counts into lives in ``kernels/``)."""


def test_the_kernels_reach_outside_only_the_spec():
    assert all(unit in MODULES for unit in KERNEL_REACH)
    bad = [str(edge) for edge in EDGES if within(edge.source, KERNELS) and not within(edge.target, KERNELS)
           and edge.target not in KERNEL_REACH]
    assert not bad, (f"{len(bad)} import(s) from kernels/ reach the library beyond "
                     f"{', '.join(KERNEL_REACH)}:\n" + "\n".join(bad))


def test_kernel_files_import_only_the_kernel_helpers_and_the_spec_constants():
    helpers = {unit for layer in LAYERS[LAYERS.index(KERNEL_FILES) + 1:] for unit in layer if within(unit, KERNELS)}
    assert helpers and all(within(unit, KERNELS) for unit in KERNEL_FILES)
    def unit(module: str) -> str | None:
        found = unit_of(module)
        return None if found is None else found[1]

    bad = [str(edge) for edge in EDGES if unit(edge.source) in KERNEL_FILES
           and unit(edge.target) not in helpers | set(SPEC_CONSTANTS)]
    assert not bad, (f"{len(bad)} import(s) of a kernel file reach beyond the kernel helpers "
                     f"({', '.join(sorted(helpers))}) and {', '.join(SPEC_CONSTANTS)}:\n" + "\n".join(bad))


def test_the_router_table_holds_one_entry_per_kernel_file():
    """Every module of ``kernels/`` that ends with an ``ENTRY`` is in ``dispatch.TABLE`` once, in the kernel-file
    layer, and every entry of the table comes from such a file, under a name of its own."""
    from pasa_diffusers.kernels import dispatch

    declaring = {module for module in MODULES if within(module, KERNELS) and _declares_entry(FILES[module][0])}
    assert declaring and declaring == set(ENTRY_FILES)
    homes = [entry.launch.__module__ for entry in dispatch.TABLE]
    assert sorted(homes) == sorted(declaring), (homes, declaring)
    assert all(home in KERNEL_FILES for home in homes), homes
    names = [entry.name for entry in dispatch.TABLE]
    assert len(set(names)) == len(names) and dispatch.KERNELS == ("auto", *names)


def test_no_module_imports_itself_back():
    found = cycles(EDGES)
    assert not found, f"{len(found)} import cycle(s):\n" + cycle_report(found, EDGES)


def rebound_imports(source: str) -> list[str]:
    """Each name ``source`` imports (at any depth) and then binds again at its top level with a ``def``, a
    ``class`` or an assignment: ``"line N: name (imported on line M)"``.  Such a module-level name replaces the
    imported one for every function of the module, and where the code calling it runs only on a GPU (a Gluon
    launch) nothing on a CPU notices."""
    tree = ast.parse(source)
    imported: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                imported.setdefault((alias.asname or alias.name).split(".")[0], node.lineno)
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        else:
            names = []
        found += [f"line {node.lineno}: {name} (imported on line {imported[name]})" for name in names
                  if name in imported]
    return found


@pytest.mark.parametrize("folder", [PACKAGE, "bench", "tools", "scripts"])
def test_no_module_rebinds_a_name_it_imports(folder):
    found = {str(path.relative_to(ROOT)): rebound for path in sorted((ROOT / folder).rglob("*.py"))
             if (rebound := rebound_imports(path.read_text()))}
    assert not found, f"module-level names that replace an imported one: {found}"


# ---------------------------------------------------------------------------------- the rules can fail


def _edge(source: str, target: str) -> Edge:
    return Edge(source, "x.py", 1, target)


def test_the_rules_catch_an_upward_a_sideways_import_and_a_cycle():
    layers = (("app",), ("lib.a", "lib.b"), ("lib",), ("spec.__init__",))
    assert unit_of("lib.a.inner", layers) == (1, "lib.a") and unit_of("lib.c", layers) == (2, "lib")
    assert unit_of("spec", layers) == (3, "spec.__init__") and unit_of("spec.constants", layers) is None
    assert unit_of("other", layers) is None
    fine = [_edge("app", "lib.a"), _edge("lib.a", "lib.c"), _edge("lib.a", "spec"), _edge("lib.a.x", "lib.a.y")]
    assert layer_violations(fine, layers) == [] and cycles(fine) == []
    assert layer_violations([_edge("spec", "lib.c")], layers) == [
        "x.py:1: spec imports lib.c: up (spec.__init__ is layer 3, lib layer 2)"]
    assert layer_violations([_edge("lib.a", "lib.b")], layers) == ["x.py:1: lib.a imports lib.b: sideways (same layer)"]
    circle = [_edge("lib.a.x", "lib.a.y"), _edge("lib.a.y", "lib.a.z"), _edge("lib.a.z", "lib.a.x"), _edge("app", "spec")]
    assert layer_violations(circle, layers) == []  # inside one unit: only the cycle search sees it
    assert cycles(circle) == [["lib.a.x", "lib.a.y", "lib.a.z"]]
    assert "lib.a.z imports lib.a.x" in cycle_report(cycles(circle), circle)


def test_a_rebound_import_is_found():
    source = ("from .launch import launch\nfrom . import rules\n\ndef run():\n    import os\n\n\n"
              "def launch(call, plan):\n    return run()\n\nos = None\nfine = rules\n")
    assert rebound_imports(source) == ["line 8: launch (imported on line 1)", "line 11: os (imported on line 5)"]


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
        (KERNELS, ("dispatch",), ("dispatch",)), (PACKAGE, ("rules", "beta"), ("op_rules", "beta"))]
    with pytest.raises(ValueError, match="above the top-level package"):
        read_imports("from .. import x\n", "pasa_diffusers.rules")


def test_targets_are_submodules_or_the_homes_of_re_exported_names():
    modules = {PACKAGE, f"{PACKAGE}.rules", f"{PACKAGE}.install", KERNELS, f"{KERNELS}.dispatch"}
    exports = {PACKAGE: {"apply": f"{PACKAGE}.install"}}
    assert targets(Import(PACKAGE, ("rules",), 1), modules, exports) == [f"{PACKAGE}.rules"]
    assert targets(Import(KERNELS, ("dispatch", "helper"), 1), modules, exports) == [f"{KERNELS}.dispatch", KERNELS]
    assert targets(Import(f"{PACKAGE}.rules", ("FP16_MAX", "SHIFT_BLOCK"), 1), modules, exports) == \
        [f"{PACKAGE}.rules"]
    assert targets(Import(PACKAGE, ("apply", "rules"), 1), modules, exports) == \
        [f"{PACKAGE}.install", f"{PACKAGE}.rules"]
    assert targets(Import("torch", (), 1), modules, exports) == ["torch"]


def test_the_tree_is_read_whole_under_its_installed_names():
    assert {"pasa_diffusers.cli.common", "pasa_diffusers.pipelines.svd", "pasa_diffusers.metrics.report",
            "pasa_diffusers.diagnose.stats", "pasa_diffusers.rules", "pasa_diffusers.__main__"} <= MODULES
    assert not any(name.startswith(("pipelines", "metrics")) for name in MODULES)
    exports = _exports(FILES)
    assert exports[PACKAGE]["apply"] == f"{PACKAGE}.install"
    assert exports[f"{PACKAGE}.pipelines"]["load_svd"] == f"{PACKAGE}.pipelines.svd"
    # the rules have something to read: the package imports itself in hundreds of places, in functions too
    assert len(EDGES) > 100
    assert any(edge.source == f"{PACKAGE}.cli.compare" and edge.target == f"{PACKAGE}.install" for edge in EDGES)
