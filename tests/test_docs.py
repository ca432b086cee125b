"""The docs stay true to the code (issue 45): in README.md, docs/*.md and tools/campaign/README.md
every relative link leads to a file (and a heading, for a link to one), every `bash run.sh
<command>` names a command `bash run.sh help` lists, and every key=value on such a command line,
or alone in a code span, is a key of a config. Every file path named there (and in docs/'s
dated reports, tools/bench/NOTES.md and the module docstrings of the code, the tools, the
studies and the tests) names a file that exists. The README stays short enough to read.

The checker is tested on small planted texts below, so that a checker that finds nothing fails.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from resmlp.core import cli
from resmlp.core.config import CONFIG_DIR, available, load_config
from resmlp.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 320  # issue 45: about 300 lines, the rest in docs/


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    campaign = ROOT / "tools" / "campaign" / "README.md"
    return files + ([campaign] if campaign.exists() else [])


# --- the markdown: code apart from prose ---------------------------------------------------

FENCE = re.compile(r"^ {0,3}(```|~~~)")


def split_fences(text: str) -> tuple[list[str], list[str]]:
    """(the prose lines, with fenced code blanked; the fenced blocks, each as one text)."""
    prose, blocks, block, fence = [], [], None, None
    for line in text.splitlines():
        m = FENCE.match(line)
        if block is None and m:
            block, fence = [], m.group(1)
            prose.append("")
        elif block is not None and line.strip().startswith(fence):
            blocks.append("\n".join(block))
            block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    if block is not None:
        blocks.append("\n".join(block))
    return prose, blocks


def code_spans(prose: list[str]) -> list[str]:
    """The inline code spans of the prose, paragraph by paragraph (a span may cross a line
    break, never a blank line); a line break inside one is a space, as markdown renders it."""
    spans = []
    for para in re.split(r"\n\s*\n", "\n".join(prose)):
        for m in re.finditer(r"(`+)(.+?)(?<!`)\1(?!`)", para, re.S):
            spans.append(" ".join(m.group(2).split()))
    return spans


def without_code(prose: list[str]) -> str:
    text = "\n".join(prose)
    return re.sub(r"(`+).+?(?<!`)\1(?!`)", "", text, flags=re.S)


# --- links -----------------------------------------------------------------------------------

def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its text without markup, lower case, every character but
    letters, digits, '-', '_' and spaces dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or an image: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*\*|__|\*)(.+?)\1", r"\2", text)  # emphasis, not underscores inside words
    return "".join(c for c in text.strip().lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose, _ = split_fences(text)
    seen: dict[str, int] = {}
    found = set()
    for line in prose:
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        a = github_anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        found.add(a if n == 0 else f"{a}-{n}")
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", "\n".join(prose)))
    return found


def link_targets(text: str) -> list[str]:
    prose, _ = split_fences(text)
    body = without_code(prose)
    targets = [m.group(1) for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", body)]
    targets += re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?\s*$", body, re.M)  # [ref]: target
    targets += re.findall(r"<(?:a|img)\s[^>]*(?:href|src)=\"([^\"]+)\"", body)
    return targets


def link_problems(path: Path, text: str) -> list[str]:
    """Every relative link of `text` (the file at `path`) that leads nowhere."""
    problems = []
    for target in link_targets(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:: not ours to check
            continue
        file_part, _, anchor = target.partition("#")
        if not file_part:
            if anchor not in anchors(text):
                problems.append(f"{path.name}: link to {target}: no heading #{anchor} here")
            continue
        dest = (path.parent / file_part).resolve()
        if not dest.exists():
            problems.append(f"{path.name}: link to {target}: no {file_part}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{path.name}: link to {target}: no heading #{anchor} in {dest.name}")
    return problems


# --- commands and keys -----------------------------------------------------------------------

@lru_cache(maxsize=None)
def listed_commands() -> frozenset:
    """What `bash run.sh help` lists (run.sh may list tools the package's own help does not),
    run with this interpreter; `help` and `test` count as listed."""
    env = {**os.environ, "RESMLP_PYTHON": sys.executable}
    out = subprocess.run(["bash", str(ROOT / "run.sh"), "help"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    # a command's line: indented, its name (and <argument>), then its description two spaces on
    names = re.findall(r"^ {2}([a-z][a-z0-9_-]*)(?: <[^>]+>)? {2,}\S", out, re.M)
    assert {"dino", "knn"} <= set(names), f"no commands found in `bash run.sh help`:\n{out}"
    return frozenset({*names, "help", "test"})


def shell_words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unclosed quote: a command inside another language's string
        return line.split("#", 1)[0].split()


def run_sh_lines(text: str) -> list[str]:
    """The words after every `bash run.sh` in the fenced blocks and code spans of `text`."""
    prose, blocks = split_fences(text)
    texts = [b.replace("\\\n", " ") for b in blocks] + code_spans(prose)
    found = []
    for t in texts:
        for line in t.splitlines():
            for m in re.finditer(r"(?:^|[\s;&|(\"'])bash run\.sh(?=\s|$)(.*)", line):
                rest = re.split(r"&&|\|\||;|\)", m.group(1))[0]  # the shell's separators end it
                found.append(rest)
    return found


ASSIGN = re.compile(r"^\+?([A-Za-z_][\w.]*)=")
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]+$")  # NPROC_PER_NODE=8: the shell's, not the config's


def placeholder(word: str) -> bool:
    return word.startswith(("<", "[", "...", "$")) or word in ("|", "...")


@lru_cache(maxsize=None)
def configs_of(command: str, model: str | None, data: str | None) -> tuple:
    """The command's merged config (defaults, its method, the data set's file, the recipe), as
    core/config.py builds it; a run.sh tool that is not a command of the package also holds
    the keys of the YAML files under its tools/<command>/ folder."""
    try:
        cfg = load_config(command, model, [f"data={data}"] if data else [])
    except UserError:  # e.g. a data set that needs data.root: its file's keys all the same
        cfg = OmegaConf.merge(load_config(command, model, []), OmegaConf.load(CONFIG_DIR / "data" / f"{data}.yaml"))
    tools = [] if command in cli.COMMANDS else sorted((ROOT / "tools" / command).rglob("*.yaml"))
    return (cfg, *(OmegaConf.load(p) for p in tools))


@lru_cache(maxsize=None)
def every_config() -> tuple:
    """The configs of every command on every data set and of run.sh's tools (with every YAML of
    a tool's folder: tools/bench's profile.yaml, the keys of `python -m bench.profile`)."""
    tools = listed_commands() - set(cli.COMMANDS) - {"help", "test"}
    return tuple(c for command in cli.COMMANDS for data in available("data") for c in configs_of(command, None, data)) \
        + tuple(c for tool in sorted(tools) for c in configs_of(tool, None, None))


ABSENT = object()
ALIASES = {alias for spec in cli.COMMANDS.values() for alias in spec.aliases}


def holds(configs: tuple, key: str) -> bool:
    return any(OmegaConf.select(c, key, default=ABSENT, throw_on_resolution_failure=False) is not ABSENT
               for c in configs)


def command_problems(line: str, commands: frozenset) -> list[str]:
    """What is wrong with one `bash run.sh` command line (the words after `bash run.sh`)."""
    words = shell_words(line)
    if not words or placeholder(words[0]):
        return []
    name, rest = words[0], words[1:]
    if name not in commands:
        return [f"`bash run.sh {line.strip()}`: {name!r} is not a command `bash run.sh help` lists"]
    if name in ("help", "test"):
        return []
    spec = cli.COMMANDS.get(name)
    positional = None
    if spec is not None and spec.positional and rest and "=" not in rest[0]:
        positional, rest = rest[0], rest[1:]
    overrides = [w for w in rest if ASSIGN.match(w)]
    if spec is not None:
        overrides = cli.expand_aliases(overrides, spec.aliases)
    given = {ASSIGN.match(o).group(1): o.split("=", 1)[1] for o in overrides}
    problems = []
    model = given.get("model") or (positional if spec is not None and spec.positional == "model" else None)
    if model is not None and placeholder(model):
        model = None
    if model is not None:
        try:
            cli.check_model(model, name)
        except UserError as e:
            problems.append(f"`bash run.sh {line.strip()}`: {e}")
            model = None
    data = given.get("data")
    if data is not None and (placeholder(data) or data not in available("data")):
        if not placeholder(data):
            problems.append(f"`bash run.sh {line.strip()}`: no data set {data!r} in configs/data/")
        data = None
    configs = configs_of(name, model, data)
    for o in overrides:
        key = ASSIGN.match(o).group(1)
        if key in ("data", "model") or holds(configs, key):
            continue
        problems.append(f"`bash run.sh {line.strip()}`: no config of `{name}` holds the key {key!r}")
    if spec is not None and not problems:  # a key the command would not read is refused as well
        here = [] if given.get("launcher") == "slurm" else [replace(spec, ignores=cli.RUNS_HERE)]
        try:
            for rules in (spec, *here):
                cli.check_read(name, rules, overrides)
        except UserError as e:
            problems.append(f"`bash run.sh {line.strip()}`: {e}")
    return problems


def span_key_problems(span: str) -> list[str]:
    """A code span of key=value words alone (`dino.koleo_weight=0.1`): each key must be a
    config's. An upper-case name is an environment variable (`NPROC_PER_NODE=8`)."""
    words = span.split()
    if not words or not all(ASSIGN.match(w) for w in words):
        return []
    problems = []
    for w in words:
        key = ASSIGN.match(w).group(1)
        if not (ENV_NAME.match(key) or key in ("data", "model") or key in ALIASES or holds(every_config(), key)):
            problems.append(f"`{span}`: no config holds the key {key!r}")
    return problems


