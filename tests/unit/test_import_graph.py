"""The package's import graph: no circles, and arrows between its rooms only the allowed way.

Every module of ds_greedysnake is read with ``ast`` (nothing is imported) and each import of a
ds_greedysnake module, absolute or relative, becomes an arrow importer -> imported:

- ``from .x import y`` is an arrow to ``x``, or to ``x.y`` where that is a module; ``from . import x``
  is an arrow to ``x``. Importing ``pkg.x`` from outside ``pkg`` runs ``pkg/__init__.py`` first, so it
  is an arrow to ``pkg`` too (never to the root package, which every module is already inside).
- An import inside a function counts the same as one at the top of the file for the circle check: it
  runs later, but the two modules still need each other (they cannot be read, moved or tested
  apart, and work only by the order Python happens to import them in). The room rules below say
  where an arrow is allowed only inside a function.
- Not arrows: an import under ``if TYPE_CHECKING:`` (never runs), and one inside a module-level
  ``__getattr__`` (PEP 562): that keeps an old import path working for a user who asks the module for
  that name, and never runs when the package's own modules import each other.
"""
import ast
import importlib.util
import os
import sys
from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Set

import pytest

PACKAGE = "ds_greedysnake"

# ----------------------------------------------------------------------------- the rule, as data
# The rooms of the package. A name puts that module, and everything in it when it is a subpackage,
# in the room (the longest name wins); the root package names its own __init__ only. A module named
# nowhere is in DEFAULT_ROOM. Moving modules into subpackages edits these two tables only.
ROOMS: Dict[str, List[str]] = {
    # What a user imports: the package root, and the old module paths kept for user scripts (shims).
    "api": [PACKAGE, f"{PACKAGE}.plan", f"{PACKAGE}.export", f"{PACKAGE}.pretrained", f"{PACKAGE}.zero_to_fp32"],
    # The engine's construction from a model and a ds_config.
    "entry": [f"{PACKAGE}.initialize"],
    # Hugging Face's Trainer, TRL's SFTTrainer and accelerate's prepare on the engine.
    "hf": [f"{PACKAGE}.hf"],
    "planner": [f"{PACKAGE}.planner"],
    # The step: the engine subclass, the executor, the schedule, the layers, activations, LayerwiseAdam.
    "runtime": [f"{PACKAGE}.runtime"],
    # The per-layer update, inline or in the worker process.
    "optim": [f"{PACKAGE}.optim"],
    # What is trained: the split into layers, the built-in GPT and HF models, weights in and out.
    "models": [f"{PACKAGE}.models"],
    # The SSD, host memory, transfers, checkpoints and the I/O trace.
    "storage": [f"{PACKAGE}.storage"],
}
DEFAULT_ROOM = "base"  # the top-level modules everything builds on: config, deepspeed_compat, shared, ...

ALWAYS = "always"
IN_FUNCTION = "only inside a function"
_BELOW_RUNTIME = {"optim": ALWAYS, "models": ALWAYS, "storage": ALWAYS, "base": ALWAYS}
# importer's room -> {imported room: when}; a room not listed may not be imported at all.
ALLOWED: Dict[str, Dict[str, str]] = {
    "api": {room: ALWAYS for room in ROOMS.keys() | {DEFAULT_ROOM}},
    # The plan is applied at initialize, before the engine exists: the engine never imports the planner.
    "entry": {"entry": ALWAYS, "planner": ALWAYS, "runtime": ALWAYS, **_BELOW_RUNTIME},
    "hf": {"hf": ALWAYS, "entry": ALWAYS, "runtime": ALWAYS, **_BELOW_RUNTIME},
    # The planner reads the schedule; the probe times the built-in GPT's layers and the update, only when it runs.
    "planner": {"planner": ALWAYS, "runtime": ALWAYS, "storage": ALWAYS, "base": ALWAYS,
                "optim": IN_FUNCTION, "models": IN_FUNCTION},
    "runtime": {"runtime": ALWAYS, **_BELOW_RUNTIME},
    # Nothing below the runtime imports it, the planner or an entry point.
    "optim": {"optim": ALWAYS, "storage": ALWAYS, "base": ALWAYS},
    # A model knows nothing of the engine, the executor, the optimizer or the planner.
    "models": {"models": ALWAYS, "storage": ALWAYS, "base": ALWAYS},
    "storage": {"storage": ALWAYS, "base": ALWAYS},
    "base": {"base": ALWAYS},
}


