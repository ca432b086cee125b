"""The package's dependencies flow one way (docs/layout.md):

    core  <-  data, models  <-  eval, ssl, supervised  <-  the command line

A module may import its own layer and the layers below it, never one above, and no two
modules may import each other, directly or round a loop. Every import counts, also one
inside a function (the commands import lazily to start fast): a lazy import upward is
still a dependency upward. The command line (core/cli.py and its `python -m` entry)
lives in core/ but is the top layer: its command table names a module of every command,
and it hands its own entry to the SLURM launcher (core/slurm.py) to run in the job.
The tools of the repository (tools/: the bench, the campaign) use the package from outside:
no module of the package imports one of them.

Every module reads in one sitting: no file of the package over MAX_FILE_LINES lines (fewer
where LONGEST_FILES says so), no function or method over MAX_FUNCTION_LINES.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYER = {"core": 0, "data": 1, "models": 1, "eval": 2, "ssl": 2, "supervised": 2}
PACKAGES = tuple(LAYER)
COMMAND_LINE = {"resmlp.core.cli", "resmlp.core.__main__"}
TOP = 3


def modules() -> dict[str, Path]:
    """resmlp.<package>[.<subpackage>].<module> -> its file, for every module of the package
    (models/kernels/ is a subpackage of models: its layer)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO / package).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join(("resmlp", package, *parts))] = path
    return found


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The resmlp modules `path` imports anywhere in its body; `from resmlp.x import y`
    counts as resmlp.x.y when y is a module, else as resmlp.x."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("resmlp."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("resmlp."):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return out


def layer(module: str) -> int:
    return TOP if module in COMMAND_LINE else LAYER[module.split(".")[1]]


GRAPH = {name: imports_of(path, modules()) for name, path in modules().items()}


def test_every_package_has_a_layer_and_every_import_is_known():
    top_level = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and any(p.glob("*.py"))}
    top_level -= {"tests", "docs", "studies"}  # scripts that use the package, not parts of it
    assert top_level <= set(PACKAGES), f"a package without a layer: {top_level - set(PACKAGES)}"
    unknown = {(m, i) for m, deps in GRAPH.items() for i in deps if i not in GRAPH}
    assert not unknown, f"imports of modules that do not exist: {sorted(unknown)}"


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} (layer {layer(m)}) imports {i} (layer {layer(i)})"
                  for m, deps in graph.items() for i in deps if layer(i) > layer(m))


def find_loop(graph: dict[str, set[str]]) -> list[str] | None:
    """A loop of imports as a path (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        path = path + [m]
        for i in sorted(graph.get(m, ())):
            if state.get(i) == 1:
                return path[path.index(i):] + [i]
            if state.get(i) != 2:
                loop = visit(i, path)
                if loop:
                    return loop
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            loop = visit(m, [])
            if loop:
                return loop
    return None


def test_no_import_goes_up_a_layer():
    assert not upward(GRAPH), "\n".join(upward(GRAPH))


def test_no_modules_import_each_other():
    loop = find_loop(GRAPH)
    assert loop is None, " -> ".join(loop)


def test_the_command_table_names_modules_that_exist():
    from resmlp.core.cli import COMMANDS
    for name, command in COMMANDS.items():
        module = command.target.split(":")[0]
        assert module in GRAPH, f"command {name}: {module} is not a module of the package"


def test_the_checks_catch_what_they_are_for():
    # the loops and the upward imports this layout once had
    assert upward({"resmlp.data.inspect": {"resmlp.data.crop_plan", "resmlp.ssl.crop_plan"}}) == \
        ["resmlp.data.inspect (layer 1) imports resmlp.ssl.crop_plan (layer 2)"]
    assert upward({"resmlp.supervised.compare": {"resmlp.core.cli"}})
    assert not upward({"resmlp.core.cli": {"resmlp.ssl.train", "resmlp.eval.knn"}})
    loop = {"resmlp.eval.command": {"resmlp.models.checkpoints"}, "resmlp.models.from_config": {"resmlp.models.checkpoints"},
            "resmlp.models.checkpoints": {"resmlp.models.from_config", "resmlp.core.checkpoint"}}
    assert find_loop(loop) == ["resmlp.models.checkpoints", "resmlp.models.from_config", "resmlp.models.checkpoints"]
    assert find_loop({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def tool_imports(path: Path, tools: set) -> list[str]:
    """The imports in `path` (anywhere in its body) of a package of tools/ (`tools`: their names)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        found += [n for n in names if n.split(".")[0] in tools or n.split(".")[0] == "tools"]
    return found


def test_no_module_of_the_package_imports_a_tool(tmp_path):
    tools = {p.name for p in (REPO / "tools").iterdir() if (p / "__init__.py").is_file()}
    assert {"bench", "campaign"} <= tools
    found = [f"{path.relative_to(REPO)} imports {name}" for path in modules().values()
             for name in tool_imports(path, tools)]
    assert not found, "\n".join(found)
    planted = tmp_path / "imports_a_tool.py"   # the check finds one where there is one
    planted.write_text("import os\n\ndef f():\n    from bench.step import call_step\n    import campaign.call, json\n")
    assert tool_imports(planted, tools) == ["bench.step", "campaign.call"]


MAX_FILE_LINES, MAX_FUNCTION_LINES = 800, 80
# Files held below the limit (issue 52: the model's file after its fused options left it)
LONGEST_FILES = {"models/resmlp.py": 720}


def too_long(path: Path, name: str) -> list[str]:
    """Where `path` (shown as `name`) is past the limits: the file, then each function or
    method longer than MAX_FUNCTION_LINES (decorators left out; a nested function counts in
    its own length and in its parent's)."""
    text = path.read_text()
    limit = LONGEST_FILES.get(name, MAX_FILE_LINES)
    lines = len(text.splitlines())
    found = [f"{name}: {lines} lines (at most {limit})"] if lines > limit else []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_no_file_or_function_of_the_package_is_too_long():
    found = [line for path in sorted(set(modules().values()))
             for line in too_long(path, str(path.relative_to(REPO)))]
    assert not found, "split these:\n" + "\n".join(found)


def test_the_length_check_finds_what_is_too_long(tmp_path):
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))   # with its def, one line too many
    planted = tmp_path / "long.py"
    planted.write_text(f"def short():\n    return 1\n\n\n@staticmethod\ndef long():\n{body}\n")
    assert too_long(planted, "long.py") == [f"long.py:6 long: {MAX_FUNCTION_LINES + 1} lines (at most "
                                            f"{MAX_FUNCTION_LINES})"]
    planted.write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert too_long(planted, "long.py") == [f"long.py: {MAX_FILE_LINES + 1} lines (at most {MAX_FILE_LINES})"]
    assert too_long(planted, "models/resmlp.py")[0].endswith("(at most 720)")
