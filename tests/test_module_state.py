"""No module of this project has its attributes set from outside at run time (issue 45,
part 6): code that needs another behaviour of a function is handed it as an argument
(eval/knn.py's knn_classify takes its `search`), so what a module holds is what its own
source says. Tests may monkeypatch; the package and the studies may not.

What counts: an assignment, augmented assignment or `del` whose target is an attribute of
a module of resmlp (`knn.knn_search = ...`, `cli.COMMANDS["x"] = ...`), and setattr on one.
A library's own settings (torch.backends.*) are that library's business, not this check's."""
from __future__ import annotations

import ast
from pathlib import Path

from kit import PRODUCT

REPO = Path(__file__).resolve().parent.parent
PACKAGES = PRODUCT
SCANNED = (*PACKAGES, "studies", "tools")


def _is_ours(module: str) -> bool:
    """Whether the dotted name is a module (or package) of resmlp."""
    parts = module.split(".")
    if parts[0] != "resmlp" or len(parts) < 2 or parts[1] not in PACKAGES:
        return False
    path = REPO.joinpath(*parts[1:])
    return path.is_dir() or path.with_suffix(".py").is_file()


def _aliases(tree: ast.AST) -> dict[str, str]:
    """{name in this file: the resmlp module it is bound to by an import}."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    found[a.asname] = a.name
                else:
                    found[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                found[a.asname or a.name] = f"{node.module}.{a.name}"
    return {name: module for name, module in found.items() if module == "resmlp" or _is_ours(module)}


def _module_of(node: ast.AST, aliases: dict) -> str | None:
    """The resmlp module an expression (a name, a dotted chain of names) names, or None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        outer = _module_of(node.value, aliases)
        return f"{outer}.{node.attr}" if outer and _is_ours(f"{outer}.{node.attr}") else None
    return None


def writes_to_modules(source: str) -> list[tuple[int, str]]:
    """(line, what) for every attribute of a resmlp module the source sets or deletes."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = []

    def target(t):
        while isinstance(t, ast.Subscript):   # cli.COMMANDS["x"] = ...: the module's table changes
            t = t.value
        if isinstance(t, ast.Attribute) and _module_of(t.value, aliases):
            found.append((t.lineno, f"{_module_of(t.value, aliases)}.{t.attr}"))
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                target(e)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                target(t)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            target(node.target)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                target(t)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and _module_of(node.args[0], aliases):
            found.append((node.lineno, f"{_module_of(node.args[0], aliases)} ({node.func.id})"))
    return sorted(found)


def test_the_finder_sees_a_write_to_a_module_and_lets_an_object_be():
    src = ("import resmlp.eval.knn as knn\n"
           "from resmlp.eval import knn_search as ours\n"
           "from resmlp.core import cli\n"
           "import resmlp.core.config\n"
           "from resmlp.eval.knn import knn_classify\n"
           "import torch\n"
           "knn.knn_search = ours.knn_search\n"             # 7: the bench's old swap
           "cli.COMMANDS['campaign'] = 1\n"                 # 8: a module's table
           "setattr(ours, 'BUDGET', 1)\n"                   # 9
           "resmlp.core.config.CONFIG_DIR = None\n"         # 10
           "del knn.knn_search\n"                           # 11
           "knn_classify.cache = {}\n"                      # a function's attribute: not a module's
           "torch.backends.cudnn.benchmark = True\n"        # a library's setting
           "model.grid_adapt = 'none'\n")                   # an object's
    assert writes_to_modules(src) == [(7, "resmlp.eval.knn.knn_search"), (8, "resmlp.core.cli.COMMANDS"),
                                      (9, "resmlp.eval.knn_search (setattr)"), (10, "resmlp.core.config.CONFIG_DIR"),
                                      (11, "resmlp.eval.knn.knn_search")]


def test_no_module_of_the_project_is_changed_from_outside_at_run_time():
    found = [f"{path.relative_to(REPO)}:{line} sets {what}"
             for folder in SCANNED for path in sorted((REPO / folder).rglob("*.py"))
             for line, what in writes_to_modules(path.read_text())]
    assert not found, "hand the code what it needs as an argument instead:\n" + "\n".join(found)