# ----------------------------------------------------------------------------- the graph


@dataclass(frozen=True)
class Arrow:
    importer: str
    imported: str
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = f"{self.importer.replace('.', '/')}.py:{self.line}" + (", in a function" if self.in_function else "")
        return f"{self.importer} -> {self.imported} ({where})"


def package_folder() -> str:
    """The folder of the package on the path, found without importing it."""
    return importlib.util.find_spec(PACKAGE).submodule_search_locations[0]


def package_modules(root: str) -> Dict[str, str]:
    """Dotted module name -> file, for every .py under the package folder ``root``."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                parts = [PACKAGE] + os.path.relpath(os.path.join(folder, name[:-3]), root).split(os.sep)
                parts = [part for part in parts if part not in (".", "__init__")]
                found[".".join(parts)] = os.path.join(folder, name)
    return found


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(node: ast.AST, module: str, is_package: bool, modules: Dict[str, str]) -> List[str]:
    """The package modules an Import/ImportFrom node names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE]
    if node.level:
        base = module.split(".")
        base = base[:len(base) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != PACKAGE:
        return []
    return [f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target for alias in node.names]


def _with_packages(importer: str, imported: str) -> List[str]:
    """``imported`` and each package above it that importing it runs, seen from ``importer``."""
    parts = imported.split(".")
    packages = [".".join(parts[:end]) for end in range(2, len(parts))]
    return [package for package in packages
            if importer != package and not importer.startswith(package + ".")] + [imported]


def module_arrows(module: str, path: str, modules: Dict[str, str]) -> List[Arrow]:
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    is_package = path.endswith("__init__.py")
    arrows = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                for branch in child.orelse:
                    visit(branch, in_function)
                continue
            if node is tree and isinstance(child, ast.FunctionDef) and child.name == "__getattr__":
                continue  # an old import path, kept for users (PEP 562): see the module docstring
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in _imported_names(child, module, is_package, modules):
                    arrows.extend(Arrow(module, target, child.lineno, in_function)
                                  for target in _with_packages(module, name))
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, in_function or nested)

    visit(tree, False)
    return arrows


def package_arrows(root: str) -> List[Arrow]:
    modules = package_modules(root)
    arrows = [arrow for module, path in sorted(modules.items()) for arrow in module_arrows(module, path, modules)]
    return list(dict.fromkeys(arrows))  # one arrow per import line, however many names it imports


def circles(arrows: List[Arrow]) -> List[List[Arrow]]:
    """The shortest circle through each module that is in one, each circle once."""
    out_of: Dict[str, List[Arrow]] = {}
    for arrow in arrows:
        out_of.setdefault(arrow.importer, []).append(arrow)

    def reachable(start: str) -> Set[str]:
        seen, todo = {start}, [start]
        while todo:
            for arrow in out_of.get(todo.pop(), []):
                if arrow.imported not in seen:
                    seen.add(arrow.imported)
                    todo.append(arrow.imported)
        return seen

    reach = {module: reachable(module) for module in out_of}
    found: Dict[frozenset, List[Arrow]] = {}
    for start in sorted(out_of):
        group = {other for other in reach[start] if start in reach.get(other, ())}
        if any(arrow.imported == start for other in group for arrow in out_of.get(other, [])):
            circle = _shortest_circle(start, group, out_of)
            found.setdefault(frozenset(arrow.importer for arrow in circle), circle)
    return list(found.values())


def _shortest_circle(start: str, group: Set[str], out_of: Dict[str, List[Arrow]]) -> List[Arrow]:
    came_by: Dict[str, Arrow] = {}
    todo = deque([start])
    while todo:
        module = todo.popleft()
        for arrow in out_of.get(module, []):
            if arrow.imported == start:
                path = [arrow]
                while path[0].importer != start:
                    path.insert(0, came_by[path[0].importer])
                return path
            if arrow.imported in group and arrow.imported not in came_by:
                came_by[arrow.imported] = arrow
                todo.append(arrow.imported)
    raise AssertionError(f"{start} is in a circle but none was found")


def room_of(module: str) -> str:
    best, room = "", DEFAULT_ROOM
    for name, names in ((name, room) for room, names in ROOMS.items() for name in names):
        if (module == name or (name != PACKAGE and module.startswith(name + "."))) and len(name) > len(best):
            best, room = name, names
    return room