def text_problems(path: Path, text: str) -> list[str]:
    commands = listed_commands()
    problems = link_problems(path, text)
    for line in run_sh_lines(text):
        problems += command_problems(line, commands)
    prose, _ = split_fences(text)
    for span in code_spans(prose):
        if "bash run.sh" not in span:
            problems += span_key_problems(span)
    return problems


# --- file paths named in prose and docstrings ------------------------------------------------

# folders then a file with a known suffix: core/cli.py, tools/bench/NOTES.md, ../README.md
FILE_PATH = re.compile(r"(?<![\w./<>$*{~-])((?:[\w.-]+/)+[\w-][\w.-]*\.(?:py|md|yaml|sh|toml|txt|json|jsonl))(?![\w/])")
OURS = {"core", "models", "data", "ssl", "eval", "supervised", "configs", "tools", "tests", "docs", "studies"}


@lru_cache(maxsize=None)
def ignored_folders() -> frozenset:
    """The folders .gitignore names (runs/, .baselines/, ...): what commands write, not files of the repository."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return frozenset(line.strip().strip("/") for line in lines if line.strip().endswith("/"))


def path_problems(where: Path, text: str) -> list[str]:
    """Each file path named in `text` (the file at `where`) that leads to no file, looked for from
    the repository and from the text's own folder. Not checked: an output's (in a folder git
    ignores) and another project's (under an importable package not of this one:
    torch/_decomp/...); a web address never matches (each of its parts follows a / or a letter)."""
    import importlib.util
    problems = []
    for m in FILE_PATH.finditer(text):
        path = m.group(1)
        first = Path(path).parts[0]
        if (ROOT / path).exists() or (where.parent / path).exists() or first in ignored_folders():
            continue
        tools = {t.name for t in (ROOT / "tools").iterdir() if t.is_dir()}
        if first not in OURS | tools and importlib.util.find_spec(first) is not None:
            continue
        problems.append(f"{where.relative_to(ROOT) if where.is_relative_to(ROOT) else where.name}: "
                        f"{path} is not a file of the repository")
    return problems


def docstring_files() -> list[Path]:
    """Every Python file of the code, the tools, the studies and the tests."""
    return sorted(p for folder in OURS - {"configs", "docs"} for p in (ROOT / folder).rglob("*.py"))


# --- the docs --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_are_true(path):
    problems = text_problems(path, path.read_text())
    assert not problems, "\n".join(problems)


def test_every_file_a_page_names_exists():
    pages = [*doc_files(), *sorted((ROOT / "docs").rglob("*/*.md")), *sorted((ROOT / "tools").rglob("*.md"))]
    problems = [p for page in dict.fromkeys(pages) for p in path_problems(page, page.read_text())]
    assert not problems, "\n".join(problems)


def test_every_file_a_module_docstring_names_exists():
    import ast
    problems = [p for path in docstring_files()
                for p in path_problems(path, ast.get_docstring(ast.parse(path.read_text())) or "")]
    assert not problems, "\n".join(problems)


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): "
                                       "move the detail to a page under docs/ and link to it")


# --- the checker itself, on planted texts ----------------------------------------------------

def test_a_link_to_nothing_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# A heading: `with` code\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    good = "[a](there.md) [b](there.md#a-heading-with-code) [c](there.md#twice-1) [d](#own) ![e](there.md)\n\n# Own\n"
    assert link_problems(page, good) == []
    bad = "[a](nothere.md) and [b](there.md#no-such-heading) and [c](#nowhere)\n\n# Own\n"
    problems = link_problems(page, bad)
    assert len(problems) == 3, problems
    assert "nothere.md" in problems[0] and "no-such-heading" in problems[1] and "nowhere" in problems[2]
    # a link inside code is text, not a link; a web address is not checked here
    assert link_problems(page, "`[a](nothere.md)`\n\n```\n[b](nothere.md)\n```\n[c](https://x.org/y)") == []


def test_github_anchors():
    assert github_anchor("The DINO data path: whole images, decoded fast") == \
        "the-dino-data-path-whole-images-decoded-fast"
    assert github_anchor("Pretraining on images nobody labeled: `data=folder`") == \
        "pretraining-on-images-nobody-labeled-datafolder"
    assert github_anchor("From released weights: `dino.init`") == "from-released-weights-dinoinit"


def test_an_unknown_command_is_found():
    text = "```bash\nbash run.sh dino resmlp_s12\nbash run.sh pretrain resmlp_s12   # no such command\n```\n"
    problems = text_problems(Path("x.md"), text)
    assert len(problems) == 1 and "'pretrain'" in problems[0], problems
    assert text_problems(Path("x.md"), "`bash run.sh help`, `bash run.sh test tests/test_docs.py`, "
                                       "`bash run.sh <command>`") == []


def test_an_unknown_key_is_found():
    ok = ("```bash\nNPROC_PER_NODE=8 bash run.sh dino resmlp_s12 data=imagenet data.root=/data/x \\\n"
          "    dino.koleo_weight=0.1 'knn.few_labels=[1,5]'\nbash run.sh knn runs/x k=10,20 T=0.07\n```\n"
          "Or `dino.centering=sinkhorn dino.koleo_weight=0.1`, and `NNODES=2`.\n")
    assert text_problems(Path("x.md"), ok) == []
    bad = ("```bash\nbash run.sh dino resmlp_s12 dino.koleo_wieght=0.1\n```\n"
           "Or `bash run.sh knn runs/x knn.kk=5`, and `optim.learning_rate=1`.\n"
           "`bash run.sh supervised resmlp_s12 knn.k=5`, `bash run.sh dino resmlp_s12 slurm.nodes=2`\n")
    problems = text_problems(Path("x.md"), bad)
    assert len(problems) == 5, problems
    assert "launcher=slurm" in problems[3], problems
    assert "'dino.koleo_wieght'" in problems[0] and "'knn.kk'" in problems[1], problems
    assert "'optim.learning_rate'" in problems[4] and "does not read knn.k" in problems[2], problems
    # a key of one command is not a key of another: the checker reads each command's config
    assert command_problems("knn runs/x dino.koleo_weight=0.1", listed_commands())


def test_a_data_set_and_model_that_do_not_exist_are_found():
    problems = command_problems("dino resmlp_s13 data=imagenett", listed_commands())
    assert len(problems) == 2 and "resmlp_s13" in problems[0] and "imagenett" in problems[1], problems


def test_a_path_to_nothing_is_found():
    page = ROOT / "docs" / "x.md"
    text = ("`core/cli.py`, tools/bench/NOTES.md, [a](../README.md), resmlp.ssl's `ssl/step.py`, "
            "https://github.com/x/y/blob/main/z/nothere.py, runs/bench/bench.json, torch/_decomp/decompositions.py, "
            "<out>/bench.json, $OUT/x/y.json\n"
            "tools/campaign/compiling.py and bench/rows.py and ssl/nothere.py (gone)")
    problems = path_problems(page, text)
    assert [p.split(": ")[1].split()[0] for p in problems] == \
        ["tools/campaign/compiling.py", "bench/rows.py", "ssl/nothere.py"], problems
