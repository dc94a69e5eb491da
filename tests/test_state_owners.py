"""Each piece of the manager's shared state has one owner: the table "Who writes what" in docs/architecture.md
names, for each attribute, the one module whose code writes it, and no other module of the manager does.

A write is an assignment to the attribute (`x.attr = ...`, `x.attr += ...`, `x.attr[...] = ...`, `del
x.attr[...]`), a call of a mutating method on it (`x.attr.add(...)`), or any of these through a local name
bound to an expression that reads the attribute (`registers = store.registers.arrays; registers["slot"][i] = ...`).
An attribute is known by its name alone, so the names the table lists are written nowhere else in the manager,
whatever the object: a second meaning for one of them fails here too."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT

DOC = (ROOT / "docs" / "architecture.md").read_text()
MUTATORS = {
    "add", "append", "appendleft", "clear", "discard", "extend", "fill", "insert", "pop", "popitem", "popleft",
    "remove", "setdefault", "sort", "update",
}  # fmt: skip


def owners() -> dict[str, tuple[str, str]]:
    """attribute name -> (its class, the module the table says writes it)."""
    section = DOC.split("## Who writes what", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2 or not cells[1].startswith("`"):
            continue
        module = cells[1].strip("`")
        for cls, attribute in re.findall(r"`(\w+)\.(\w+)`", cells[0]):
            table[attribute] = cls, module
    return table


def _reads(node: ast.AST) -> set[str]:
    return {each.attr for each in ast.walk(node) if isinstance(each, ast.Attribute)}


def _target(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Subscript):
        node = node.value
    return node


def functions(tree: ast.AST, cls: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of a module, with the class it is a method of ("" for none)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            yield from functions(node, node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield cls, node
            yield from functions(node)


def writes(tree: ast.AST) -> Iterator[tuple[str, int, str]]:
    """(attribute written, line, where: "Class.method" or "function") for every write in a module, through local
    aliases too."""
    for cls, function in functions(tree):
        where = f"{cls}.{function.name}" if cls else function.name
        aliases: dict[str, set[str]] = {}  # local name -> the attributes its value was read from
        for node in _body(function):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
                for name in (t for t in node.targets if isinstance(t, ast.Name)):
                    aliases[name.id] = _reads(node.value)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, ast.Delete) else [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                targets = [node.func.value]
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets.extend(target.elts)
                    continue
                subscripted = isinstance(target, ast.Subscript)
                target = _target(target)
                if isinstance(target, ast.Attribute):
                    yield target.attr, node.lineno, where
                elif subscripted and isinstance(target, ast.Name):
                    for attribute in aliases.get(target.id, ()):
                        yield attribute, node.lineno, where


def _body(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function, but not those of the functions defined in it (walked on their own)."""
    for node in ast.iter_child_nodes(function):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
            yield from _body(node)


def manager_modules() -> Iterator[tuple[str, ast.AST]]:
    for path in sorted((ROOT / "manager").rglob("*.py")):
        yield str(Path(path).relative_to(ROOT)), ast.parse(path.read_text())


def test_the_table_names_modules_that_exist_and_state_they_write():
    table = owners()
    assert len(table) >= 10
    modules = dict(manager_modules())
    assert sorted(module for _, module in table.values() if module not in modules) == []
    written = {attribute for tree in modules.values() for attribute, _, _ in writes(tree)}
    assert sorted(attribute for attribute in table if attribute not in written) == []


@pytest.mark.parametrize("attribute", sorted(owners()))
def test_only_its_owner_writes_it(attribute: str):
    cls, owner = owners()[attribute]
    strangers = [
        f"{module}:{line} ({where})"
        for module, tree in manager_modules()
        if module != owner
        for written, line, where in writes(tree)
        if written == attribute and where != f"{cls}.__init__"  # a record made with its first values
    ]
    assert strangers == [], f"{attribute} is written outside {owner}"


def test_the_scan_sees_writes_through_aliases_and_mutating_calls():
    code = """
def f(store, version, request):
    registers = store.registers.arrays
    registers["slot"][3] = 1
    version.waiting_on.discard(2)
    request.lifecycle = 1
    del store.blocks[0]
    total = store.tail  # a read
"""
    assert sorted(attribute for attribute, _, _ in writes(ast.parse(code))) == [
        "arrays", "blocks", "lifecycle", "registers", "waiting_on",
    ]  # fmt: skip