def wrong_way(arrows: List[Arrow]) -> List[str]:
    problems = []
    for arrow in arrows:
        importer, imported = room_of(arrow.importer), room_of(arrow.imported)
        when = ALLOWED[importer].get(imported)
        if when is None:
            problems.append(f"{arrow}: {importer} may not import {imported}")
        elif when == IN_FUNCTION and not arrow.in_function:
            problems.append(f"{arrow}: {importer} imports {imported} {IN_FUNCTION}")
    return problems


# ----------------------------------------------------------------------------- the tests


def test_no_import_circles():
    found = circles(package_arrows(package_folder()))
    assert not found, "import circles (move what both sides need below both):\n" + "\n".join(
        "  " + "\n    ".join(str(arrow) for arrow in circle) for circle in found)


def test_arrows_between_rooms_go_the_allowed_way():
    problems = wrong_way(package_arrows(package_folder()))
    assert not problems, "imports against the room rule (ALLOWED in this file):\n  " + "\n  ".join(problems)


def test_the_rule_names_real_modules_and_rooms():
    modules = package_modules(package_folder())
    stale = [name for names in ROOMS.values() for name in names if name not in modules]
    assert not stale, f"ROOMS names modules that do not exist: {stale}"
    rooms = set(ROOMS) | {DEFAULT_ROOM}
    assert set(ALLOWED) == rooms and all(set(allowed) <= rooms for allowed in ALLOWED.values())
    missing = [str(arrow) for arrow in package_arrows(package_folder()) if arrow.imported not in modules]
    assert not missing, f"imports of modules that do not exist: {missing}"


TOY_ROOMS = {"entry": [PACKAGE], "engine": [f"{PACKAGE}.engine"], "models": [f"{PACKAGE}.models"]}
TOY_ALLOWED = {"entry": {"entry": ALWAYS, "engine": ALWAYS, "core": ALWAYS, "models": ALWAYS},
               "engine": {"engine": ALWAYS, "core": ALWAYS, "models": ALWAYS},
               "core": {"core": ALWAYS, "models": ALWAYS}, "models": {"models": ALWAYS, "core": ALWAYS}}


def test_the_walk_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The checks on a made-up package: relative and absolute imports, a function-local one, a subpackage's
    __init__, and the two skipped kinds; a circle and a wrong-way arrow are found and named (by a rule of its own)."""
    for name, value in (("ROOMS", TOY_ROOMS), ("ALLOWED", TOY_ALLOWED), ("DEFAULT_ROOM", "core")):
        monkeypatch.setattr(sys.modules[__name__], name, value)
    package = tmp_path / PACKAGE
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import engine\n")
    (package / "engine.py").write_text(f"import {PACKAGE}.core_a\n")
    (package / "core_a.py").write_text("def f():\n    from .models.net import Net\n")
    (package / "models" / "__init__.py").write_text("")
    (package / "models" / "net.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .. import core_b\nif TYPE_CHECKING:\n    from ..engine import E\n"
        "def __getattr__(name):\n    from ..engine import E\n    return E\n")
    (package / "core_b.py").write_text("from .core_a import f\nfrom .engine import Engine\n")
    arrows = package_arrows(str(package))
    assert {(a.importer, a.imported, a.in_function) for a in arrows} == {
        (PACKAGE, f"{PACKAGE}.engine", False), (f"{PACKAGE}.engine", f"{PACKAGE}.core_a", False),
        (f"{PACKAGE}.core_a", f"{PACKAGE}.models", True), (f"{PACKAGE}.core_a", f"{PACKAGE}.models.net", True),
        (f"{PACKAGE}.models.net", f"{PACKAGE}.core_b", False), (f"{PACKAGE}.core_b", f"{PACKAGE}.core_a", False),
        (f"{PACKAGE}.core_b", f"{PACKAGE}.engine", False)}
    found = circles(arrows)
    assert [[arrow.importer for arrow in circle] for circle in found] == [
        [f"{PACKAGE}.core_a", f"{PACKAGE}.models.net", f"{PACKAGE}.core_b"],
        [f"{PACKAGE}.engine", f"{PACKAGE}.core_a", f"{PACKAGE}.models.net", f"{PACKAGE}.core_b"]]
    assert "core_a.py:2, in a function" in str(found[0][0])
    assert wrong_way(arrows) == [f"{PACKAGE}.core_b -> {PACKAGE}.engine ({PACKAGE}/core_b.py:2): "
                                 "core may not import engine"]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
